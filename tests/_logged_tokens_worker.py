"""One process of ``tests/test_logged_tokens.py``'s 2-process check (``torchrun``, gloo, CPU).

Usage: ``torchrun --nproc_per_node 2 tests/_logged_tokens_worker.py OUT_DIR``.  A TRL ``SFTTrainer`` on packed rows
through ``PaddingFreeCollator(padding_free=False)``, one row per process and micro-batch: a batch of one
single-sequence row carries an ``attention_mask``, a batch of a packed row does not, so at a step the two processes
may hold batches of either kind.  Every rank's logged ``num_tokens`` goes to ``OUT_DIR/tokens.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _hf_models import PAD, tiny_llama, word_tokenizer
from _workers import quiet_hf_rank, run_worker, save_gathered

# single-sequence rows (their batches carry an attention_mask) and packed rows (none), 12 tokens each
ROWS = {
    "input_ids": [[3 + (5 * r + j) % 90 for j in range(12)] for r in range(8)],
    "seq_lengths": [[12], [5, 7], [12], [12], [3, 9], [6, 6], [12], [4, 8]],
}


def main() -> None:
    import datasets
    import trl

    from packtools import PaddingFreeCollator, prepare_trainer
    from packtools.integrations import packed_sft_config

    quiet_hf_rank()
    out = Path(sys.argv[-1])
    rows = datasets.Dataset.from_dict({**ROWS, "labels": ROWS["input_ids"]})
    args = packed_sft_config(
        output_dir=str(out / "run"),
        per_device_train_batch_size=1,
        num_train_epochs=1,
        logging_steps=1,
        bf16=False,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        ddp_backend="gloo",
        padding_free=False,
    )
    trainer = trl.SFTTrainer(
        tiny_llama("sdpa"),
        args=args,
        train_dataset=rows,
        processing_class=word_tokenizer(),
        data_collator=PaddingFreeCollator(PAD, padding_free=False, attn_implementation="sdpa"),
    )
    prepare_trainer(trainer).train()
    save_gathered(
        [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h], out / "tokens.pt"
    )


if __name__ == "__main__":
    run_worker(main)
