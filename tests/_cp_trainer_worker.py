"""One process of the Trainer half of ``tests/test_cp_training.py``: ``prepare_trainer(context_parallel=CP)``.

Usage: ``torchrun --nproc_per_node W tests/_cp_trainer_worker.py CP GA OUT_DIR``.  The 4 rows of
``benchmarks/cp_loop.BATCHES`` are the global batch of one optimizer step (``W / CP`` DP ranks, ``GA``
micro-batches of ``4 / DP / GA`` rows each), SGD lr 1, no clipping; rank 0 writes every rank's parameter change and the targets it
counted to ``OUT_DIR/trainer.pt``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _cp_fixtures import BATCHES, tiny_llama_fp32


def main() -> None:
    import datasets
    import transformers

    from packtools import PaddingFreeCollator, prepare_trainer

    cp, ga, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dp = world // cp
    rows = [row for batch in BATCHES for row in batch]
    dataset = datasets.Dataset.from_list(rows)
    model = tiny_llama_fp32()
    args = transformers.TrainingArguments(
        output_dir=str(out / "run"),
        per_device_train_batch_size=len(rows) // dp // ga,
        gradient_accumulation_steps=ga,
        max_steps=1,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=PaddingFreeCollator(0),
        optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
    )
    prepare_trainer(trainer, context_parallel=cp)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    delta = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"delta": delta, "impl": model.config._attn_implementation})
    if rank == 0:
        torch.save(gathered, out / "trainer.pt")
    dist.barrier()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
