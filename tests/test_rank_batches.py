"""Per-rank batches without repeated rows, the loss-scaling predicate read from Trainer, the sharding refusal."""

import collections
import types
import warnings

import numpy as np
import pytest

from packtools.batches import TokenBudgetBatchSampler
from packtools.batches.row_sampler import RowBatchSampler
from packtools.errors import PackingError
from packtools.integrations.parallel.distributed import check_loss_path, trainer_divides_by_accumulation


def epoch(samplers):
    return [b for s in samplers for b in s]


@pytest.mark.parametrize("rows,batch,world", [(41, 2, 2), (41, 2, 3), (7, 3, 2), (40, 4, 3), (5, 1, 5)])
def test_row_batches_cover_every_row_once_with_equal_counts(rows, batch, world):
    samplers = [RowBatchSampler(rows, batch, seed=1, num_replicas=world, rank=r) for r in range(world)]
    assert len({len(s) for s in samplers}) == 1 and all(len(list(s)) == len(s) for s in samplers)
    seen = collections.Counter(i for b in epoch(samplers) for i in b)
    assert sorted(seen) == list(range(rows)) and set(seen.values()) == {1}
    assert all(0 < len(b) <= batch for b in epoch(samplers))
    first = epoch(samplers)
    for s in samplers:
        s.set_epoch(1)
    assert epoch(samplers) != first


def test_row_batches_that_cannot_split_drop_different_rows_each_epoch():
    samplers = [RowBatchSampler(41, 1, num_replicas=2, rank=r) for r in (0, 1)]
    assert samplers[0].dropped == 1 and len(samplers[0]) == 20
    missing = []
    for e in (0, 1, 2):
        for s in samplers:
            s.set_epoch(e)
        seen = collections.Counter(i for b in epoch(samplers) for i in b)
        assert set(seen.values()) == {1} and len(seen) == 40
        missing.append(set(range(41)) - set(seen))
    assert len({frozenset(m) for m in missing}) > 1


def test_accelerate_style_even_batches_repeat_rows_and_ours_do_not():
    """Negative control: the row repetition that Trainer's default (even_batches) loader does."""
    accelerate = pytest.importorskip("accelerate.data_loader")
    torch = pytest.importorskip("torch")
    inner = torch.utils.data.BatchSampler(range(41), 2, drop_last=False)
    shards = [accelerate.BatchSamplerShard(inner, 2, r, even_batches=True) for r in (0, 1)]
    seen = collections.Counter(i for s in shards for b in s for i in b)
    assert max(seen.values()) == 2  # repeated rows
    ours = [RowBatchSampler(41, 2, num_replicas=2, rank=r) for r in (0, 1)]
    assert max(collections.Counter(i for s in ours for b in s for i in b).values()) == 1


def test_double_sharding_is_refused():
    sampler = TokenBudgetBatchSampler([5, 7, 3, 9], 12, num_replicas=2, rank=0)
    with pytest.raises(PackingError, match=r"prepare_trainer\(trainer, max_tokens=N\)"):
        getattr(
            sampler, "batch_size", None
        )  # what accelerate's BatchSamplerShard reads when it wraps a batch sampler
    assert TokenBudgetBatchSampler([5, 7], 12).batch_size is None


def test_divides_by_accumulation_reads_trainer_predicate():
    t = types.SimpleNamespace(
        loss_is_scaled_for_ga=None, model_accepts_loss_kwargs=True, compute_loss_func=None
    )
    assert not trainer_divides_by_accumulation(t, num_items_in_batch=12)
    assert trainer_divides_by_accumulation(t, num_items_in_batch=None)
    t.model_accepts_loss_kwargs = False
    assert trainer_divides_by_accumulation(t, 12)
    t.compute_loss_func = lambda *a: 0
    assert not trainer_divides_by_accumulation(t, 12)
    t.loss_is_scaled_for_ga = False  # an explicit flag wins (TRL's DPOTrainer sets False)
    assert trainer_divides_by_accumulation(t, 12)
    t.loss_is_scaled_for_ga = True
    assert not trainer_divides_by_accumulation(t, None)


def test_loss_path_refusals():
    class Old:  # a Trainer without the predicate
        args = types.SimpleNamespace(n_gpu=1)

    with pytest.raises(PackingError, match="loss_is_scaled_for_ga"):
        check_loss_path(Old())

    class DataParallel:
        loss_is_scaled_for_ga = None
        args = types.SimpleNamespace(n_gpu=2)

    with pytest.raises(PackingError, match="DataParallel"):
        check_loss_path(DataParallel())


def test_token_budget_fill_and_imbalance_are_reported():
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 2048, 4000)
    samplers = [TokenBudgetBatchSampler(lengths, 8192, num_replicas=2, rank=r) for r in (0, 1)]
    stats = samplers[0].imbalance()
    assert 0.8 < stats["fill"] <= 1.0 and stats["step_cost"] < 0.5
    assert len(samplers[0]) == len(samplers[1])


def test_token_budget_loader_never_repeats_rows_when_batches_cannot_split():
    """prepare_trainer(max_tokens=N) under 2 processes, 5 packed rows of ~30 tokens and max_tokens=48: every batch
    holds one row, so 5 batches cannot be evened out by splitting. The sampler repeated a row (trained twice per
    epoch, with no warning); the training loader now leaves a different row out each epoch, warning, as
    ``RowBatchSampler`` does."""
    datasets = pytest.importorskip("datasets")
    from packtools.integrations.trainers.loader import make_sampler

    lengths = [32, 32, 31, 28, 24]
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1] * n for n in lengths], "seq_lengths": [[n] for n in lengths]}
    )
    args = types.SimpleNamespace(seed=0, data_seed=None, per_device_train_batch_size=1)
    trainer = types.SimpleNamespace(args=args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samplers = [
            make_sampler(trainer, ds, 48, types.SimpleNamespace(dp_size=2, dp_rank=r)) for r in (0, 1)
        ]
    missing = set()
    for e in range(4):
        for s in samplers:
            s.set_epoch(e)
        assert len(samplers[0]) == len(samplers[1])
        seen = collections.Counter(i for b in epoch(samplers) for i in b)
        assert max(seen.values()) == 1, seen  # main: row 0 twice in epoch 0
        assert len(seen) == 4
        missing |= set(range(5)) - set(seen)
    assert len(missing) > 1  # other rows sit out in other epochs
    said = [str(w.message) for w in caught]
    assert (
        len(said) == 1 and "1 row(s) of each epoch's shuffle" in said[0] and "sit that epoch out" in said[0]
    )


def test_row_sampler_sharded_again_by_accelerate_is_refused():
    """RowBatchSampler(num_replicas=2) given to accelerator.prepare in a loop of one's own: accelerate's
    BatchSamplerShard shards its per-rank batches again, and each rank kept every other batch of its own: 4 of 8
    batches of 15 rows trained per epoch, no error. Refused now, as TokenBudgetBatchSampler is."""
    torch = pytest.importorskip("torch")
    data_loader = pytest.importorskip("accelerate.data_loader")
    rows = list(range(15))
    for rank in (0, 1):
        loader = torch.utils.data.DataLoader(
            rows, batch_sampler=RowBatchSampler(15, 2, num_replicas=2, rank=rank)
        )
        with pytest.raises(PackingError, match=r"RowBatchSampler\(num_replicas=2\) is already sharded"):
            data_loader.prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False)
    # one replica: accelerate shards it itself; every row reaches a process
    shards = [
        data_loader.prepare_data_loader(
            torch.utils.data.DataLoader(rows, batch_sampler=RowBatchSampler(15, 2, seed=1)),
            num_processes=2,
            process_index=r,
            put_on_device=False,
        )
        for r in (0, 1)
    ]
    assert {int(i) for s in shards for b in s for i in b} == set(rows)
    assert RowBatchSampler(15, 2, num_replicas=2, rank=0).rows_per_batch == 2


def test_token_budget_sampler_says_when_it_repeats_rows():
    """The sampler alone (the plain DDP loop of docs/training.md) keeps DistributedSampler's repeats by default,
    but says so once on rank 0; it repeated row 0 with no warning."""
    lengths = [32, 32, 31, 28, 24]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        samplers = [TokenBudgetBatchSampler(lengths, 48, num_replicas=2, rank=r) for r in (0, 1)]
        seen = collections.Counter(i for b in epoch(samplers) for i in b)
        for s in samplers:
            s.set_epoch(1)
        epoch(samplers)
    assert max(seen.values()) == 2  # the default still repeats
    said = [str(w.message) for w in caught]
    assert (
        len(said) == 1 and "1 row(s) of each epoch are repeated" in said[0] and "repeat_rows=False" in said[0]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sum(len(b) for b in TokenBudgetBatchSampler(lengths, 64, num_replicas=2, rank=0)) > 0
