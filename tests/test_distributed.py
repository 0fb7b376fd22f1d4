"""Data parallelism, for real: 2 processes (``torchrun``, gloo, CPU) against one process on the same global batch.

One launch of ``tests/_ddp_worker.py`` runs every training path (Trainer on packed rows, token-budget
batches, unpacked rows and a ``packed_view``; DPOTrainer unpacked and on packed pairs, with and without
``max_tokens``, and on prompt-shared pairs (``share_prompt=True``, the tree attention); resume from a
checkpoint in the middle of epoch 1; the double-sharding refusal) and records per rank the rows of every
micro-batch, the parameter change of the first optimizer step and the number of steps.  Here, in one process: that change must equal the gradient of the step's global batch (token mean for
SFT, pair mean for DPO) within 1e-5 relative; each row (pair) must be trained exactly once per epoch; both
ranks must run the same number of steps.  Negative controls: the mean of per-rank means differs from the
global mean, and the repeated rows of Trainer's own loader under DDP are caught by the same coverage check.
"""

from __future__ import annotations

import collections
from pathlib import Path

import _launch as launcher
import pytest
from _hf_models import PAD, sequences, tiny_llama, torch

pytestmark = pytest.mark.slow  # several processes (torchrun); in .ci/run, not in the README's quick command

datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")

from packtools import PaddingFreeCollator, pack_dataset, packed_view  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
GA = 2


def _launch(out, *only):
    """Run tests/_ddp_worker.py on 2 processes (only the named checks, when given); the per-rank results."""
    launcher.torchrun(
        2, "_ddp_worker.py", str(out), *([",".join(only)] if only else []), log=out / "torchrun.log"
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("ddp"))


ON_REQUEST = ("stream", "eval", "eval_order", "guard_probe", "fsdp")


@pytest.fixture(scope="module")
def on_request(tmp_path_factory):
    """The worker's checks run only when named (refusals, the guard's probe, FSDP2), in one launch of their own
    apart from ``ranks``' (one xdist group: one worker launches it): each check's result or traceback per rank."""
    return _launch(tmp_path_factory.mktemp("ddp-on-request"), *ON_REQUEST)


on_request_group = pytest.mark.xdist_group("ddp_on_request")


@on_request_group
def test_a_stream_and_a_single_row_under_two_processes_are_refused_with_the_fix(on_request):
    """A packed IterableDataset under 2 processes (was: TypeError inside packtools), and one packed row on 2
    processes (was: Trainer's "args.max_steps must be set"): each refused by prepare_trainer naming the fix."""
    for res in on_request:
        got = res["stream"]
        assert "error" not in got, got.get("error")
        assert got["stream"].startswith(
            "the training dataset is a stream (IterableDataset) under 2 processes"
        )
        assert "datasets.Dataset.from_generator" in got["stream"]
        assert got["one_row"].startswith("1 training row(s) cannot give each of 2 processes a batch")


@on_request_group
def test_token_mean_loss_counts_each_row_once_under_two_processes(tmp_path, on_request):
    """5 evaluation rows on 2 processes: accelerate repeats rows from the start of the set to give both the same
    number of batches; token_mean_loss counts every row once, so it equals one process's (< 1e-5), flat
    (padding-free) and padded batches alike.  Failed before: the repeated rows were counted (batch 1: 4.57782,
    batch 2: 4.57301 against 4.57915 in one process).  evaluate()'s eval_loss is transformers' own figure (a
    mean of per-step figures, its last step scaled by tokens of repeated rows: docs/training.md) and differs."""
    from _ddp_worker import EVAL_CASES, eval_rows, eval_trainer

    from packtools.integrations.trainers.evaluation import token_mean_loss

    ranks = on_request
    rows, one = eval_rows(), {}
    for name, (padding_free, batch) in EVAL_CASES.items():
        one[name] = token_mean_loss(eval_trainer(str(tmp_path / "one"), rows, padding_free, batch))
        for res in ranks:
            assert "error" not in res["eval"], res["eval"].get("error")
            got, _ = res["eval"][name]
            assert abs(got - one[name]) < TOL, (name, got, one[name])
    assert abs(ranks[0]["eval"]["flat, batch 1"][1] - one["flat, batch 1"]) > 1e-2  # transformers' figure


@on_request_group
def test_an_evaluation_order_that_changes_is_refused_on_every_process(on_request):
    """token_mean_loss finds the change where a batch mixes rows and repeats, on one process only (here rank 0):
    that process raised alone, and the other waited for it in the all_reduce of the sums (a gloo error once rank
    0 was gone, or a hang while it lived).  The refusal now travels with the sums: both processes raise it."""
    for rank, res in enumerate(on_request):
        got = res["eval_order"]
        assert got.startswith(
            "PackingError: token_mean_loss: the evaluation loader's sampler gave another order"
        ), (
            rank,
            got,
        )
        assert "(Reshuffled)" in got


@on_request_group
def test_the_guards_probe_on_a_ddp_wrapper_runs_no_collective(on_request):
    """guard_model(DistributedDataParallel(model)) in a loop of one's own, the ranks reaching their first packed
    batch at different steps: the probe's DDP forwards broadcast buffers that the other rank never matched (gloo
    aborted the processes).  The probe now runs the module DDP wraps: both ranks train their two steps."""
    for rank, res in enumerate(on_request):
        losses = res["guard_probe"]
        assert not isinstance(losses, dict), (rank, losses)
        assert len(losses) == 2 and all(0 < loss < 20 for loss in losses), (rank, losses)


@on_request_group
def test_fsdp2_own_loop_refuses_the_probe_and_trains_the_global_token_mean(on_request):
    """fully_shard in a loop of one's own on 2 processes, rank 0's batch one packed row, rank 1's two: with
    guard_model(model) the probe's gathers on one process met the other's real forward (a hang, no error, when
    the ranks reached their first packed batch at different steps); now both refuse it by name before any
    gather.  With check_isolation=False the loss and every gradient equal the 8 documents run one by one on one
    process within 1e-5 (FSDP2's averaged reduce-scatter times the processes, the global token count)."""
    from _ddp_worker import fsdp_rows
    from _hf_models import split_rows

    ranks = on_request
    for res in ranks:
        assert "error" not in res["fsdp"], res["fsdp"]["error"]
    model = tiny_llama("sdpa").train()
    docs = [s["input_ids"] for s in split_rows(fsdp_rows())]
    total = sum(len(d) - 1 for d in docs)
    loss = 0.0
    for doc in docs:
        ids = torch.tensor([doc])
        out = model(input_ids=ids, labels=ids, num_items_in_batch=total, use_cache=False)
        out.loss.backward()
        loss += out.loss.item()
    for rank, res in enumerate(ranks):
        got = res["fsdp"]
        assert got["refused"] is not None and "sharded by FSDP2" in got["refused"], (rank, got["refused"])
        assert "check_isolation=False" in got["refused"]
        assert got["count"] == total
        assert abs(got["loss"] - loss) < TOL, (rank, got["loss"], loss)
        diff = max(float((got["grads"][n] - p.grad).abs().max()) for n, p in model.named_parameters())
        assert diff < TOL, (rank, diff)
        scale = max(float(p.grad.abs().max()) for p in model.parameters())
        assert scale > 1e-2  # the gradients compared are not all ~0


def ok(ranks, *names):
    """Fail (with the worker's traceback) when a check of the worker raised."""
    for r, res in enumerate(ranks):
        for name in names:
            group = {"sft": "sft", "dpo": "dpo", "loop": "loops"}.get(name.split("_")[0], name)
            value = res.get(name, res.get(group))
            assert value is not None, f"rank {r}: no result for {name}"
            assert not (isinstance(value, dict) and "error" in value), f"rank {r}: {value['error']}"


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def coverage(ranks, name, epoch_batches=None):
    """Counter of how often each row key was trained, over all ranks (one epoch)."""
    seen = collections.Counter()
    for res in ranks:
        batches = res[name]["batches"] if epoch_batches is None else epoch_batches(res)
        seen.update(key for batch in batches for key in batch)
    return seen


def first_step_rows(ranks, name):
    return [[key for batch in res[name]["batches"][:GA] for key in batch] for res in ranks]


# -- SFT ------------------------------------------------------------------------------------------------
def sft_rows():
    packed = pack_dataset(datasets.Dataset.from_list(sequences(40, seed=5, masks=False)), 32)
    view = packed_view(datasets.Dataset.from_list(sequences(40, seed=5, masks=False)), 32)
    unpacked = datasets.Dataset.from_list(sequences(41, seed=3, masks=False))

    def index(rows, key="input_ids"):
        return {tuple(int(t) for t in r[key]): {k: list(v) for k, v in dict(r).items()} for r in rows}

    return {
        "packed": index(packed),
        "view": index(view[i] for i in range(len(view))),
        "unpacked": index(unpacked),
    }


@pytest.fixture(scope="module")
def rows():
    return sft_rows()


def sft_grad(rows, unpacked):
    """The gradient of one process's token mean over ``rows`` (one padding-free batch)."""
    model = tiny_llama("sdpa")
    batch = PaddingFreeCollator(PAD, unpacked=unpacked)(rows)
    model(**batch).loss.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


SFT = {"sft_packed": "packed", "sft_budget": "packed", "sft_view": "view", "sft_unpacked": "unpacked"}


@pytest.mark.parametrize("name", list(SFT))
def test_sft_step_equals_one_process_and_epoch_covers_every_row_once(ranks, rows, name):
    ok(ranks, name)
    table = rows[SFT[name]]
    unpacked = SFT[name] == "unpacked"
    assert ranks[0][name]["steps"] == ranks[1][name]["steps"] > 1
    assert len(ranks[0][name]["batches"]) == len(ranks[1][name]["batches"])
    seen = coverage(ranks, name)
    assert set(seen) == set(table) and set(seen.values()) == {1}  # every row once, nothing repeated
    per_rank = first_step_rows(ranks, name)
    assert all(per_rank) and {len(p) for p in per_rank} != {0}
    whole = sft_grad([table[k] for p in per_rank for k in p], unpacked)
    for res in ranks:  # DDP: both ranks made the same update, the global token mean's
        assert rel(res[name]["delta"], whole) < TOL
    if name == "sft_unpacked":  # negative control: the mean of the ranks' own token means is another step
        tokens = [sum(len(k) - 1 for k in p) for p in per_rank]
        assert tokens[0] != tokens[1]  # the ranks really held different numbers of tokens
        means = [sft_grad([table[k] for k in p], unpacked) for p in per_rank]
        per_rank_mean = {k: (means[0][k] + means[1][k]) / 2 for k in whole}
        assert rel(per_rank_mean, whole) > 1e-3


def test_moe_router_loss_step_equals_the_padded_micro_batches_of_both_processes(ranks):
    """The MoE router loss under 2 processes (Trainer, PaddingFreeCollator, prepare_trainer, 2 accumulation
    steps): the first step equals plain SGD over the padded micro-batches of both ranks with their
    ``attention_mask``, the token mean over all four plus each micro-batch's whole router loss (``Trainer`` adds
    it per micro-batch and scales by the processes, DDP averages).  Negative control: the router loss left out
    is another step."""
    import copy

    from _ddp_worker import LR, MOE_COEF, moe_model
    from test_moe_router_loss import COEF, padded_training

    ok(ranks, "moe")
    assert MOE_COEF == COEF
    batches = [b for res in ranks for b in res["moe"]["batches"][:GA]]
    assert len(batches) == 2 * GA and ranks[0]["moe"]["steps"] == 1
    start = moe_model()
    deltas = []
    for share in (1.0, 0.0):
        model = copy.deepcopy(start)
        padded_training(model, batches, 2 * GA, aux_share=share, lr=LR)
        deltas.append({k: p0 - p1 for (k, p0), p1 in zip(start.named_parameters(), model.parameters())})
    for res in ranks:
        delta = res["moe"]["delta"]
        assert max((delta[k] - deltas[0][k]).abs().max().item() for k in delta) < TOL
        assert max((delta[k] - deltas[1][k]).abs().max().item() for k in delta) > 1e-3


def test_trainer_own_loader_repeats_rows_under_ddp_and_the_check_catches_it(ranks, rows):
    """Negative control for the coverage check: Trainer's even_batches padding trains some rows twice."""
    ok(ranks, "sft_plain_trainer")
    seen = coverage(ranks, "sft_plain_trainer")
    assert set(seen) == set(rows["packed"])
    repeated = [k for k, n in seen.items() if n > 1]
    assert repeated, "accelerate's even_batches no longer repeats rows: update the docs"


# -- DPO ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dpo_reference(tmp_path_factory):
    import test_dpo

    trainer = test_dpo.build(tmp_path_factory.mktemp("dpo"), n=24)
    ds = trainer.train_dataset
    index = {(tuple(r["prompt_ids"]), tuple(r["chosen_ids"])): i for i, r in enumerate(ds)}
    return trainer, index


DPO = ["dpo_packed", "dpo_packed_budget", "dpo_packed_shared", "dpo_unpacked", "dpo_unpacked_budget"]


def pair_ids(key, index):
    return [int(p) for p in key] if isinstance(key[0], int) else [index[key]]


@pytest.mark.parametrize("name", DPO)
def test_dpo_step_equals_one_process_and_epoch_covers_every_pair_once(ranks, dpo_reference, name):
    import test_dpo

    ok(ranks, name)
    reference, index = dpo_reference
    assert ranks[0][name]["steps"] == ranks[1][name]["steps"] > 1
    shared = [res[name]["attention"] == "packtools_tree" for res in ranks]  # the prompt once: the tree
    assert shared == [name == "dpo_packed_shared"] * 2
    seen = collections.Counter(
        p for key, n in coverage(ranks, name).items() for p in pair_ids(key, index) for _ in range(n)
    )
    assert set(seen) == set(range(len(reference.train_dataset))) and set(seen.values()) == {1}
    per_rank = [[p for key in keys for p in pair_ids(key, index)] for keys in first_step_rows(ranks, name)]
    whole = test_dpo.loss_metrics_grads(reference, test_dpo.trl_batch(reference, sum(per_rank, [])))[2]
    for res in ranks:
        assert rel(res[name]["delta"], whole) < TOL


@pytest.mark.parametrize("name", DPO)
def test_dpo_logged_metrics_are_those_of_every_pair_of_the_step(ranks, dpo_reference, name):
    """The first step's logged rewards, log-probs, logits, entropy and accuracy, on both ranks, are TRL's on all
    the step's pairs at once: the micro-batches' pair counts differ across the ranks and the micro-batches."""
    import test_dpo

    ok(ranks, name)
    reference, index = dpo_reference
    per_rank = [[p for key in keys for p in pair_ids(key, index)] for keys in first_step_rows(ranks, name)]
    whole = test_dpo.loss_metrics_grads(reference, test_dpo.trl_batch(reference, sum(per_rank, [])))[1]
    for res in ranks:
        logged = res[name]["logged"]
        bad = {k: (logged[k], whole[k]) for k in test_dpo.METRICS[:-1] if abs(logged[k] - whole[k]) > 1e-5}
        assert not bad, bad


def test_dpo_negative_control_the_mean_of_per_rank_means_is_another_step(ranks, dpo_reference):
    """Where the ranks' first steps held different numbers of pairs, averaging each rank's own pair mean (what
    DDP does with TRL's loss alone) gives another update than the one the ranks made."""
    import test_dpo

    ok(ranks, *DPO)
    reference, index = dpo_reference
    uneven = 0
    for name in DPO:
        per_rank = [
            [p for key in keys for p in pair_ids(key, index)] for keys in first_step_rows(ranks, name)
        ]
        if len(per_rank[0]) == len(per_rank[1]):
            continue
        uneven += 1
        means = [
            test_dpo.loss_metrics_grads(reference, test_dpo.trl_batch(reference, p))[2] for p in per_rank
        ]
        per_rank_mean = {k: (means[0][k] + means[1][k]) / 2 for k in means[0]}
        assert rel(per_rank_mean, ranks[0][name]["delta"]) > 1e-3, name
    assert uneven  # the harness does hold uneven ranks


# -- resume, refusal ------------------------------------------------------------------------------------
def test_resume_mid_epoch_sees_the_batches_of_the_uninterrupted_run(ranks):
    ok(ranks, "resume")
    for res in ranks:
        full, resumed = res["resume"]["full"], res["resume"]["resumed"]
        per_epoch = len(full) // 2
        assert (
            full[per_epoch:] != full[:per_epoch]
        )  # epoch 1 is another shuffle: set_epoch reached the sampler
        assert resumed == full[per_epoch + GA :]  # one optimizer step into epoch 1


def test_token_budget_sampler_under_accelerate_sharding_is_refused(ranks):
    ok(ranks, "refusal")
    for res in ranks:
        assert res["refusal"] is not None
        assert "prepare_trainer(trainer, max_tokens=N)" in res["refusal"]


# -- the README loops -----------------------------------------------------------------------------------
def test_readme_loops_under_ddp_equal_one_process(ranks):
    """benchmarks/train_loop.py and dpo_loop.py, DDP-wrapped, one TokenBudgetBatchSampler per rank: the first
    step equals the same loops run by one process on one batch of all the step's rows; every row once."""
    import copy

    ok(ranks, "loop_sft", "loop_dpo")
    import _ddp_worker
    from _scripts import script

    from packtools.dpo import PreferenceCollator

    rows, pairs = _ddp_worker.loop_data()
    dpo_loop, train_loop = script("dpo_loop"), script("train_loop")  # the documented loops under test

    for name, data, collator in (
        ("loop_sft", rows, PaddingFreeCollator(PAD)),
        ("loop_dpo", pairs, PreferenceCollator(PAD)),
    ):
        table = {tuple(int(t) for t in r["input_ids"]): r for r in data}
        assert ranks[0][name]["steps"] == ranks[1][name]["steps"] > 1
        seen = coverage(ranks, name)
        assert set(seen) == set(table) and set(seen.values()) == {1}
        step_rows = [table[k] for p in first_step_rows(ranks, name) for k in p]
        model = tiny_llama("sdpa")
        frozen = copy.deepcopy(model).eval().requires_grad_(False)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=_ddp_worker.LR)
        loader = [collator(step_rows)]  # one process, one batch: the step's global mean
        if name == "loop_sft":
            train_loop.train(model, loader, opt, max_steps=1)
        else:
            dpo_loop.train_dpo(model, frozen, loader, opt, max_steps=1)
        whole = {k: before[k] - p.detach() for k, p in model.named_parameters()}
        for res in ranks:
            assert rel(res[name]["delta"], whole) < TOL, name
