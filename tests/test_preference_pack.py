"""pack_preference: pairs whole and in order, nothing lost but what the truncation rules say, rows <= max_length.

Packed rows are read back with plain Python (seq_lengths and completion_mask), independently of the packer,
and compared with each input pair cut by the stated rules.
"""

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from packtools.batches.preference import PreferenceCollator
from packtools.batches.sampler import TokenBudgetBatchSampler
from packtools.core.pairs import UnitOptions, fit_pairs, pack_pairs
from packtools.core.plan import plan
from packtools.dpo import pack_preference
from packtools.errors import PackingError

datasets = pytest.importorskip("datasets")


def random_pairs(n, seed, max_prompt=12, max_completion=16):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        rows.append(
            {
                "prompt_ids": rng.integers(1, 1000, int(rng.integers(0, max_prompt + 1))).tolist(),
                "chosen_ids": rng.integers(1, 1000, int(rng.integers(1, max_completion + 1))).tolist(),
                "rejected_ids": rng.integers(1, 1000, int(rng.integers(1, max_completion + 1))).tolist(),
                "idx": i,
            }
        )
    return rows


def to_table(rows):
    return pa.table(
        {
            "prompt_ids": pa.array([r["prompt_ids"] for r in rows], pa.list_(pa.int32())),
            "chosen_ids": pa.array([r["chosen_ids"] for r in rows], pa.list_(pa.int32())),
            "rejected_ids": pa.array([r["rejected_ids"] for r in rows], pa.list_(pa.int32())),
            "idx": pa.array([r["idx"] for r in rows], pa.int64()),
        }
    )


def read_pairs(packed):
    """Cut packed rows into (idx, prompt, chosen, rejected) with plain Python; check each pair's layout."""
    d = packed.to_pydict()
    out = []
    for ids, mask, seq, idx in zip(d["input_ids"], d["completion_mask"], d["seq_lengths"], d["idx"]):
        assert len(seq) == 2 * len(idx), "a row must hold whole pairs: two sequences per pair"
        assert sum(seq) == len(ids) == len(mask)
        start = 0
        for k, pair in enumerate(idx):
            chosen = ids[start : start + seq[2 * k]]
            chosen_mask = mask[start : start + seq[2 * k]]
            start += seq[2 * k]
            rejected = ids[start : start + seq[2 * k + 1]]
            rejected_mask = mask[start : start + seq[2 * k + 1]]
            start += seq[2 * k + 1]
            n_prompt = chosen_mask.count(0)
            assert chosen_mask == [0] * n_prompt + [1] * (len(chosen) - n_prompt)
            assert rejected_mask == [0] * n_prompt + [1] * (len(rejected) - n_prompt)
            assert chosen[:n_prompt] == rejected[:n_prompt], "both sequences of a pair share its prompt"
            out.append((pair, chosen[:n_prompt], chosen[n_prompt:], rejected[n_prompt:]))
    return out


def expected_pair(row, max_length, overlong="truncate", max_prompt_length=None):
    """The stated rules, on one pair, in plain Python."""
    p, c, r = row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]
    if 2 * len(p) + len(c) + len(r) <= max_length:
        return p, c, r
    if overlong == "drop":
        return None
    budget = max_length // 4 if max_prompt_length is None else max_prompt_length
    kp = min(len(p), max(budget, (max_length - len(c) - len(r)) // 2))
    room = max_length - 2 * kp
    cap = max(room // 2, room - min(len(c), len(r)))
    return p[len(p) - kp :], c[:cap], r[:cap]


@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 10_000),
    max_length=st.integers(8, 80),
    overlong=st.sampled_from(["truncate", "drop"]),
)
def test_pairs_whole_in_order_and_exactly_what_the_rules_keep(n, seed, max_length, overlong):
    rows = random_pairs(n, seed)
    packed, report = pack_pairs(to_table(rows), max_length, columns=["idx"], options=UnitOptions(overlong))
    lengths = [len(x) for x in packed.column("input_ids").to_pylist()]
    assert all(0 < x <= max_length for x in lengths)
    got = {pair: (p, c, r) for pair, p, c, r in read_pairs(packed)}
    expected = {row["idx"]: expected_pair(row, max_length, overlong) for row in rows}
    kept = {i: e for i, e in expected.items() if e is not None}
    assert len(got) == len(read_pairs(packed)), "a pair appears once"
    assert got == {i: tuple(e) for i, e in kept.items()}
    assert report.pairs_out == len(kept) and report.pairs_dropped == n - len(kept)
    assert report.tokens_kept == sum(lengths)
    assert report.tokens_in == sum(
        2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in rows
    )
    units = [2 * len(p) + len(c) + len(r) for p, c, r in kept.values()]
    assert report.rows == packed.num_rows == plan(units, max_length).num_rows


def test_rows_reach_the_lower_bound_on_many_pairs():
    rows = random_pairs(3000, 1, max_prompt=40, max_completion=120)
    packed, report = pack_pairs(to_table(rows), 1024)
    assert report.pairs_truncated == 0
    assert (
        packed.num_rows <= report.lower_bound * 1.01
    )  # the 1.001 target is at 1M pairs: benchmarks/bench_dpo.py


def test_truncation_counts_and_warning():
    rows = [
        {"prompt_ids": list(range(1, 11)), "chosen_ids": [20] * 9, "rejected_ids": [30, 31], "idx": 0},
        {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3], "idx": 1},
    ]
    with pytest.warns(UserWarning, match="1 of 2 pairs truncated"):
        packed, report = pack_preference(to_table(rows), 12, columns=["idx"], return_report=True)
    assert (report.prompts_truncated, report.chosen_truncated, report.rejected_truncated) == (1, 1, 0)
    pairs = dict((i, (p, c, r)) for i, p, c, r in read_pairs(packed))
    assert pairs[0] == (
        list(range(8, 11)),
        [20] * 4,
        [30, 31],
    )  # prompt keeps its end, completions their start
    with pytest.warns(UserWarning, match="1 dropped"):
        dropped = pack_preference(to_table(rows), 12, columns=["idx"], overlong="drop")
    assert [i for i, *_ in read_pairs(dropped)] == [1]


def test_dataset_wrapper_follows_select_and_keeps_the_type():
    rows = random_pairs(30, 3)
    ds = datasets.Dataset.from_list(rows).shuffle(seed=0).select(range(10))
    packed = pack_preference(ds, 64, columns=["idx"])
    assert isinstance(packed, datasets.Dataset)
    got = sorted(i for i, *_ in read_pairs(packed.data.table))
    assert got == sorted(ds["idx"])
    dd = pack_preference(datasets.DatasetDict({"train": ds}), 64)
    assert dd["train"].num_rows == packed.num_rows


def test_per_pair_columns_follow_their_pairs():
    rows = random_pairs(25, 4)
    table = to_table(rows).append_column("ref_chosen_logps", pa.array([-float(r["idx"]) for r in rows]))
    packed, _ = pack_pairs(table, 48, columns=["idx", "ref_chosen_logps"])
    d = packed.to_pydict()
    for idx, ref in zip(d["idx"], d["ref_chosen_logps"]):
        assert ref == [-float(i) for i in idx]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(strategy="bfd_split"), "only 'bfd'"),
        (dict(options=UnitOptions(overlong="cut")), "overlong='cut'"),
        (dict(options=UnitOptions(max_prompt_length=20)), "max_prompt_length=20"),
        (dict(columns=["nope"]), "'nope' is not in the table"),
        (dict(columns=["prompt_ids"]), "cannot be a per-pair column"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(PackingError, match=match):
        pack_pairs(to_table(random_pairs(3, 0)), 32, **kwargs)


def test_bad_data_is_refused():
    with pytest.raises(PackingError, match="missing"):
        pack_pairs(pa.table({"prompt_ids": [[1]], "chosen_ids": [[2]]}), 32)
    empty = to_table([{"prompt_ids": [], "chosen_ids": [], "rejected_ids": [3], "idx": 0}])
    with pytest.raises(PackingError, match="row 0: the chosen completion would be empty"):
        pack_pairs(empty, 32)


def test_fit_pairs_never_exceeds_max_length():
    rng = np.random.default_rng(0)
    lp, lc, lr = (rng.integers(0, 300, 5000) for _ in range(3))
    for max_length in (8, 9, 64, 257):
        f = fit_pairs(lp, lc, lr + 1, max_length)
        assert f.pair_lengths.max() <= max_length
        assert (f.chosen_keep >= np.minimum(lc, 1)).all() and (f.rejected_keep >= 1).all()


def test_collator_refuses_a_split_pair():
    """Negative control: a row holding one sequence of a pair (a split pair) is refused, not trained on."""
    packed, _ = pack_pairs(to_table(random_pairs(4, 0)), 64)
    row = {k: v[0] for k, v in packed.to_pydict().items()}
    cut = sum(row["seq_lengths"][:1])
    split = {
        "input_ids": row["input_ids"][:cut],
        "completion_mask": row["completion_mask"][:cut],
        "seq_lengths": row["seq_lengths"][:1],
    }
    collator = PreferenceCollator(0, return_tensors="np")
    assert collator([row])["cu_seq_lens_q"].shape[0] == len(row["seq_lengths"]) + 1
    with pytest.raises(PackingError, match="odd count"):
        collator([split])


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_token_budget_batches_keep_pairs_whole_across_micro_batches_and_ranks(num_replicas):
    rows = random_pairs(200, 5)
    packed = pack_preference(to_table(rows), 96, columns=["idx"])
    lengths = np.array([len(x) for x in packed.column("input_ids").to_pylist()])
    d = packed.to_pylist()
    seen = []
    collator = PreferenceCollator(0, return_tensors="np")
    for rank in range(num_replicas):
        sampler = TokenBudgetBatchSampler(
            lengths, max_tokens=256, num_replicas=num_replicas, rank=rank, seed=0, drop_last=True
        )
        for batch in sampler:
            features = [d[i] for i in batch]
            out = collator(features)
            n_seq = out["cu_seq_lens_q"].shape[0] - 1
            assert n_seq == 2 * sum(len(f["idx"]) for f in features)  # whole pairs only
            seen.extend(i for f in features for i in f["idx"])
    assert len(seen) == len(set(seen)), "no pair twice"
    assert set(seen) <= {r["idx"] for r in rows}


def test_cli_packs_preference_files_into_pair_rows(tmp_path):
    """`packtools pack prefs.jsonl --format preference --tokenizer DIR --out DIR --max-length N`."""
    import json

    from _pipeline_data import build_tokenizer

    from packtools.cli.main import main

    tok_dir = build_tokenizer(str(tmp_path / "tok"))
    src = tmp_path / "prefs.jsonl"
    rows = [
        {"prompt": "what is two plus two? " * k, "chosen": "four " * (k % 3 + 1), "rejected": "five"}
        for k in range(1, 13)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "dpo")
    args = ["pack", str(src), "--format", "preference", "--tokenizer", tok_dir, "--out", out]
    assert main([*args, "--max-length", "96", "--quiet"]) == 0
    ds = datasets.load_from_disk(out)
    assert ds.column_names == ["input_ids", "completion_mask", "seq_lengths"]
    packed = ds.data.table.append_column("idx", pa.array([[0] * (len(s) // 2) for s in ds["seq_lengths"]]))
    pairs = read_pairs(packed)  # whole pairs, shared prompts, completion masks after the prompt
    assert len(pairs) == len(rows) and all(len(x) <= 96 for x in ds["input_ids"])
    assert ds.num_rows < len(rows)  # several pairs per row
