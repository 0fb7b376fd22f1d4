"""DPO on packed pairs under context parallelism, for real: torchrun + gloo, tiny Llama fp32, one SGD step.

CP = 2 (2 processes) and CP = 2 × DP = 2 (4 processes): the parameter update of one optimizer step of the plain
loop of ``benchmarks/cp_dpo_loop.py`` equals one process on the same global batch (every row as one
padding-free row, ``sequence_logps``, the pair-mean DPO loss) within 1e-5 relative, on rows holding sequences
shorter than 2·CP, one long sequence and a row of a single pair; every CP rank holds the whole row's
per-sequence log-probabilities.  Negative controls, each visibly another step: the DPO loss on each rank's
partial sums (no sum over the CP group), and an all-reduce whose backward also sums with the loss not divided
by the CP size (the same all-reduce divided by it is right).  ``prepare_dpo_trainer`` still refuses CP.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from cp_dpo_loop import PAIR_BATCHES, dpo_losses  # noqa: E402
from cp_loop import tiny_llama_fp32  # noqa: E402
from test_cp_training import launch, rel  # noqa: E402

from packtools.dpo import PreferenceCollator, sequence_logps  # noqa: E402
from packtools.integrations import segmented  # noqa: E402

BETA = 0.5  # plain_cp_dpo_step's default


def one_process(rows, lr: float = 1.0):
    """One process: ``rows`` as one padding-free row, the pair-mean DPO loss, one SGD step."""
    policy, reference = tiny_llama_fp32(0), tiny_llama_fp32(1)
    name = segmented.register()
    policy.set_attn_implementation(name)
    reference.set_attn_implementation(name)
    batch = PreferenceCollator(0)(rows)
    inputs = {
        k: batch[k]
        for k in (
            "input_ids",
            "position_ids",
            "cu_seq_lens_q",
            "cu_seq_lens_k",
            "max_length_q",
            "max_length_k",
        )
    }
    before = {k: p.detach().clone() for k, p in policy.named_parameters()}
    logps, _ = sequence_logps(
        policy(**inputs, use_cache=False).logits, batch["labels"], batch["cu_seq_lens_q"]
    ).pairs()
    with torch.no_grad():
        ref, _ = sequence_logps(
            reference(**inputs, use_cache=False).logits, batch["labels"], batch["cu_seq_lens_q"]
        ).pairs()
    loss = dpo_losses(logps, ref, BETA).mean()
    loss.backward()
    with torch.no_grad():
        for p in policy.parameters():
            p -= lr * p.grad
    return {k: before[k] - p.detach() for k, p in policy.named_parameters()}, logps.detach()


def check(results, dp: int) -> None:
    rows = [row for b in PAIR_BATCHES for row in b]
    want, _ = one_process(rows)
    pairs = sum(len(r["seq_lengths"]) // 2 for r in rows)
    # Every pair counted once: each DP group's pairs, summed over the DP groups (CP peers hold the same pairs).
    assert sum(r["pairs"] for r in results if r["cp_rank"] == 0) == pairs
    for r in results:
        _, logps = one_process(rows[r["dp_rank"] :: dp])
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
