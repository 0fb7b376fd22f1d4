"""Static shapes: bucket choice, bucketed padding-free batches, the sampler's buckets, compile counts."""

import itertools

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packtools import packed_view
from packtools.batches import choose_buckets
from packtools.batches.buckets import bucket_for, bucket_padding, pad_cu_seq_lens
from packtools.batches.collate import IGNORE_INDEX, PaddingFreeCollator
from packtools.batches.sampler import TokenBudgetBatchSampler
from packtools.errors import PackingError
from packtools.profiling import LengthProfile


def padding_of(lengths, buckets):
    return sum(min(b for b in buckets if b >= x) - x for x in lengths)


def brute_force(lengths, k, top=None):
    """Least padding over every choice of at most k sizes among the lengths (plus top), the largest on top."""
    values = sorted(set(lengths) | ({top} if top else set()))
    best = None
    for r in range(k):
        for combo in itertools.combinations(values[:-1], r):
            pad = padding_of(lengths, (*combo, values[-1]))
            best = pad if best is None else min(best, pad)
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=12),
    st.integers(1, 5),
    st.one_of(st.none(), st.integers(60, 70)),
)
def test_choose_buckets_is_optimal(lengths, k, top):
    buckets = choose_buckets(lengths, k, top=top)
    assert len(buckets) <= k and list(buckets) == sorted(set(buckets))
    assert buckets[-1] == max(max(lengths), top or 0)
    assert padding_of(lengths, buckets) == brute_force(lengths, k, top)


def test_bucket_helpers_by_hand():
    lengths = [100, 120, 300, 310, 320]
    assert choose_buckets(lengths, 2) == (120, 320)
    # pads 20 + 20 + 10 over 2 * 120 + 3 * 320 = 1200 padded tokens
    assert bucket_padding(lengths, (120, 320)) == pytest.approx(50 / 1200)
    assert bucket_padding(lengths, (320,)) == pytest.approx(1 - 1150 / 1600)
    assert choose_buckets(lengths, 5) == (100, 120, 300, 310, 320)
    assert bucket_padding(lengths, choose_buckets(lengths, 5)) == 0.0
    assert choose_buckets([5, 6, 7, 20], 2, multiple_of=8, top=32) == (8, 32)
    assert bucket_for(121, (120, 320)) == 320 and bucket_for(120, (120, 320)) == 120
    assert pad_cu_seq_lens(np.array([0, 2, 5], np.int32), 4).tolist() == [0, 2, 5, 5]


def test_many_distinct_lengths_are_coarsened_and_still_cover_everything():
    lengths = np.random.default_rng(0).integers(1, 100_000, 20_000)
    buckets = choose_buckets(lengths, 8)
    assert len(buckets) <= 8 and buckets[-1] >= lengths.max()
    assert bucket_padding(lengths, buckets) < bucket_padding(lengths, (buckets[-1],))


def check_contract(batch, total_in, target):
    ids, labels, pos = batch["input_ids"][0], batch["labels"][0], batch["position_ids"][0]
    cu = batch["cu_seq_lens_q"]
    assert ids.shape[0] == labels.shape[0] == pos.shape[0] == target
    assert cu.dtype == np.int32 and cu[0] == 0 and cu[-1] == target
    real = cu[: np.searchsorted(cu, target) + 1]  # without the repeated tail
    assert np.all(np.diff(real) > 0)
    for a, b in zip(real[:-1], real[1:]):
        assert pos[a:b].tolist() == list(range(b - a))
        assert labels[a] == IGNORE_INDEX
    assert np.all(labels[total_in:] == IGNORE_INDEX)
    assert batch["max_length_q"] == batch["max_length_k"] >= int(np.diff(real).max())


def test_collator_rounds_up_to_a_bucket_with_one_padding_segment():
    rows = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]}, {"input_ids": [6, 7], "seq_lengths": [2]}]
    plain = PaddingFreeCollator(0, return_tensors="np")(rows)
    c = PaddingFreeCollator(0, return_tensors="np", pad_to_buckets=[4, 16, 8], pad_cu_seq_lens_to=8)
    b = c(rows)
    check_contract(b, 7, 8)
    assert b["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 5, 7, 8, 8, 8, 8] and b["max_length_q"] == 8
    np.testing.assert_array_equal(b["labels"][0, :7], plain["labels"][0])
    # an exact fit adds no padding; pad_to_multiple_of rounds the buckets themselves
    assert c([{"input_ids": [1, 2, 3, 4], "seq_lengths": [4]}])["input_ids"].shape == (1, 4)
    c8 = PaddingFreeCollator(0, pad_to_multiple_of=8, return_tensors="np", pad_to_buckets=[5, 12])
    assert c8.pad_to_buckets == (8, 16) and c8(rows)["input_ids"].shape == (1, 8)
    t = PaddingFreeCollator(0, pad_to_buckets=[8])(rows)  # torch tensors, ints stay ints
    assert tuple(t["input_ids"].shape) == (1, 8) and t["max_length_q"] == 8


def test_static_options_refuse_what_they_cannot_do():
    rows = [{"input_ids": list(range(1, 10)), "seq_lengths": [1] * 9}]
    with pytest.raises(PackingError, match="largest bucket") as e:
        PaddingFreeCollator(0, pad_to_buckets=[4, 8])(rows)
    assert e.value.param == "pad_to_buckets"
    with pytest.raises(PackingError, match="raise pad_cu_seq_lens_to to at least 10"):
        PaddingFreeCollator(0, pad_cu_seq_lens_to=6)(rows)
    with pytest.raises(PackingError, match="padding_free=True"):
        PaddingFreeCollator(0, padding_free=False, pad_to_buckets=[8])
    for bad in ([], [0, 8], "8", [8.5]):
        with pytest.raises(PackingError, match="pad_to_buckets"):
            PaddingFreeCollator(0, pad_to_buckets=bad)
    with pytest.raises(PackingError, match="pad_cu_seq_lens_to"):
        PaddingFreeCollator(0, pad_cu_seq_lens_to=1)
    with pytest.raises(PackingError, match="smaller than max_tokens"):
        TokenBudgetBatchSampler([3, 4], 8, buckets=[4, 6])


def view_of(n=800, seed=0, max_length=128):
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(3.5, 1.0, n).astype(np.int64))
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    ids = rng.integers(1, 500, int(offsets[-1]), dtype=np.int32)
    return packed_view(
        pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))}), max_length
    )


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4])
def test_sampler_buckets_hold_every_epoch_with_at_most_k_shapes(k):
    view = view_of()
    sampler = TokenBudgetBatchSampler(
        view.lengths, 300, buckets=k, bucket_multiple_of=4, seq_lengths=view.seq_lengths
    )
    assert (
        len(sampler.buckets) <= k and sampler.buckets[-1] == 300 and all(b % 4 == 0 for b in sampler.buckets)
    )
    collator = PaddingFreeCollator(
        0, return_tensors="np", pad_to_buckets=sampler.buckets, pad_cu_seq_lens_to=64
    )
    shapes, tokens, padded = set(), 0, 0
    for epoch in range(3):
        sampler.set_epoch(epoch)
        totals = sampler.batch_tokens()
        for indices, total in zip(sampler, totals):
            batch = collator.collate_flat(view.gather(indices))
            check_contract(batch, int(total), batch["input_ids"].shape[1])
            shapes.add((batch["input_ids"].shape, batch["cu_seq_lens_q"].shape, batch["max_length_q"]))
            tokens += int(total)
            padded += batch["input_ids"].shape[1]
        assert sampler.padding_share() == pytest.approx(bucket_padding(totals, sampler.buckets))
    assert len(shapes) <= k
    if k == 1:
        assert shapes == {((1, 300), (64,), 300)}


def test_compiled_function_compiles_once_per_bucket():
    torch = pytest.importorskip("torch")
    view = view_of(400)
    graphs = {}
    for name, k in (("plain", None), ("buckets", 3)):
        sampler = TokenBudgetBatchSampler(view.lengths, 256, buckets=k, seed=1)
        collator = PaddingFreeCollator(
            0, pad_to_buckets=sampler.buckets, pad_cu_seq_lens_to=32 if k else None
        )
        count = []

        def backend(gm, example_inputs, count=count):
            count.append(1)
            return gm.forward

        torch._dynamo.reset()

        @torch.compile(backend=backend, dynamic=False)
        def step(input_ids, position_ids, cu_seq_lens_q):
            return (input_ids * position_ids).sum() + cu_seq_lens_q.sum()

        with torch._dynamo.config.patch(cache_size_limit=1000, accumulated_cache_size_limit=1000):
            distinct = set()
            for indices in sampler:
                b = collator.collate_flat(view.gather(indices))
                step(b["input_ids"], b["position_ids"], b["cu_seq_lens_q"])
                distinct.add((b["input_ids"].shape[1], b["cu_seq_lens_q"].shape[0]))
        graphs[name] = (len(count), len(distinct))
    assert graphs["buckets"][0] <= 3
    assert graphs["plain"][0] == graphs["plain"][1] > 3  # one compilation per distinct shape without buckets


def test_profile_reports_the_padding_each_k_costs():
    lengths = np.maximum(1, np.random.default_rng(2).lognormal(4.0, 1.0, 3000).astype(np.int64))
    table = LengthProfile(lengths).bucket_tradeoffs(max_length=256, max_tokens=1024, candidates=[1, 2, 4, 64])
    rows = table.rows
    assert [r.k for r in rows] == [None, 1, 2, 4, 64]
    distinct = np.unique(table.batch_tokens).shape[0]
    assert rows[0].padding == 0.0 and rows[0].shapes == distinct > 4
    assert rows[-1].padding == 0.0 and rows[-1].shapes == distinct  # K >= distinct lengths: no padding
    assert rows[1].padding > rows[2].padding > 0
    pads = [r.padding for r in rows[1:]]
    assert all(a >= b for a, b in zip(pads, pads[1:]))
    for r in rows[1:]:
        assert r.shapes <= r.k and len(r.buckets) <= r.k and r.buckets[-1] == 1024
        assert r.padding == pytest.approx(bucket_padding(table.batch_tokens, r.buckets))
    text = table.to_text()
    assert "padding" in text and "1,024" in text


def test_varlen_attention_accepts_a_padded_cu_seq_lens_tail():
    torch = pytest.importorskip("torch")
    from packtools.batches.attention import varlen_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(8, 2, 4) for _ in range(3))
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)
    padded = torch.from_numpy(pad_cu_seq_lens(cu.numpy(), 7))
    expected = varlen_attention(q, k, v, cu, cu, 3, 3)
    torch.testing.assert_close(varlen_attention(q, k, v, padded, padded, 8, 8), expected, rtol=0, atol=0)
    with pytest.raises(
        PackingError, match="strictly increasing"
    ):  # an empty sequence inside is still refused
        bad = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
        varlen_attention(q, k, v, bad, bad, 5, 5)
