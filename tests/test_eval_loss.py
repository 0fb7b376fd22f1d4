"""Evaluation as exact as training: ``token_mean_loss`` is the token mean of the sequences run one by one, and
``Trainer.evaluate()``'s ``eval_loss`` (a mean of per-batch means) is not (the documented difference)."""

from __future__ import annotations

import pytest
from _hf_models import PAD, predicted, seq_labels, sequences, split_rows, tiny_llama, torch, transformers

from packtools import pack_dataset
from packtools.batches.collate import PaddingFreeCollator
from packtools.integrations import prepare_trainer
from packtools.integrations.trainers.evaluation import token_mean_loss

datasets = pytest.importorskip("datasets")


def one_by_one_mean(model, seqs):
    total = 0.0
    with torch.no_grad():
        for s in seqs:
            out = model(
                input_ids=torch.tensor([s["input_ids"]]),
                labels=torch.tensor([seq_labels(s)]),
                use_cache=False,
            )
            n = sum(1 for lab in seq_labels(s)[1:] if lab != -100)
            total += out.loss.item() * n if n else 0.0
    return total / predicted(seqs)


def test_token_mean_loss_equals_the_sequences_one_by_one(tmp_path):
    seqs = sequences(n=40, seed=7, max_len=30)
    ds = datasets.Dataset.from_list(seqs)
    packed = pack_dataset(ds, 48, "bfd")
    model = tiny_llama("sdpa")
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_eval_batch_size=3, report_to=[], use_cpu=True, disable_tqdm=True
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=packed,
        eval_dataset=packed,
        data_collator=PaddingFreeCollator(PAD),
    )
    prepare_trainer(trainer)
    want = one_by_one_mean(model, split_rows(packed.to_list()))
    got = token_mean_loss(trainer)
    assert abs(got - want) < 1e-5
    # the documented difference: transformers averages the batches' means
    reported = trainer.evaluate()["eval_loss"]
    assert abs(reported - want) > 1e-5
