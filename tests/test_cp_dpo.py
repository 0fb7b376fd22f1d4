"""DPO on packed pairs under context parallelism, for real: torchrun + gloo, tiny Llama fp32, one SGD step.

CP = 2 (2 processes) and CP = 2 × DP = 2 (4 processes): the parameter update of one optimizer step of the plain
loop of ``benchmarks/cp_dpo_loop.py`` equals one process on the same global batch (every row as one
padding-free row, ``sequence_logps``, the pair-mean DPO loss) within 1e-5 relative, on rows holding sequences
shorter than 2·CP, one long sequence and a row of a single pair; every CP rank holds the whole row's
per-sequence log-probabilities.  Negative controls, each visibly another step: the DPO loss on each rank's
partial sums (no sum over the CP group), and an all-reduce whose backward also sums with the loss not divided
by the CP size (the same all-reduce divided by it is right).  The same for TRL's ``DPOTrainer`` under
``prepare_dpo_trainer(trainer, train_dataset=packed pairs, context_parallel=2)``: CP=2 with and without gradient
accumulation, CP=2 × DP=2; and what it does not run is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import _launch
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
from _cp_fixtures import PAIR_BATCHES, tiny_llama_fp32  # noqa: E402
from _scripts import script  # noqa: E402
from test_cp_training import launch, rel  # noqa: E402

from packtools.constants import VARLEN_KEYS  # noqa: E402
from packtools.dpo import PreferenceCollator, sequence_logps  # noqa: E402
from packtools.integrations.attention import segmented  # noqa: E402

BETA = 0.5  # plain_cp_dpo_step's default


def one_process(rows, lr: float = 1.0):
    """One process: ``rows`` as one padding-free row, the pair-mean DPO loss, one SGD step."""
    policy, reference = tiny_llama_fp32(0), tiny_llama_fp32(1)
    name = segmented.register()
    policy.set_attn_implementation(name)
    reference.set_attn_implementation(name)
    batch = PreferenceCollator(0)(rows)
    inputs = {k: batch[k] for k in ("input_ids", "position_ids", *VARLEN_KEYS)}  # what the model reads
    before = {k: p.detach().clone() for k, p in policy.named_parameters()}
    logps, _ = sequence_logps(
        policy(**inputs, use_cache=False).logits, batch["labels"], batch["cu_seq_lens_q"]
    ).pairs()
    with torch.no_grad():
        ref, _ = sequence_logps(
            reference(**inputs, use_cache=False).logits, batch["labels"], batch["cu_seq_lens_q"]
        ).pairs()
    loss = script("cp_dpo_loop").dpo_losses(logps, ref, BETA).mean()
    loss.backward()
    with torch.no_grad():
        for p in policy.parameters():
            p -= lr * p.grad
    delta = {k: before[k] - p.detach() for k, p in policy.named_parameters()}
    return delta, logps.detach(), float(loss)


def check(results, dp: int) -> None:
    rows = [row for b in PAIR_BATCHES for row in b]
    want, _, _ = one_process(rows)
    pairs = sum(len(r["seq_lengths"]) // 2 for r in rows)
    # Every pair counted once: each DP group's pairs, summed over the DP groups (CP peers hold the same pairs).
    assert sum(r["pairs"] for r in results if r["cp_rank"] == 0) == pairs
    for r in results:
        _, logps, _ = one_process(rows[r["dp_rank"] :: dp])
        # Every CP rank holds the whole row's per-sequence log-probs; its own shard's sums are only a part.
        assert torch.allclose(r["logps"], logps, rtol=1e-5, atol=1e-4)
        assert float((r["local_logps"] - logps).abs().max()) > 1.0
        assert rel(r["cp"], want) < 1e-5
        assert rel(r["autograd_sum_divided"], want) < 1e-5
        assert rel(r["local"], want) > 1e-2, "the loss on per-rank partial sums"
        assert rel(r["autograd_sum"], want) > 0.5, "an all-reduce with a summing backward, not divided by CP"


@pytest.mark.slow
def test_cp2_dpo_step_equals_one_process(tmp_path):
    check(launch(tmp_path, 2, 2, "_cp_dpo_worker.py"), dp=1)


@pytest.mark.slow
def test_cp2_dp2_dpo_step_equals_one_process(tmp_path):
    check(launch(tmp_path, 4, 2, "_cp_dpo_worker.py"), dp=2)


def trainer_runs(out: Path, nproc: int, *runs: str) -> dict[str, list[dict]]:
    """``runs`` of ``tests/_cp_dpo_trainer_worker.py`` (``GA`` or ``GA-local``) in one launch of ``nproc``."""
    _launch.torchrun(
        nproc, "_cp_dpo_trainer_worker.py", "2", ",".join(runs), str(out), log=out / "torchrun.log"
    )
    return {run: torch.load(out / f"trainer-{run}.pt", weights_only=False) for run in runs}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """The 2-process Trainer runs (GA 1, GA 2, the negative control) of one launch, a new model and trainer each:
    the tests below share it (one xdist group, so one worker launches it)."""
    pytest.importorskip("trl")
    return trainer_runs(tmp_path_factory.mktemp("cp-dpo-trainer-2"), 2, "1", "2", "1-local")


@pytest.mark.slow
@pytest.mark.xdist_group("cp_dpo_trainer_2")
@pytest.mark.parametrize(("nproc", "ga"), [(2, 1), (2, 2), (4, 1)])
def test_dpo_trainer_cp2_step_equals_one_process(tmp_path, request, nproc, ga):
    """prepare_dpo_trainer(trainer, train_dataset=packed pairs, context_parallel=2) under torchrun: CP=2 (with
    and without gradient accumulation) and CP=2 x DP=2, TRL's DPOTrainer (sigmoid loss, beta 0.5), one step
    equal to one process on the same global batch."""
    pytest.importorskip("trl")
    want, _, loss = one_process([row for b in PAIR_BATCHES for row in b])
    if nproc == 2:
        results = request.getfixturevalue("two_process_runs")[str(ga)]
    else:
        results = trainer_runs(tmp_path, nproc, str(ga))[str(ga)]
    assert all(r["impl"] == "packtools_cp" for r in results)
    for r in results:
        assert rel(r["delta"], want) < 1e-5
    # The logged loss (Trainer's per-process value; its mean over processes is the step's pair mean): the same on
    # the CP peers of a DP group, and its mean the one process's loss (not CP times it).
    assert all(abs(r["loss"] - results[i - i % 2]["loss"]) < 1e-6 for i, r in enumerate(results))
    assert abs(sum(r["loss"] for r in results) / len(results) - loss) < 1e-5 * loss
    assert all("called the model on different rows" in r["refused"] for r in results)
    # DPO evaluation under CP: refused by name before TRL's eval-set preparation (a KeyError 'chosen' before).
    assert all(
        r["eval_refused"].startswith("PackingError: evaluate() under context_parallel") for r in results
    )


@pytest.mark.slow
@pytest.mark.xdist_group("cp_dpo_trainer_2")
def test_dpo_trainer_cp2_without_the_sum_over_the_group_is_another_step(two_process_runs):
    """Negative control of the Trainer path: TRL's loss on each rank's partial per-sequence sums moves the step
    (run in the same launch as the runs above, after them; the sum is put back after it)."""
    want, _, _ = one_process([row for b in PAIR_BATCHES for row in b])
    assert all(rel(r["delta"], want) > 1e-2 for r in two_process_runs["1-local"])


def test_dpo_context_parallel_refuses_what_it_does_not_run_by_name(tmp_path):
    """One process: what packtools' DPO under CP does not run is refused by name, and a refused trainer is left
    as TRL built it."""
    pytest.importorskip("trl")
    from test_dpo import build

    from packtools import prepare_dpo_trainer
    from packtools.errors import PackingError
    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.preference.context_parallel import check_cp_dpo

    cp2 = RankLayout(0, 1, cp_rank=0, cp_size=2)
    trainer = build(tmp_path)
    check_cp_dpo(trainer, cp2, shared=False)  # nothing to refuse
    for layout, shared, match in [
        (cp2, True, "prompt-shared rows"),
        (RankLayout(0, 1, cp_size=2, tp_size=2), False, "tensor parallelism"),
    ]:
        with pytest.raises(PackingError, match=match):
            check_cp_dpo(trainer, layout, shared)
    with pytest.raises(PackingError, match="precompute_ref_log_probs"):
        check_cp_dpo(build(tmp_path, ref=False, precompute_ref_log_probs=True), cp2, shared=False)
    with pytest.raises(PackingError, match="evaluation during training"):
        evaluating = build(tmp_path)
        evaluating.eval_dataset = evaluating.train_dataset
        evaluating.args.eval_strategy = transformers.IntervalStrategy.STEPS
        check_cp_dpo(evaluating, cp2, shared=False)
    with pytest.raises(PackingError, match="context_parallel=2 does not divide the 1 processes"):
        prepare_dpo_trainer(trainer, context_parallel=2)
    assert trainer.model.config._attn_implementation == "sdpa"  # left as TRL built it
