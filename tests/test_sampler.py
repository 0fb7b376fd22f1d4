"""TokenBudgetBatchSampler: token budget, coverage, determinism, equal batch counts and balance across ranks."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtools import PackingError
from packtools.batches.sampler import TokenBudgetBatchSampler, attention_costs


def all_ranks(lengths, max_tokens, replicas, **kw):
    return [
        TokenBudgetBatchSampler(lengths, max_tokens, num_replicas=replicas, rank=r, **kw)
        for r in range(replicas)
    ]


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 20), min_size=0, max_size=40),
    extra=st.integers(0, 30),
    replicas=st.integers(1, 4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 5),
    epoch=st.integers(0, 3),
)
def test_budget_coverage_and_equal_counts(lengths, extra, replicas, shuffle, drop_last, seed, epoch):
    max_tokens = max(lengths, default=0) + extra
    if max_tokens == 0:
        max_tokens = 1
    samplers = all_ranks(lengths, max_tokens, replicas, shuffle=shuffle, seed=seed, drop_last=drop_last)
    for s in samplers:
        s.set_epoch(epoch)
    batches = [list(s) for s in samplers]
    counts = {len(b) for b in batches}
    assert len(counts) == 1 and counts == {len(samplers[0])}
    lens = np.asarray(lengths, dtype=np.int64)
    seen = [i for per_rank in batches for batch in per_rank for i in batch]
    for per_rank in batches:
        for batch in per_rank:
            assert batch and int(lens[batch].sum()) <= max_tokens
    nonzero = {i for i, n in enumerate(lengths) if n > 0}
    assert set(seen) <= nonzero
    if drop_last:
        assert len(seen) == len(set(seen))
    else:
        assert set(seen) == nonzero
        if len(seen) != len(set(seen)):
            # Rows are repeated only once every batch is down to one row (nothing left to split),
            # and only to fill the last step.
            assert all(len(batch) == 1 for per_rank in batches for batch in per_rank)
            assert len(seen) - len(set(seen)) < replicas


def test_row_longer_than_budget_is_an_error_naming_it():
    with pytest.raises(PackingError, match=r"row 2 has 9 tokens, more than max_tokens=8"):
        TokenBudgetBatchSampler([3, 4, 9, 1], max_tokens=8)


def test_deterministic_per_seed_and_epoch():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, 500)
    a = TokenBudgetBatchSampler(lengths, 400, seed=3, num_replicas=2, rank=1)
    b = TokenBudgetBatchSampler(lengths, 400, seed=3, num_replicas=2, rank=1)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) and list(a) != first
    assert len(a) == len(TokenBudgetBatchSampler(lengths, 400, seed=3, num_replicas=2, rank=1))
    c = TokenBudgetBatchSampler(lengths, 400, seed=4, num_replicas=2, rank=1)
    assert list(c) != first
    a.set_epoch(0)
    assert list(a) == first


def test_no_shuffle_is_stable_and_full():
    lengths = [5, 3, 8, 2, 6, 4, 7, 1]
    s = TokenBudgetBatchSampler(lengths, 12, shuffle=False)
    assert list(s) == list(TokenBudgetBatchSampler(lengths, 12, shuffle=False, seed=9))
    # 36 tokens in budgets of 12: best fit decreasing reaches the lower bound here.
    assert len(s) == 3 and s.imbalance()["fill"] == 1.0


def _naive_steps(lengths, max_tokens, replicas, seed):
    """Next-fit batches in shuffled order, dealt round-robin: the usual baseline."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    batches, cur, tok = [], [], 0
    for i in order:
        if tok + lengths[i] > max_tokens:
            batches.append(cur)
            cur, tok = [], 0
        cur.append(i)
        tok += lengths[i]
    batches.append(cur)
    batches = batches[: len(batches) - len(batches) % replicas]
    return [batches[s : s + replicas] for s in range(0, len(batches), replicas)]


def test_balance_across_ranks_beats_naive_split():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(5.5, 1.0, 5000), 1, 2048).astype(np.int64)
    replicas = 8
    s = TokenBudgetBatchSampler(lengths, 8192, num_replicas=replicas, rank=0, seed=1)
    imb = s.imbalance()
    assert imb["tokens"] < 0.01 and imb["cost"] < 0.05
    assert imb["fill"] > 0.99
    # Per-step work (what synchronous ranks wait on) is far more even than a naive next-fit + round-robin.
    steps = _naive_steps(lengths, 8192, replicas, 1)
    naive_cost = np.array([[float((lengths[b] ** 2).sum()) for b in step] for step in steps])
    naive_step_cost = float((naive_cost.max(1) / naive_cost.mean(1) - 1).mean())
    assert imb["step_cost"] < naive_step_cost / 3
    # The report matches what the ranks actually yield.
    per_rank = [
        TokenBudgetBatchSampler(lengths, 8192, num_replicas=replicas, rank=r, seed=1) for r in range(replicas)
    ]
    totals = np.array([sum(int(lengths[b].sum()) for b in sampler) for sampler in per_rank], np.float64)
    assert imb["tokens"] == pytest.approx(totals.max() / totals.mean() - 1)


def test_attention_cost_uses_seq_lengths():
    lengths = np.array([8, 8, 6])
    seqs = [[4, 4], [8], [1, 2, 3]]
    costs = attention_costs(lengths, seqs)
    assert costs.tolist() == [32.0, 64.0, 14.0]
    arrow = pa.array(seqs, pa.list_(pa.int32()))
    assert attention_costs(lengths, arrow).tolist() == costs.tolist()
    chunked = pa.chunked_array([arrow.slice(0, 1), arrow.slice(1)])
    assert attention_costs(lengths, chunked).tolist() == costs.tolist()
    assert attention_costs(lengths).tolist() == [64.0, 64.0, 36.0]
    s = TokenBudgetBatchSampler(lengths, 8, seq_lengths=seqs)
    assert s.costs.tolist() == costs.tolist()
    with pytest.raises(PackingError, match=r"row 2: seq_lengths sum to 5 but lengths\[2\] = 6"):
        attention_costs(lengths, [[4, 4], [8], [5]])
    with pytest.raises(PackingError, match="seq_lengths has 2 rows"):
        attention_costs(lengths, [[8], [8]])


def test_single_replica_imbalance_is_zero():
    s = TokenBudgetBatchSampler([5, 5, 5], 10)
    imb = s.imbalance()
    assert imb["tokens"] == imb["cost"] == imb["step_tokens"] == imb["step_cost"] == 0.0


def test_empty_and_fewer_rows_than_replicas():
    assert list(TokenBudgetBatchSampler([0, 0], 4)) == []
    ranks = all_ranks([3], 4, 3)
    assert [list(s) for s in ranks] == [[[0]], [[0]], [[0]]]  # repeated, like DistributedSampler


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lengths": [1, 2], "max_tokens": 0}, "max_tokens must be an int >= 1"),
        (
            {"lengths": [1, 2], "max_tokens": 4, "num_replicas": 2, "rank": 2},
            "rank=2 must be < num_replicas=2",
        ),
        ({"lengths": [1, -2], "max_tokens": 4}, r"lengths\[1\] = -2 is negative"),
        ({"lengths": [[1, 2]], "max_tokens": 4}, "1-D array"),
        ({"lengths": [1, 2], "max_tokens": 4, "seed": -1}, "seed must be"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(PackingError, match=match):
        TokenBudgetBatchSampler(**kwargs)


def test_sampler_does_not_import_torch():
    code = (
        "import sys; from packtools.batches import TokenBudgetBatchSampler as S; list(S([1, 2, 3], 3)); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_options_after_max_tokens_are_keyword_only():
    with pytest.raises(TypeError):
        TokenBudgetBatchSampler([3, 4], 8, False)  # shuffle only by name
    assert TokenBudgetBatchSampler([3, 4], 8, shuffle=False).shuffle is False


def test_rows_of_no_token_are_said_not_skipped_silently(tmp_path):
    """Rows of 0 tokens were left out without a word by TokenBudgetBatchSampler (no batch holds them),
    PackedRows (a batch skips them) and pack_dataset (the plan drops them; its report had no count), while
    pack_files counts them (``rows_empty``, "empty rows" in its summary).  Each says so now: an
    EmptyRowsWarning naming the count, and pack_dataset's report has ``sequences_empty``."""
    import json
    import warnings

    datasets = pytest.importorskip("datasets")
    from packtools import pack_dataset, pack_files
    from packtools.batches.loader import PackedRows
    from packtools.errors import EmptyRowsWarning

    rows = [[1, 2], [], [3], []]
    with pytest.warns(EmptyRowsWarning, match=r"TokenBudgetBatchSampler: 2 of 4 rows hold no token"):
        s = TokenBudgetBatchSampler([2, 0, 1, 0], 4, shuffle=False)
    assert s.num_empty == 2 and sorted(int(i) for b in s for i in b) == [0, 2]
    with pytest.warns(EmptyRowsWarning, match=r"PackedRows: 2 of 4 rows hold no token"):
        PackedRows(pa.table({"input_ids": rows}))
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    with pytest.warns(EmptyRowsWarning, match=r"pack_dataset: 2 of 4 rows hold no token"):
        packed, report = pack_dataset(ds, 4, return_report=True)
    assert report.sequences_empty == 2 and packed["seq_lengths"] == [[2, 1]]
    with pytest.warns(EmptyRowsWarning, match=r"pack_dataset \(split 'train'\): 2 of 4"):
        pack_dataset(datasets.DatasetDict({"train": ds}), 4)
    with pytest.warns(EmptyRowsWarning, match=r"IterableDataset window\): 2 of 4"):
        list(pack_dataset(ds.to_iterable_dataset(), 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmptyRowsWarning)  # none where no row is empty
        TokenBudgetBatchSampler([2, 1], 4)
        PackedRows(pa.table({"input_ids": [[1, 2], [3]]}))
        pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}), 4)
    src = tmp_path / "a.jsonl"  # pack_files already counted them: its stats say so
    src.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    assert pack_files(str(src), str(tmp_path / "out"), 4).stats["rows_empty"] == 2
