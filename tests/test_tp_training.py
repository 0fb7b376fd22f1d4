"""Tensor parallelism for real on CPU: torch's TP over a ``DeviceMesh`` (gloo), fed by packtools' per-rank data.

``torchrun`` + gloo, tiny Llama fp32, ``init_device_mesh("cpu", ...)`` and ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` on every attention and MLP projection, and in a second variant on the
embedding and the LM head too with the loss under ``loss_parallel()`` (``tests/_tp_worker.py``); the
data-parallel rank and size come from ``RankLayout.from_mesh(mesh)`` and shard a ``TokenBudgetBatchSampler``.

TP = 2 (2 processes) and DP = 2 x TP = 2 (4 processes): TP peers get exactly the same rows at every step, the DP
groups disjoint rows covering the epoch once, and the parameter update of one SGD step equals one process on the
same global batch within 1e-5 relative.  Negative control: the sampler sharded over all processes (what the
loaders did before the layout was read from the mesh) gives TP peers different rows, and the same check says so;
``rank_layout`` (what ``prepare_trainer`` reads) refuses by name a trainer holding the split model whose accelerator
knows no parallelism, the case that would shard that way.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_cp_training import launch, rel  # noqa: E402

from packtools import PaddingFreeCollator  # noqa: E402
from packtools.integrations.attention import segmented  # noqa: E402


def reference_step(rows: list[dict]) -> dict:
    """One process, every row of the step in one padding-free batch, the token mean, one SGD step (lr 1)."""
    from _cp_fixtures import tiny_llama_fp32
    from _tp_worker import step_loss

    model = tiny_llama_fp32()
    model.set_attn_implementation(segmented.register())
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss, count = step_loss(model, PaddingFreeCollator(0)(rows))
    (loss / count).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}


def tp_groups(ranks: list[dict], tp: int) -> list[list[dict]]:
    """The ranks of each TP group (consecutive ranks: the mesh's last dimension is ``tp``)."""
    return [ranks[i : i + tp] for i in range(0, len(ranks), tp)]


def peers_share_rows(ranks: list[dict], tp: int, key: str) -> bool:
    """Whether every TP peer drew exactly the same batches (the same rows, in the same order) all epoch."""
    return all(all(r[key] == group[0][key] for r in group) for group in tp_groups(ranks, tp))


def check(result: dict, tp: int) -> float:
    ranks, rows = result["ranks"], result["rows"]
    dp = len(ranks) // tp
    assert [r["layout"] for r in ranks] == [(i // tp, dp, tp) for i in range(len(ranks))]
    assert peers_share_rows(ranks, tp, "ours")
    for group in tp_groups(ranks, tp):  # the same token ids reached every peer, batch after batch
        assert all(r["ids"] == group[0]["ids"] for r in group)
    # The DP groups: disjoint rows, the epoch covered once, the same number of steps.
    per_group = [sorted(i for b in group[0]["ours"] for i in b) for group in tp_groups(ranks, tp)]
    assert sorted(i for g in per_group for i in g) == list(range(len(rows)))
    assert len({len(group[0]["ours"]) for group in tp_groups(ranks, tp)}) == 1
    # Negative control: sharded over every process, TP peers draw different rows, and the check sees it.
    assert not peers_share_rows(ranks, tp, "old")
    # A Trainer holding the split model with no ParallelismConfig would shard that way: refused by name.
    for r in ranks:
        assert "DTensors over a device mesh of" in r["refused"] and "RankLayout.from_mesh" in r["refused"]
    # Torch really split the model: the projections (and, in the second variant, the embedding and the LM
    # head) are DTensors on every rank.
    assert len(ranks[0]["sharded"]) == 7 * 2 and all("proj" in k for k in ranks[0]["sharded"])
    vocab = set(ranks[0]["vocab_sharded"]) - set(ranks[0]["sharded"])
    assert vocab == {"model.embed_tokens.weight", "lm_head.weight"}
    step = [rows[i] for group in tp_groups(ranks, tp) for i in group[0]["ours"][0]]
    want = reference_step(step)
    worst = max(rel(r[key], want) for r in ranks for key in ("delta", "vocab_delta"))
    assert worst < 1e-5, worst
    # Control of the comparison: the same step with one row left out is visibly another step.
    assert rel(reference_step(step[:-1]), want) > 1e-3
    return worst


@pytest.mark.slow
def test_tp2_peers_share_rows_and_step_equals_one_process(tmp_path):
    check(launch(tmp_path, 2, 2, "_tp_worker.py"), 2)


@pytest.mark.slow
def test_dp2_tp2_disjoint_dp_rows_and_step_equals_one_process(tmp_path):
    check(launch(tmp_path, 4, 2, "_tp_worker.py"), 2)
