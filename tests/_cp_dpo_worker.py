"""One process of ``tests/test_cp_dpo.py``: DPO on CP shards of packed pairs (torchrun, gloo, CPU).

Usage: ``torchrun --nproc_per_node W tests/_cp_dpo_worker.py CP OUT_DIR``.  ``W / CP`` data-parallel groups of
``CP`` consecutive ranks; DP group ``d`` reads the rows ``[rows of PAIR_BATCHES][d :: W / CP]`` as one
padding-free row of packed pairs, each rank its CP shard.  Each variant runs one SGD step (lr 1) of a tiny
Llama policy (fp32) against a tiny Llama reference of other weights (so the pair margins are not 0), from the
same weights every time (``plain_cp_dpo_step`` in ``benchmarks/cp_dpo_loop.py``), and records the parameter
change.  Variants: ``cp`` (packtools), ``local`` (each rank's partial sums, no sum over the CP group),
``autograd_sum`` (summed with an all-reduce whose backward sums too, the loss not divided by CP) and
``autograd_sum_divided`` (the same, divided by CP: right).  Rank 0 writes ``OUT_DIR/result.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _cp_fixtures import PAIR_BATCHES, tiny_llama_fp32
from _scripts import script
from _workers import run_worker, save_gathered

from packtools.integrations.attention.context_parallel import use_cp_attention  # noqa: E402


def models(group):
    policy, reference = tiny_llama_fp32(0), tiny_llama_fp32(1).eval().requires_grad_(False)
    use_cp_attention(policy)
    use_cp_attention(reference)
    return policy, reference


def main() -> None:
    cp, out = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    recipe = script("cp_dpo_loop")  # the documented loop under test
    layout = script("cp_loop").cp_layout(cp)
    group, dp_rank, cp_rank = layout.cp_group, layout.dp_rank, layout.cp_rank
    solos = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    dp = world // cp
    rows = [row for b in PAIR_BATCHES for row in b][dp_rank::dp]
    batch = recipe.shard_pairs(rows, cp, cp_rank, layout)
    result = {"dp_rank": dp_rank, "cp_rank": cp_rank}
    variants = {
        "cp": {},
        "local": {"variant": "local"},
        "autograd_sum": {"variant": "autograd_sum"},
        "autograd_sum_divided": {"variant": "autograd_sum", "divide_by_cp": True},
    }
    for name, options in variants.items():
        policy, reference = models(group)
        delta, pairs = recipe.plain_cp_dpo_step(
            policy, reference, batch, group, cp, solo=solos[rank], **options
        )
        result[name] = delta
        result["pairs"] = pairs
    policy, _ = models(group)
    with torch.no_grad():
        result["logps"] = recipe.cp_pair_logps(policy, batch, group)
        result["local_logps"] = recipe.cp_pair_logps(policy, batch, group, "local", solos[rank])
    save_gathered(result, out / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    run_worker(main)
