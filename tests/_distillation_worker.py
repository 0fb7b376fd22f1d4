"""Two-process run of ``tests/test_distillation.py``: TRL's ``DistillationTrainer`` padded, then prepared by
``prepare_distillation_trainer``, each two optimizer steps under DDP (gloo, CPU) from the same seeds.

Usage: ``torchrun --nproc_per_node 2 tests/_distillation_worker.py OUT``.  Each rank writes ``OUT/rank{r}.json``:
the world size, the largest weight difference between the two runs, and both runs' logged losses and entropies.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _hf_models import word_tokenizer
from _trl_setup import datasets, transformers, trl
from test_grpo import VOCAB, prompts, tiny

from packtools.integrations.rl.distillation import prepare_distillation_trainer


def run(out: Path, prepared: bool) -> object:
    config = trl.DistillationConfig(
        output_dir=str(out / f"run{int(prepared)}"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        seed=0,
        max_steps=2,
        beta=0.3,
    )
    trainer = trl.DistillationTrainer(
        tiny("llama"),
        teacher_model=tiny("qwen3", seed=1),
        args=config,
        train_dataset=datasets.Dataset.from_list(prompts(16)),
        processing_class=word_tokenizer(VOCAB),
    )
    if prepared:
        prepare_distillation_trainer(trainer)
    transformers.set_seed(0)
    trainer.train()
    return trainer


def main() -> None:
    out = Path(sys.argv[1])
    theirs, ours = run(out, False), run(out, True)
    a, b = (t.accelerator.unwrap_model(t.model) for t in (theirs, ours))
    diff = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    logs = [
        [[x.get(k), y.get(k)] for k in ("loss", "entropy") if k in x]
        for x, y in zip(theirs.state.log_history, ours.state.log_history, strict=True)
    ]
    record = {
        "world": theirs.accelerator.num_processes,
        "type": type(ours).__name__,
        "diff": diff,
        "logs": logs,
    }
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
