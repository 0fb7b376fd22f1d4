"""One process of the context-parallel harness of ``tests/test_cp_training.py`` (torchrun, gloo, CPU).

Usage: ``torchrun --nproc_per_node W tests/_cp_worker.py CP OUT_DIR``; ``CP`` may be a comma-separated list, the
sizes run one after the other in one launch (torchrun's start and the imports paid once).  ``W / CP`` data-parallel groups of
``CP`` consecutive ranks; DP group ``d`` reads ``BATCHES[d :: W / CP]`` (all of them with one DP group).
Each variant runs one SGD step (lr 1) of a tiny Llama (fp32) from the same weights on its CP shard, the loss
being each rank's summed next-token loss divided by the step's target count over all ranks, the gradients
summed over all ranks (``plain_cp_step`` in ``benchmarks/cp_loop.py``), and records the parameter change.
Variants: ``cp`` (packtools' layout), ``cp_balanced`` (its chunk pairs balanced per document), ``whole_row`` (the row split as one sequence), ``shift_after``
(labels shifted after the split), ``rank_mean`` (each rank's own token mean, averaged over ranks).
Rank 0 writes ``OUT_DIR/result.pt`` (one ``CP``), ``OUT_DIR/result-CP.pt`` for each of a list.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from _cp_fixtures import BATCHES, tiny_llama_fp32
from _scripts import script
from _workers import run_worker, save_gathered

from packtools import PaddingFreeCollator  # noqa: E402
from packtools.batches.context_parallel import CP_KEY, CPLayout, CPShard, shard_row  # noqa: E402
from packtools.integrations.attention.context_parallel import use_cp_attention  # noqa: E402


def variant_batches(name, rows, cp, rank, collator, bound=None):
    full = collator(rows)
    lengths = np.diff(full["cu_seq_lens_q"])
    ids, labels = full["input_ids"][0], full["labels"][0]
    if name == "whole_row":
        return shard_row(ids, labels, [int(lengths.sum())], cp, rank, 0, bound=bound)
    batch = shard_row(ids, labels, lengths, cp, rank, 0, balance=name == "cp_balanced", bound=bound)
    if name == "shift_after":
        layout = batch[CP_KEY].layout
        src = layout.source(rank)
        local = np.where(src >= 0, labels[np.maximum(src, 0)], -100)
        batch["shift_labels"] = np.append(local[1:], -100)[None]
    return batch


def main() -> None:
    cps, out = sys.argv[1].split(","), Path(sys.argv[2])
    dist.init_process_group("gloo")
    for cp in cps:
        result = one_size(int(cp))
        save_gathered(result, out / ("result.pt" if len(cps) == 1 else f"result-{cp}.pt"))
    dist.destroy_process_group()


def one_size(cp: int) -> dict:
    world = dist.get_world_size()
    recipe = script("cp_loop")  # the documented loop under test
    layout = recipe.cp_layout(cp)  # the layout owns the CP group; every shard below carries it
    dp_rank, cp_rank = layout.dp_rank, layout.cp_rank
    dp = world // cp
    collator = PaddingFreeCollator(0, return_tensors="np")
    rows = [row for b in BATCHES[dp_rank::dp] for row in b]
    result = {}
    for name in ("cp", "cp_balanced", "whole_row", "shift_after", "rank_mean"):
        model = tiny_llama_fp32()
        use_cp_attention(model)
        batch = variant_batches(name, rows, cp, cp_rank, collator, layout)
        delta, count = recipe.plain_cp_step(model, batch, rank_mean=name == "rank_mean")
        result[name] = delta
        result[name + "_count"] = count
    # The shard a process cut for another CP rank is refused by name (a real gather would mix tokens).
    model = tiny_llama_fp32()
    use_cp_attention(model)
    wrong = variant_batches("cp", rows, cp, (cp_rank + 1) % cp, collator)  # no layout: the default group
    try:
        recipe.plain_cp_step(model, wrong)
        result["refused"] = ""
    except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
        result["refused"] = str(err)
    layout = CPLayout.build(np.diff(collator(rows)["cu_seq_lens_q"]), cp)
    result["targets_local"] = int(
        (variant_batches("cp", rows, cp, cp_rank, collator)["shift_labels"] != -100).sum()
    )
    assert CPShard.build(layout, cp_rank).layout.cp_size == cp
    return result


if __name__ == "__main__":
    run_worker(main)
