"""One process of the reward-model data-parallel check of ``tests/test_reward_ddp.py`` (``torchrun``, gloo, CPU).

Usage: ``torchrun --nproc_per_node 2 tests/_reward_worker.py OUT_DIR``.  Trains ``RewardTrainer`` prepared by
``prepare_reward_trainer`` (tiny Llama, fp32, SGD lr 1, no clipping, margins) on TRL's own batches, on packed
pair rows, and on packed rows by token budget, and records per rank: the pairs of every micro-batch in the
order drawn (as ``(chosen_ids, rejected_ids)``), the parameter change of the first optimizer step and the
number of steps, the metrics logged at the first step; and one KTO optimizer step, TRL's padded and ``prepare_kto_trainer``'s.  Results of rank ``r`` go to ``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
from _hf_models import FirstStep
from _workers import quiet_hf_rank

GA = 2


class Recorder:
    def __init__(self, inner):
        self.inner, self.batches = inner, []

    def __call__(self, features):
        self.batches.append([pair for f in features for pair in pairs_of(f)])
        return self.inner(features)


def pairs_of(feature):
    if "seq_lengths" not in feature:
        return [(tuple(feature["chosen_ids"]), tuple(feature["rejected_ids"]))]
    ids, start = list(feature["input_ids"]), 0
    seqs = []
    for n in feature["seq_lengths"]:
        seqs.append(tuple(ids[start : start + n]))
        start += n
    return [(seqs[k], seqs[k + 1]) for k in range(0, len(seqs), 2)]


def run(out, packed, **prepare):
    import test_reward

    from packtools.integrations.preference.data import pack_reward_pairs
    from packtools.integrations.preference.reward import prepare_reward_trainer

    trainer = test_reward.build(
        Path(out), n=24, margin=True, per_device_train_batch_size=2, gradient_accumulation_steps=GA,
        num_train_epochs=1, logging_strategy="steps", logging_steps=1,
    )  # fmt: skip
    dataset = pack_reward_pairs(trainer.train_dataset, 80) if packed else None
    if packed:
        trainer.args.per_device_train_batch_size = 1
    prepare_reward_trainer(trainer, dataset, **prepare)
    recorder = Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    first = FirstStep(trainer.model)
    trainer.add_callback(first)
    trainer.train()
    return {
        "batches": recorder.batches,
        "delta": first.delta,
        "steps": trainer.state.global_step,
        "logged": trainer.state.log_history[0],  # the first optimizer step's metrics
    }


def run_kto(out, prepared):
    import test_kto

    from packtools.integrations.preference.kto import prepare_kto_trainer

    trainer = test_kto.build(
        Path(out), n=16, per_device_train_batch_size=2, gradient_accumulation_steps=GA, max_steps=1
    )
    if prepared:
        prepare_kto_trainer(trainer)
    first = FirstStep(trainer.model)
    trainer.add_callback(first)
    trainer.train()
    return {"delta": first.delta, "steps": trainer.state.global_step}


def main(out: str) -> None:
    rank = quiet_hf_rank()
    results = {}
    work = os.path.join(out, "work")
    for name, packed, prepare in (
        ("unpacked", False, {}),
        ("packed", True, {}),
        ("packed_budget", True, {"max_tokens": 96}),
    ):
        try:
            results[name] = run(work, packed, **prepare)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    for name, prepared in (("kto_padded", False), ("kto", True)):  # TRL's padded KTO step and packtools'
        try:
            results[name] = run_kto(work, prepared)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    torch.save(results, Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
    from _workers import end_process_group

    end_process_group()
