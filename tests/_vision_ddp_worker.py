"""One process of the 2-process vision-language check of ``tests/test_vision_ddp.py`` (torchrun, gloo, CPU).

Usage: ``torchrun --nproc_per_node 2 tests/_vision_ddp_worker.py OUT_DIR FAMILY[,FAMILY...]`` (a Qwen family of
``packtools.testing.VL_FAMILIES``, ``gemma3-sdpa`` or ``gemma3-packtools_sdpa``).  Trains a tiny VL model one
SGD step (lr 1, no clipping) through ``Trainer`` + ``prepare_trainer`` on packed multimodal rows, and saves
the rows of its micro-batch and the parameter change to ``OUT_DIR/rank{r}.pt`` (several families: one after
the other in the one launch, each a new model and ``Trainer``, into ``OUT_DIR/FAMILY/rank{r}.pt``).
"""

from __future__ import annotations

import os
import sys

import datasets
import numpy as np
import torch
import transformers
from _vl_models import mixed_samples, tiny_vl

from packtools import pack_dataset, prepare_trainer
from packtools.batches.vision import MultimodalCollator


def samples():
    out = []
    for seed in (11, 12, 13):
        for s in mixed_samples(seed):
            out.append(
                {
                    "input_ids": s["input_ids"],
                    "pixel_values": s.get("pixel_values", np.zeros((0, 24), np.float32)).tolist(),
                    "image_grid_thw": s.get("image_grid_thw", np.zeros((0, 3), np.int64)).tolist(),
                }
            )
    return out


class Recorder:
    def __init__(self, inner):
        self.inner = self.collator = inner  # .collator: the wrapped collator, as ArrowCollator names it
        self.batches = []

    def __call__(self, features):
        from packtools.integrations.trainers.collator_check import in_check

        if not in_check():
            self.batches.append([{k: list(v) for k, v in f.items()} for f in features])
        return self.inner(features)


def gemma3_samples():
    from test_vision_gemma3 import samples as gemma3

    return [s for seed in (11, 12, 13) for s in gemma3(seed)]


def main(out: str, families: str) -> None:
    names = families.split(",")
    for family in names:
        folder = os.path.join(out, family) if len(names) > 1 else out
        os.makedirs(folder, exist_ok=True)
        train_one(folder, family)
    # The group torn down before the interpreter exits (CI on d0271a1: rank 0 aborted at its exit, 'terminate
    # called without an active exception', -6, after its results were saved), as tests/_ddp_worker.py does.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def train_one(out: str, family: str) -> None:
    rank = int(os.environ["RANK"])
    if family.startswith("gemma3"):  # gemma3-sdpa (dense masks), gemma3-packtools_sdpa (per-document masks)
        from test_vision_refusals import tiny_gemma3

        model = tiny_gemma3("sdpa")
        if family == "gemma3-packtools_sdpa":
            from packtools.integrations.attention.segmented import register

            model.set_attn_implementation(register())
        rows = pack_dataset(datasets.Dataset.from_list(gemma3_samples()), 48)
    else:
        model = tiny_vl(family, "sdpa")
        rows = pack_dataset(datasets.Dataset.from_list(samples()), 40)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=1, optim="sgd", learning_rate=1.0,
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    recorder = Recorder(MultimodalCollator(model, 0))
    trainer = transformers.Trainer(model, args, train_dataset=rows, data_collator=recorder)
    # gemma3-sdpa stays on sdpa (prepare_trainer would switch it to packtools_sdpa, reading the dense masks)
    trainer = prepare_trainer(trainer, segmented_sdpa=family != "gemma3-sdpa")
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    delta = {k: before[k] - p.detach() for k, p in model.named_parameters()}
    torch.save({"batches": recorder.batches, "delta": delta}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
