"""One process of ``tests/test_loss_modes.py``: ``prepare_trainer(..., loss=MODE)`` under torchrun.

Usage: ``torchrun --nproc_per_node 2 tests/_loss_modes_trainer_worker.py CP GA OUT_DIR``; ``CP`` may be a
comma-separated list, run one after the other in one launch (torchrun's start and the imports paid once), each
written to ``OUT_DIR/trainer-CP.pt``.  The rows of
``tests/_cp_fixtures.BATCHES`` are the global batch of one optimizer step (``2 / CP`` DP ranks, ``GA``
micro-batches), SGD lr 1, no clipping: the parameter change is the gradient.  For each loss mode rank 0 writes
every rank's parameter change and the step's loss to ``OUT_DIR/trainer.pt``.  With ``CP > 1`` it also runs
the regressions of the adversarial round: a ``Trainer`` subclass whose ``compute_loss`` returns ``loss * 0.0``
(and ``* 0.25``) under CP, ``predict`` under CP, and a subclass computing its loss from the logits with
its own label shift, or forwarding the shard's tokens without its CP key -- the ids, their embeddings, a sliced
copy, into a teacher, from a training_step of its own (each refused by name) -- and a teacher given the key.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _cp_fixtures import BATCHES, tiny_llama_fp32
from _hf_models import plain_sgd_options
from _workers import run_worker, save_gathered


def run_step(
    out: Path,
    cp: int | None,
    ga: int,
    dp: int,
    mode: str = "token",
    cls: type = None,
    dft: bool = False,
    **prepare,
):
    """One optimizer step on ``BATCHES`` (``dp`` data-parallel ranks, ``ga`` micro-batches); returns
    ``({"delta", "loss"}, trainer)``.  ``dft``: TRL's ``SFTTrainer`` with ``loss_type="dft"``; ``prepare``: more
    options of ``prepare_trainer``."""
    import datasets
    import transformers

    from packtools import PaddingFreeCollator, prepare_trainer

    rows = [row for batch in BATCHES for row in batch]
    model = tiny_llama_fp32()
    options = dict(
        output_dir=str(out / "run"),
        per_device_train_batch_size=len(rows) // dp // ga,
        gradient_accumulation_steps=ga,
        max_steps=1,
        **plain_sgd_options(),
        ddp_backend="gloo" if dist.is_initialized() or "WORLD_SIZE" in os.environ else None,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    common = dict(
        model=model,
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=PaddingFreeCollator(0),
        optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
    )
    if dft:
        import trl
        from _hf_models import word_tokenizer

        from packtools.integrations import packed_sft_config

        args = packed_sft_config(**options, loss_type="dft", bf16=False, padding_free=False)
        trainer = trl.SFTTrainer(args=args, processing_class=word_tokenizer(), **common)
    else:
        trainer = (cls or transformers.Trainer)(args=transformers.TrainingArguments(**options), **common)
    prepare_trainer(trainer, context_parallel=cp, loss=mode, **prepare)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss = trainer.train().training_loss
    return {"delta": {k: before[k] - p.detach() for k, p in model.named_parameters()}, "loss": loss}, trainer


def main() -> None:
    cps, ga, out = sys.argv[1].split(","), int(sys.argv[2]), Path(sys.argv[3])
    for cp in cps:
        result = one_size(int(cp), ga, out / f"cp-{cp}" if len(cps) > 1 else out)
        save_gathered(result, out / ("trainer.pt" if len(cps) == 1 else f"trainer-{cp}.pt"))


def one_size(cp: int, ga: int, out: Path) -> dict:
    import datasets
    import transformers

    world = int(os.environ["WORLD_SIZE"])
    dp = world // cp

    def step(mode: str, cls: type = None, dft: bool = False):
        return run_step(out, cp, ga, dp, mode, cls, dft)

    result = {}
    for mode in ("token", "sample", "sqrt"):
        result[mode], trainer = step(mode)
    if cp > 1:

        class Frozen(transformers.Trainer):  # the user's loss is zero: no parameter may move
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 0.0

        class Quarter(transformers.Trainer):
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 0.25

        result["frozen"], _ = step("token", Frozen)
        result["quarter"], _ = step("token", Quarter)
        result["dft"], _ = step("token", dft=True)  # SFTTrainer(loss_type="dft"): TRL's loss, honoured

        class OwnShift(transformers.Trainer):  # the loss computed from the logits, the labels shifted here
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                labels = inputs.pop("labels")
                inputs.pop("shift_labels", None)
                logits = model(**inputs).logits[:, :-1]
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
                )
                return loss / num_items_in_batch * self.accelerator.num_processes

        class OwnMean(transformers.Trainer):  # the model's loss without num_items_in_batch: the shard's mean
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return model(**inputs).loss

        class OwnNoKey(transformers.Trainer):  # the shard forwarded without its CP key: wrong attention
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                kept = {k: v for k, v in inputs.items() if k != "packtools_cp"}
                loss = model(**kept, num_items_in_batch=num_items_in_batch).loss
                return loss * self.accelerator.num_processes

        class OwnEmbeds(transformers.Trainer):  # NEFTune-style: the shard's embeddings, without its CP key
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                kept = {k: v for k, v in inputs.items() if k not in ("packtools_cp", "input_ids")}
                embeds = self.model.get_input_embeddings()(inputs["input_ids"])
                loss = model(inputs_embeds=embeds, **kept, num_items_in_batch=num_items_in_batch).loss
                return loss * self.accelerator.num_processes

        class OwnSlice(transformers.Trainer):  # a sliced copy of the shard's ids, with their positions
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                cut = {k: inputs[k][:, :-1].clone() for k in ("input_ids", "position_ids", "labels")}
                loss = model(**cut, num_items_in_batch=num_items_in_batch).loss
                return loss * self.accelerator.num_processes

        class Taught(
            transformers.Trainer
        ):  # a teacher (the student's weights) run on the shard beside the loss
            keyed = False

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.teacher = tiny_llama_fp32()
                if self.keyed:
                    from packtools.integrations import use_cp_attention

                    use_cp_attention(self.teacher)

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                loss, out = super().compute_loss(model, inputs, True, num_items_in_batch)
                keys = (
                    ("input_ids", "position_ids", "packtools_cp")
                    if self.keyed
                    else ("input_ids", "position_ids")
                )
                with torch.no_grad():
                    taught = self.teacher(**{k: inputs[k] for k in keys}).logits
                self.teacher_gap = max(
                    getattr(self, "teacher_gap", 0.0), float((taught - out.logits).abs().max())
                )
                return loss

        class TaughtKeyed(Taught):
            keyed = True

        class OwnStep(
            transformers.Trainer
        ):  # a training_step of its own forwarding the shard without its key
            def training_step(self, model, inputs, num_items_in_batch=None):
                with torch.no_grad():
                    model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
                return super().training_step(model, inputs, num_items_in_batch)

        result["taught_keyed"], keyed = step("token", TaughtKeyed)  # the key given: right, and not refused
        result["taught_keyed"]["gap"] = keyed.teacher_gap
        for name, cls in (
            ("own_shift", OwnShift),
            ("own_mean", OwnMean),
            ("own_nokey", OwnNoKey),
            ("own_embeds", OwnEmbeds),
            ("own_slice", OwnSlice),
            ("taught", Taught),
            ("own_step", OwnStep),
        ):
            try:
                step("token", cls)
                result[name] = ""
            except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
                result[name] = f"{type(err).__name__}: {err}"
        test = datasets.Dataset.from_dict(
            {"input_ids": [[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]], "seq_lengths": [[5], [5]]}
        )
        try:
            trainer.predict(test)
            result["predict"] = ""
        except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
            result["predict"] = f"{type(err).__name__}: {err}"
    return result


if __name__ == "__main__":
    run_worker(main)
