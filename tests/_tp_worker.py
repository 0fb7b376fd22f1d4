"""One process of the tensor-parallel harness of ``tests/test_tp_training.py`` (torchrun, gloo, CPU).

Usage: ``torchrun --nproc_per_node W tests/_tp_worker.py TP OUT_DIR``.  A torch ``DeviceMesh`` of shape
``(W / TP, TP)`` named ``("dp", "tp")`` (``("tp",)`` alone when ``W == TP``), built with
``init_device_mesh("cpu", ...)``; the tiny Llama's attention projections (q/k/v column-wise, o row-wise) and MLP
(gate/up column-wise, down row-wise) split over ``tp`` by torch's ``parallelize_module`` (``ColwiseParallel`` /
``RowwiseParallel``: DTensor weights, the row-wise outputs all-reduced over gloo); a second variant also splits
the embedding (row-wise) and the LM head (column-wise, logits sharded over the vocabulary, the loss under
``loss_parallel()``).  The data side is packtools':
``RankLayout.from_mesh(mesh)`` gives the data-parallel rank and size, and a ``TokenBudgetBatchSampler`` sharded
over them picks each rank's rows.

Recorded per rank: the row indices of every batch of the epoch (packtools' sampler, and the negative control: the
same sampler sharded over all processes, the old behaviour), the input ids of every collated batch, and the
parameter change of one SGD step (lr 1, fp32) on the first batch of every DP group -- loss the summed next-token
loss over the step's targets on every DP group, gradients summed over the DP group -- with DTensor parameters
gathered whole (``full_tensor``), for both variants; and what ``rank_layout`` says of a trainer holding the
split model while its accelerator knows no parallelism (refused by name).  Rank 0 writes ``OUT_DIR/result.pt``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _cp_fixtures import tiny_llama_fp32
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from packtools import PaddingFreeCollator  # noqa: E402
from packtools.batches import TokenBudgetBatchSampler  # noqa: E402
from packtools.integrations import RankLayout
from packtools.integrations.attention import segmented  # noqa: E402

MAX_TOKENS = 200


def tp_rows(n: int = 12, seed: int = 3) -> list[dict]:
    """Packed rows (``input_ids`` + ``seq_lengths``): 1-4 documents of 1-40 tokens, token ids from ``seed``."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        lengths = rng.integers(1, 41, rng.integers(1, 5)).tolist()
        rows.append({"input_ids": rng.integers(2, 97, sum(lengths)).tolist(), "seq_lengths": lengths})
    return rows


def tp_plan(layers: int) -> dict:
    plan = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            plan[p + name] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
    return plan


def sampler(rows: list[dict], num_replicas: int, rank: int) -> TokenBudgetBatchSampler:
    lengths = [len(r["input_ids"]) for r in rows]
    return TokenBudgetBatchSampler(lengths, MAX_TOKENS, seed=0, num_replicas=num_replicas, rank=rank)


def step_loss(model, batch) -> tuple[torch.Tensor, int]:
    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        cu_seq_lens_q=batch["cu_seq_lens_q"],
        cu_seq_lens_k=batch["cu_seq_lens_k"],
        max_length_q=batch["max_length_q"],
        max_length_k=batch["max_length_k"],
        use_cache=False,
    ).logits
    labels = batch["labels"][0, 1:]
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels, ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def tp_step(tp_mesh, dp_group, batch, vocab: bool) -> tuple[dict, list[str]]:
    """One SGD step (lr 1) of the tiny Llama split over ``tp_mesh``; returns the whole parameter changes and the
    names of the DTensor parameters.  ``vocab``: also the embedding (row-wise, vocabulary split) and the LM head
    (column-wise, logits left sharded over the vocabulary) with the loss under ``loss_parallel()``."""
    model = tiny_llama_fp32()
    model.set_attn_implementation(segmented.register())
    plan = tp_plan(model.config.num_hidden_layers)
    if vocab:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, plan)
    before = {k: whole(p.detach()).clone() for k, p in model.named_parameters()}
    with loss_parallel() if vocab else contextlib.nullcontext():
        loss, count = step_loss(model, batch)
        targets = torch.tensor([count])
        if dp_group is not None:  # the step's targets over the DP groups (TP peers hold the same rows: once)
            dist.all_reduce(targets, group=dp_group)
        (loss / int(targets)).backward()
    with torch.no_grad():
        for p in model.parameters():
            if dp_group is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=dp_group)  # DTensor's local shard: summed over the DP group
            p -= p.grad
    delta = {k: before[k] - whole(p.detach()) for k, p in model.named_parameters()}
    return delta, sorted(k for k, p in model.named_parameters() if isinstance(p, DTensor))


def refusal(tp_mesh, world: int, rank: int) -> str:
    """What ``rank_layout`` (the layout ``prepare_trainer`` reads) says of a trainer whose model torch split over
    ``tp_mesh`` but whose accelerator knows no parallelism: the refusal's text ('' if it took the processes for
    data-parallel replicas, the silent old behaviour)."""
    from types import SimpleNamespace as NS

    from packtools.integrations.parallel.layout import rank_layout

    model = tiny_llama_fp32()
    parallelize_module(model, tp_mesh, tp_plan(model.config.num_hidden_layers))
    args = NS(world_size=world, process_index=rank)
    trainer = NS(args=args, model=model, accelerator=NS(parallelism_config=None), is_deepspeed_enabled=False)
    try:
        rank_layout(trainer)
    except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
        return str(err)
    return ""


def main() -> None:
    tp, out = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // tp
    if dp == 1:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    layout = RankLayout.from_mesh(mesh)
    rows = tp_rows()
    collator = PaddingFreeCollator(0)
    ours = [list(b) for b in sampler(rows, layout.dp_size, layout.dp_rank)]
    old = [list(b) for b in sampler(rows, world, rank)]  # negative control: sharded over every process
    ids = [collator([rows[i] for i in b])["input_ids"][0].tolist() for b in ours]

    dp_group = mesh["dp"].get_group() if dp > 1 else None
    tp_mesh = mesh["tp"] if dp > 1 else mesh
    batch = collator([rows[i] for i in ours[0]])
    delta, sharded = tp_step(tp_mesh, dp_group, batch, vocab=False)
    vocab_delta, vocab_sharded = tp_step(tp_mesh, dp_group, batch, vocab=True)
    refused = refusal(tp_mesh, world, rank)
    record = {
        "rank": rank,
        "refused": refused,
        "layout": (layout.dp_rank, layout.dp_size, layout.tp_size),
        "ours": ours,
        "old": old,
        "ids": ids,
        "delta": delta,
        "sharded": sharded,
        "vocab_delta": vocab_delta,
        "vocab_sharded": vocab_sharded,
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        torch.save({"ranks": gathered, "rows": rows}, out / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
