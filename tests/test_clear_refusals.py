"""Refusals that used to surface as other libraries' errors or give a wrong fix (adversarial-2026-12b U9, U11,
U12; newcomer-2026-12b 5, 6): each now names the cause and the fix."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from packtools import PackingError
from packtools.core import pack_table, unpack


# -- U9: an empty completion, shared prompt or not ------------------------------------------------------------
def _pairs(chosen):
    return pa.table(
        {
            "prompt_ids": [[1, 2, 3], [4, 5]],
            "chosen_ids": [[6, 7], chosen],
            "rejected_ids": [[8], [9, 10]],
        },
        schema=pa.schema([(n, pa.list_(pa.int32())) for n in ("prompt_ids", "chosen_ids", "rejected_ids")]),
    )


@pytest.mark.parametrize("share_prompt", [False, True])
def test_an_empty_chosen_completion_is_refused_either_way(share_prompt):
    from packtools.dpo import pack_preference

    with pytest.raises(PackingError, match=r"row 1: .*completion would be empty.*log-probability 0") as err:
        pack_preference(_pairs([]), 16, share_prompt=share_prompt)
    assert "Filter pairs with an empty completion out" in str(err.value)
    pack_preference(_pairs([11]), 16, share_prompt=share_prompt)  # the same pair with a token packs


# -- U12: the input changes while it is read --------------------------------------------------------------------
def test_a_file_cut_while_packing_says_so_not_malformed_json(tmp_path, monkeypatch):
    from packtools.io import files
    from packtools.io.discover import discover

    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [i, i + 1, i + 2]}) + "\n" for i in range(50)))
    (found,) = discover([str(src)])
    with open(src, "r+b") as fh:  # a writer cuts the file mid-line after the run found it
        fh.truncate(os.path.getsize(src) - 7)
    with pytest.raises(
        PackingError, match=r"changed while packing \(\d+ bytes when the run started, \d+ now\)"
    ):
        list(files.iter_part(files.Part(found)))


def test_a_file_cut_at_a_line_end_while_packing_is_no_silent_loss(tmp_path):
    from packtools.io import files
    from packtools.io.discover import discover

    src = tmp_path / "rows.jsonl"
    lines = [json.dumps({"input_ids": [i, i + 1]}) + "\n" for i in range(10)]
    src.write_text("".join(lines))
    (found,) = discover([str(src)])
    src.write_text("".join(lines[:7]))  # three rows gone, every line whole
    with pytest.raises(PackingError, match="changed while packing"):
        list(files.iter_part(files.Part(found)))
    (again,) = discover([str(src)])  # found again: read as it is now
    assert sum(t.num_rows for _, t in files.iter_part(files.Part(again))) == 7


def test_pack_files_on_a_file_cut_during_the_run(tmp_path, monkeypatch):
    """Through the whole pipeline: the cut between finding the file and reading it (the finding's window)."""
    from packtools.pipeline import run

    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [i, i + 1, i + 2]}) + "\n" for i in range(200)))
    real = run.split_file

    def cut_then_split(file, *args, **kwargs):
        with open(file.path, "r+b") as fh:
            fh.truncate(file.size - 5)
        return real(file, *args, **kwargs)

    monkeypatch.setattr(run, "split_file", cut_then_split)
    with pytest.raises(PackingError, match="changed while packing") as err:
        run.pack_files([str(src)], str(tmp_path / "out"), max_length=16)
    assert "malformed JSON" not in str(err.value).split("reading it failed")[0]


# -- newcomer 6: unpack on a datasets.Dataset ---------------------------------------------------------------
def test_unpack_takes_a_datasets_dataset():
    datasets = pytest.importorskip("datasets")
    from packtools import pack_dataset

    rows = [{"input_ids": list(range(1, n + 1))} for n in (5, 3, 7, 2, 6)]
    packed = pack_dataset(datasets.Dataset.from_list(rows), 8, "bfd_split")
    got = unpack(packed)
    assert isinstance(got, pa.Table)
    assert sorted(map(tuple, got.column("input_ids").to_pylist())) == sorted(
        tuple(r["input_ids"]) for r in rows
    )
    # a selection of the dataset is unpacked as selected (not the table under it)
    first = unpack(packed.select([0]))
    assert first.num_rows == len(packed[0]["seq_lengths"])
    with pytest.raises(PackingError, match="unpack takes a pyarrow.Table or a datasets.Dataset"):
        unpack([[1, 2, 3]])


def test_unpack_of_a_table_is_unchanged():
    t = pack_table(pa.table({"input_ids": [[1, 2], [3], [4, 5, 6]]}), 4)
    assert sorted(map(tuple, unpack(t).column("input_ids").to_pylist())) == [(1, 2), (3,), (4, 5, 6)]


# -- U11, newcomer 5: trainer-side refusals ---------------------------------------------------------------------
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_a_compiled_model_is_refused_with_the_fix_that_works():
    from _hf_models import tiny_llama

    from packtools.integrations.attention.backends import check_attention_implementation

    compiled = torch.compile(tiny_llama("sdpa"))
    with pytest.raises(PackingError, match=r"compiled.*TrainingArguments\(torch_compile=True\)") as err:
        check_attention_implementation(compiled)
    assert "flash_attention_2" not in str(err.value)
    assert check_attention_implementation(tiny_llama("sdpa")) == "sdpa"


class PadsNested:
    """A collator that fails on packed rows as tokenizer.pad does on ragged nested lists."""

    def __call__(self, rows):
        if any(len(r.get("seq_lengths", [])) > 1 for r in rows):
            raise ValueError("Unable to create tensor ... Perhaps your features have excessive nesting")
        return {"input_ids": torch.tensor([r["input_ids"] for r in rows])}


def test_a_collator_failing_in_the_probe_is_named():
    """A collator that raises on the probe's packed rows (transformers' default collator on rows that each hold
    one sequence passes the check of real batches, then fails there): the refusal names the collator and the fix,
    not "excessive nesting" from inside the probe."""
    from _hf_models import tiny_llama

    from packtools.integrations import check_isolation

    with pytest.raises(
        PackingError, match=r"data collator \(PadsNested\) failed on the isolation probe"
    ) as err:
        check_isolation(tiny_llama("sdpa"), PadsNested())
    assert "excessive nesting" in str(err.value) and "PaddingFreeCollator" in str(err.value)


def test_fewer_rows_than_processes_is_refused_naming_the_fix():
    """U10 in one process: the per-rank sampler of 2 processes over 1 packed row (was: 0 batches on a rank and
    Trainer's "args.max_steps must be set"); the 2-process run is in test_distributed.py."""
    from types import SimpleNamespace

    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.trainers.loader import make_sampler

    def trainer(rank):
        args = SimpleNamespace(
            world_size=2, process_index=rank, per_device_train_batch_size=2, seed=0, data_seed=None
        )
        return SimpleNamespace(args=args)

    with pytest.raises(PackingError, match=r"1 training row\(s\) cannot give each of 2 processes a batch"):
        make_sampler(trainer(0), [0], None, RankLayout(0, 2))
    assert [len(make_sampler(trainer(r), [0, 1], None, RankLayout(r, 2))) for r in (0, 1)] == [1, 1]


class AddsMask:
    """A collator that adds an all-ones attention_mask to padding-free batches (what SFTTrainer's default does)."""

    def __init__(self):
        from packtools import PaddingFreeCollator

        self.inner = PaddingFreeCollator(0, return_flash_attn_kwargs=False, return_seq_idx=False)

    def __call__(self, rows):
        batch = self.inner(rows)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch


def test_the_leak_refusal_names_the_collator_and_the_argument_to_change():
    """newcomer 5: the refusal of a collator that adds an attention_mask names it and `data_collator=`."""
    from _hf_models import tiny_llama

    from packtools.integrations import check_isolation

    with pytest.raises(PackingError, match=r"from AddsMask\)") as err:
        check_isolation(tiny_llama("sdpa"), AddsMask())
    assert "data_collator=packtools.PaddingFreeCollator(tokenizer.pad_token_id)" in str(err.value)


# -- a loaded tokenizer object where a folder is taken (data44) -----------------------------------------------
def test_a_tokenizer_object_is_refused_naming_save_pretrained(tmp_path):
    """``pack_files`` / ``profile_files`` take the tokenizer's folder (its files decide the ids and the cache
    keys); a loaded tokenizer object, the natural thing to pass in a notebook, failed with os.fspath's
    TypeError. Now one PackingError names ``tokenizer=`` and ``save_pretrained``, and nothing is written."""
    from packtools import pack_files, profile_files

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")

    class Tokenizer:  # what a user holds: any object that is not a path
        pass

    out = tmp_path / "out"
    for call in (
        lambda: pack_files(str(src), str(out), max_length=8, tokenizer=Tokenizer()),
        lambda: profile_files(str(src), tokenizer=Tokenizer(), stage_cache=False),
    ):
        with pytest.raises(
            PackingError, match=r"got a Tokenizer; save it with tokenizer.save_pretrained"
        ) as err:
            call()
        assert err.value.param == "tokenizer"
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
