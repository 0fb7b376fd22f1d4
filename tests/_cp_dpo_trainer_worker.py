"""One process of the Trainer half of ``tests/test_cp_dpo.py``: ``prepare_dpo_trainer(context_parallel=CP)``.

Usage: ``torchrun --nproc_per_node W tests/_cp_dpo_trainer_worker.py CP RUNS OUT_DIR``.  ``RUNS``: runs of
one launch, one after the other, comma-separated: ``GA`` or ``GA-local``.  The 4 packed pair rows of
``_cp_fixtures.PAIR_BATCHES`` are the global batch of one optimizer step (``W / CP`` DP ranks, ``GA``
micro-batches of ``4 / DP / GA`` rows each) of TRL's ``DPOTrainer`` (sigmoid loss, beta 0.5, a reference model
of other weights, fp32, SGD lr 1, no clipping), a new model and trainer for each run; rank 0 writes every rank's
parameter change to ``OUT_DIR/trainer-RUN.pt``, with the step's logged loss and the refusal of a call on
different rows per rank.  ``local``: the negative control, each rank's per-token outputs never summed over the
CP group (TRL's loss on partial sums; the sum is put back after the run).  One launch runs several so the tests
pay torchrun's start and the imports once (tests/_launch.py: the launches of a test run take turns).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from _cp_fixtures import PAIR_BATCHES, tiny_llama_fp32
from _workers import run_worker, save_gathered


def main() -> None:
    import packtools.integrations.preference.context_parallel as cp_dpo

    cp, runs, out = int(sys.argv[1]), sys.argv[2].split(","), Path(sys.argv[3])
    summed = cp_dpo.sum_over_group
    for run in runs:
        ga, _, variant = run.partition("-")
        if variant == "local":  # the negative control: no sum over the CP group
            cp_dpo.sum_over_group = lambda x, group=None: x
        elif variant:
            raise ValueError(f"unknown run {run!r}")
        try:
            result = one_run(cp, int(ga), out / f"run-{run}")
        finally:
            cp_dpo.sum_over_group = summed
        save_gathered(result, out / f"trainer-{run}.pt")


def one_run(cp: int, ga: int, out: Path) -> dict:
    import datasets
    import trl
    from _hf_models import exact_step_args, text_pairs, word_tokenizer

    from packtools import prepare_dpo_trainer

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    dp = world // cp
    rows = [row for batch in PAIR_BATCHES for row in batch]
    model, reference = tiny_llama_fp32(0), tiny_llama_fp32(1)
    args = trl.DPOConfig(
        **exact_step_args(
            out / "run",
            per_device_train_batch_size=len(rows) // dp // ga,
            gradient_accumulation_steps=ga,
            max_steps=1,
            beta=0.5,
            ddp_backend="gloo",
        )
    )
    trainer = trl.DPOTrainer(
        model,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(text_pairs(8)),
        processing_class=word_tokenizer(),
    )
    prepare_dpo_trainer(trainer, train_dataset=datasets.Dataset.from_list(rows), context_parallel=cp)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss = trainer.train().training_loss
    delta = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    # A call whose row differs between the CP peers (what an evaluation loader sharding over every process
    # hands them) is refused by name on every rank, never attended across as one row.
    ids = torch.arange(2, 8 + rank).repeat(2, 1)
    try:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True)
        refused = ""
    except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
        refused = str(err)
    # evaluate() on packed pair rows: refused by name before TRL prepares the set (it raised KeyError 'chosen').
    try:
        trainer.evaluate(eval_dataset=datasets.Dataset.from_list(rows))
        eval_refused = ""
    except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
        eval_refused = f"{type(err).__name__}: {err}"
    return {
        "delta": delta,
        "impl": model.config._attn_implementation,
        "loss": loss,
        "refused": refused,
        "eval_refused": eval_refused,
    }


if __name__ == "__main__":
    run_worker(main)
