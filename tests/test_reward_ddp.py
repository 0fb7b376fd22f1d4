"""Reward models under data parallelism, for real: 2 processes (``torchrun``, gloo, CPU) against one process.

``tests/_reward_worker.py`` trains a prepared ``RewardTrainer`` on TRL's own batches, on packed pair rows and
on packed rows by token budget.  Here, in one process: the first optimizer step's parameter change on each
rank (SGD, lr 1: minus the gradient) must equal the gradient of TRL's padded loss on all the step's pairs at
once (the pair mean over both ranks and the accumulation window), within 1e-5 relative; every pair is trained
exactly once per epoch; both ranks run the same number of steps.  KTO: one step of ``prepare_kto_trainer``
under 2 processes equals TRL's padded step under 2 processes.  Negative control: where the ranks held
different numbers of pairs, the mean of per-rank means (DDP over TRL's loss alone) is another step.
"""

from __future__ import annotations

import collections
from pathlib import Path

import _launch
import pytest

pytestmark = pytest.mark.slow  # several processes (torchrun)

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
GA = 2
NAMES = ("unpacked", "packed", "packed_budget")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward_ddp")
    _launch.torchrun(2, "_reward_worker.py", str(out), log=out / "torchrun.log")
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r, res in enumerate(results):
        for name in (*NAMES, "kto", "kto_padded"):
            assert "error" not in res[name], f"rank {r} {name}: {res[name]['error']}"
    return results


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    import test_reward

    trainer = test_reward.build(tmp_path_factory.mktemp("reward_ref"), n=24, margin=True)
    ds = trainer.train_dataset
    index = {(tuple(r["chosen_ids"]), tuple(r["rejected_ids"])): i for i, r in enumerate(ds)}
    return trainer, index


def gradient(trainer, pairs):
    import test_reward

    batch = trainer.data_collator([trainer.train_dataset[i] for i in pairs])
    return test_reward.loss_metrics_grads(trainer, batch)[2]


def step_pairs(res, index, name):
    return [index[p] for batch in res[name]["batches"][:GA] for p in batch]


@pytest.mark.parametrize("name", NAMES)
def test_step_equals_one_process_and_epoch_covers_every_pair_once(ranks, reference, name):
    import test_reward

    trainer, index = reference
    assert ranks[0][name]["steps"] == ranks[1][name]["steps"] > 1
    seen = collections.Counter(index[p] for res in ranks for batch in res[name]["batches"] for p in batch)
    assert set(seen) == set(range(len(trainer.train_dataset))) and set(seen.values()) == {1}
    per_rank = [step_pairs(res, index, name) for res in ranks]
    whole = gradient(trainer, sum(per_rank, []))
    for res in ranks:
        assert test_reward.rel(res[name]["delta"], whole) < TOL


@pytest.mark.parametrize("name", NAMES)
def test_logged_metrics_are_the_means_over_every_pair_of_the_step(ranks, reference, name):
    """The accuracy, margin and mean reward logged at the first step are TRL's on all its pairs at once, on every
    rank.  TRL averages each process's own mean of accuracy and margin: with packed micro-batches of unequal pair
    counts across the processes (2 and 3 pairs) the log was 0.409 for 0.455, the margin of the wrong sign."""
    import test_reward

    trainer, index = reference
    pairs = sum((step_pairs(res, index, name) for res in ranks), [])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in pairs])
    whole = test_reward.loss_metrics_grads(trainer, batch)[1]
    for res in ranks:
        for key in ("accuracy", "margin", "mean_reward"):
            assert res[name]["logged"][key] == pytest.approx(whole[key], abs=1e-6), (key, res[name]["logged"])


def test_negative_control_the_mean_of_per_rank_means_is_another_step(ranks, reference):
    import test_reward

    trainer, index = reference
    uneven = 0
    for name in NAMES:
        per_rank = [step_pairs(res, index, name) for res in ranks]
        if len(per_rank[0]) == len(per_rank[1]):
            continue
        uneven += 1
        means = [gradient(trainer, p) for p in per_rank]
        mean_of_means = {k: (means[0][k] + means[1][k]) / 2 for k in means[0]}
        assert test_reward.rel(mean_of_means, ranks[0][name]["delta"]) > 1e-3, name
    assert uneven  # the harness does hold uneven ranks


def test_kto_step_under_two_processes_equals_trl_padded(ranks):
    """KTO keeps TRL's micro-batches: under DDP its padding-free step is TRL's padded step, on every rank."""
    import test_reward

    for res in ranks:
        assert test_reward.rel(res["kto"]["delta"], res["kto_padded"]["delta"]) < TOL
    assert test_reward.rel(ranks[0]["kto"]["delta"], ranks[1]["kto"]["delta"]) < 1e-7  # DDP synced
    assert max(float(d.abs().max()) for d in ranks[0]["kto"]["delta"].values()) > 1e-4
