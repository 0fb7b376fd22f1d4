"""One process of the Trainer half of ``tests/test_cp_training.py``: ``prepare_trainer(context_parallel=CP)``.

Usage: ``torchrun --nproc_per_node W tests/_cp_trainer_worker.py CP GAS OUT_DIR``.  ``GAS``: one run per
comma-separated accumulation count, one after the other in one launch (torchrun's start and the imports paid
once), a new model and trainer each.  The 4 rows of ``tests/_cp_fixtures.BATCHES`` are the global batch of one
optimizer step (``W / CP`` DP ranks, ``GA`` micro-batches of ``4 / DP / GA`` rows each), SGD lr 1, no clipping;
rank 0 writes every rank's parameter change and the targets it counted to ``OUT_DIR/trainer-GA.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from _loss_modes_trainer_worker import run_step
from _workers import run_worker, save_gathered


def main() -> None:
    cp, gas, out = int(sys.argv[1]), sys.argv[2].split(","), Path(sys.argv[3])
    world = int(os.environ["WORLD_SIZE"])
    for ga in gas:  # the token mean: prepare_trainer's default loss
        result, trainer = run_step(out / f"ga-{ga}", cp, int(ga), world // cp)
        impl = trainer.model.config._attn_implementation
        save_gathered({"delta": result["delta"], "impl": impl}, out / f"trainer-{ga}.pt")


if __name__ == "__main__":
    run_worker(main)
