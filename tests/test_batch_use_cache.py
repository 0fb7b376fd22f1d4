"""Packed batches carry ``use_cache=False``: ``model(**batch)`` keeps the packed sequences apart with nothing else.

Llama & co. default to ``use_cache=True``; transformers then builds a ``DynamicCache``, and its ``sdpa``/``eager``
masks read ``position_ids`` for packed sequences only without a cache, so before the key was in the batch a loop
(or a plain ``Trainer``) without ``guard_model`` trained with attention across documents, with no error.  Each
path a batch goes down is checked against the documents run alone, with the key left out
(``return_use_cache=False``) as the negative control: a plain ``Trainer`` step (``Trainer`` itself sets
``config.use_cache`` from ``TrainingArguments.use_cache``, ``False`` unless asked), a PEFT LoRA model, a compiled
model, accelerate's prepared loader (one process; several with ``dispatch_batches``, whose refusal of a non-tensor
is loud, under gloo), and models whose ``forward`` has no ``use_cache``.
"""

from __future__ import annotations

from pathlib import Path

import _launch
import pytest
from _hf_models import PAD, params, reference_training, tiny_llama, torch
from test_hf import LR, run_trainer

from packtools import PaddingFreeCollator
from packtools.integrations.attention.backends import adapt_collator

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
ROW = {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13], "seq_lengths": [4, 5]}


def second_document_gap(model, batch) -> float:
    """How far the packed row's second document is from that document run alone."""
    with torch.no_grad():
        packed = model(**batch).logits[0, 4:]
        alone = model(input_ids=batch["input_ids"][:, 4:], use_cache=False).logits[0]
    return float((packed - alone).abs().max())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_model_called_with_the_batch_alone_keeps_documents_apart(impl):
    model = tiny_llama(impl)  # train mode, config.use_cache=True, no guard
    assert model.config.use_cache and model.training
    batch = PaddingFreeCollator(PAD)([ROW])
    assert batch["use_cache"] is False
    assert second_document_gap(model, batch) < TOL
    bare = PaddingFreeCollator(PAD, return_use_cache=False)([ROW])  # negative control: the config's cache
    assert "use_cache" not in bare and second_document_gap(model, bare) > 1e-3
    padded = PaddingFreeCollator(PAD, padding_free=False, attn_implementation=impl)([ROW, ROW])
    assert padded["use_cache"] is False and second_document_gap(model, padded) < TOL


def trainer_gap(tmp_path, collator) -> float:
    """A plain transformers.Trainer with ``collator``, no prepare_trainer (seq_lengths kept by hand) and
    ``TrainingArguments(use_cache=True)``: how far its parameters land from the sequences trained one by one."""
    _, recorder, trained, _ = run_trainer(
        tmp_path,
        tiny_llama("sdpa"),
        prepare=False,
        remove_unused_columns=False,
        use_cache=True,
        collator=collator,
    )
    reference = tiny_llama("sdpa")
    reference_training(reference, recorder.batches, 2, LR)
    return max(float((trained[k] - v).abs().max()) for k, v in params(reference).items())


def test_plain_trainer_without_prepare_trains_like_one_by_one(tmp_path):
    """transformers.Trainer sets config.use_cache from TrainingArguments.use_cache (False by default, so a plain
    Trainer is safe there); asked for a cache, its compute_loss still calls model(**inputs), where the batch's
    use_cache=False wins.  Negative control: the key left out, the same Trainer trains across documents."""
    assert trainer_gap(tmp_path, PaddingFreeCollator(PAD)) < TOL
    assert trainer_gap(tmp_path, PaddingFreeCollator(PAD, return_use_cache=False)) > 10 * TOL


def test_peft_model_and_compiled_model_get_the_key_through():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_llama("sdpa"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    batch = PaddingFreeCollator(PAD)([ROW])
    assert second_document_gap(model, batch) < TOL
    assert second_document_gap(model, PaddingFreeCollator(PAD, return_use_cache=False)([ROW])) > 1e-3
    compiled = torch.compile(tiny_llama("sdpa"), backend="eager")  # dynamo traces the bool keyword
    assert second_document_gap(compiled, batch) < TOL


def test_accelerate_prepared_loader_keeps_the_key():
    accelerate = pytest.importorskip("accelerate")
    loader = torch.utils.data.DataLoader([ROW], batch_size=1, collate_fn=PaddingFreeCollator(PAD))
    (batch,) = list(accelerate.Accelerator(cpu=True).prepare(loader))
    assert batch["use_cache"] is False and second_document_gap(tiny_llama("sdpa"), batch) < TOL


def test_forward_without_use_cache_gets_no_key():
    """prepare_trainer's collator keeps use_cache only where forward names it: a model without a cache would get
    the key through **kwargs for nothing (and one without **kwargs would raise a TypeError)."""

    class NoCache(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, labels=None, **kwargs): ...

    class Named(torch.nn.Module):
        def forward(self, input_ids, position_ids=None, labels=None, use_cache=None, **kwargs): ...

    collator = PaddingFreeCollator(PAD)
    assert "use_cache" not in adapt_collator(collator, NoCache())([ROW])
    assert adapt_collator(collator, Named())([ROW])["use_cache"] is False
    assert adapt_collator(collator, tiny_llama("sdpa")) is collator


WORKER = """
import os, sys, accelerate, torch
from torch.utils.data import DataLoader, IterableDataset
from packtools import PaddingFreeCollator

class Rows(IterableDataset):
    def __iter__(self):
        yield from [{"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13], "seq_lengths": [4, 5]}] * 4

use_cache = sys.argv[1] == "1"
collator = PaddingFreeCollator(0, return_flash_attn_kwargs=False, return_use_cache=use_cache)
acc = accelerate.Accelerator(cpu=True)
try:
    batch = next(iter(acc.prepare(DataLoader(Rows(), batch_size=1, collate_fn=collator))))
    line = f"KEYS {acc.process_index} {sorted(batch)}"
except TypeError as err:
    line = f"TYPEERROR {acc.process_index} {err}"
os.write(1, (line + "\\n").encode())  # one write: the two ranks share the pipe (print's pieces interleaved)
"""


@pytest.mark.slow  # two torchrun launches (~30 s on 2 cores)
def test_dispatch_batches_refuses_the_key_loudly(tmp_path):
    """accelerate's dispatch_batches (an IterableDataset under several processes) concatenates every value of
    the batches as tensors: the key is a TypeError on rank 0 (as max_length_q already is), never a silent
    change; with return_use_cache=False (and no flash kwargs) the batches go through."""
    pytest.importorskip("accelerate")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = {}
    for flag in ("1", "0"):
        log = tmp_path / f"torchrun-{flag}.log"
        out[flag] = _launch.torchrun(2, script, flag, log=log, timeout=300, check=False)[1]
    assert "TYPEERROR 0" in out["1"] and "bool" in out["1"], out["1"]  # accelerate names the type
    assert "KEYS 0" not in out["1"]
    for rank in (0, 1):
        assert f"KEYS {rank} ['input_ids', 'labels', 'position_ids', 'seq_idx']" in out["0"], out["0"]


PAIR = {
    "input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13],
    "completion_mask": [0, 1, 1, 1, 0, 1, 1, 1, 1],
    "seq_lengths": [4, 5],
}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_preference_collator_batch_alone_keeps_the_pair_apart(impl):
    """``model(**PreferenceCollator(pad)(rows))`` with the config's ``use_cache=True`` and no guard: before, the
    padding-free batch had no ``use_cache`` key and the rejected sequence attended to the chosen one (0.54 in
    the logits), silently.  TRL's padded layout (one sequence per row) goes to TRL's forward and has no key."""
    from packtools.batches.preference import PreferenceCollator

    model = tiny_llama(impl)
    batch = PreferenceCollator(PAD)([PAIR])
    assert batch["use_cache"] is False
    batch.pop("labels")
    assert second_document_gap(model, batch) < TOL
    bare = PreferenceCollator(PAD, return_use_cache=False)([PAIR])  # negative control: the config's cache
    bare.pop("labels")
    assert "use_cache" not in bare and second_document_gap(model, bare) > 1e-3
    trl_layout = PreferenceCollator(PAD, padding_free=False)(
        [{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}]
    )
    assert "use_cache" not in trl_layout


def test_tree_and_context_parallel_batches_carry_the_key_and_need_no_more():
    """TreeCollator's and ContextParallelCollator's batches carry ``use_cache=False`` like the other collators'
    (``return_use_cache=False`` leaves it out).  Their attention (``packtools_tree``, ``packtools_cp``) builds
    its own per-document mask, so with the config's cache they stay exact too: the key saves the cache, it is
    not what keeps the documents apart there."""
    import datasets

    from packtools.batches.context_parallel import ContextParallelCollator
    from packtools.batches.tree import TreeCollator
    from packtools.dpo import pack_preference
    from packtools.integrations.attention.context_parallel import use_cp_attention
    from packtools.integrations.attention.tree import use_tree_attention

    pairs = datasets.Dataset.from_dict(
        {
            "prompt_ids": [[5, 6, 7], [8, 9]],
            "chosen_ids": [[10, 11], [12]],
            "rejected_ids": [[13], [14, 15, 16]],
        }
    )
    rows = pack_preference(pairs, 32, share_prompt=True).to_list()
    model = tiny_llama("sdpa").eval()
    use_tree_attention(model)
    batch = TreeCollator()(rows)
    assert batch["use_cache"] is False and "use_cache" not in TreeCollator(return_use_cache=False)(rows)
    batch.pop("labels")
    with torch.no_grad():
        assert (model(**batch).logits - model(**{**batch, "use_cache": True}).logits).abs().max() < TOL

    model = tiny_llama("sdpa").eval()
    use_cp_attention(model)
    shard = ContextParallelCollator(PaddingFreeCollator(PAD), cp_size=1, cp_rank=0)([ROW])
    assert shard["use_cache"] is False
    bare = ContextParallelCollator(PaddingFreeCollator(PAD), cp_size=1, cp_rank=0, return_use_cache=False)(
        [ROW]
    )
    assert "use_cache" not in bare
    alone = bare["input_ids"][:, 4:9]  # the second document: chunks padded to 2 x cp_size, it starts at 4
    with torch.no_grad():
        expected = model(input_ids=alone, use_cache=False).logits[0]
        for b in (shard, bare):
            assert (model(**b).logits[0, 4:9] - expected).abs().max() < TOL
