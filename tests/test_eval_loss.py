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


def test_predictions_of_merged_padding_free_rows_are_refused_and_one_row_a_batch_is_per_example(tmp_path):
    """PaddingFreeCollator joins a batch's rows into one flat row, so predict() (and evaluate() with
    compute_metrics) returned one row per batch, not per example (5 rows at batch 2: 3 prediction rows; with
    several processes accelerate's even-out batch was kept as a row): refused by name; at batch 1 the
    predictions are per example, in order (each row's labels and logits as the row run alone)."""
    from packtools.errors import PackingError

    packed = pack_dataset(datasets.Dataset.from_list(sequences(n=20, seed=3, max_len=14)), 24, "bfd").select(
        range(5)
    )
    collator = PaddingFreeCollator(PAD)

    def trainer(batch, **kw):
        args = transformers.TrainingArguments(
            str(tmp_path), per_device_eval_batch_size=batch, report_to=[], use_cpu=True, disable_tqdm=True
        )
        built = transformers.Trainer(
            tiny_llama("sdpa"), args, train_dataset=packed, eval_dataset=packed, data_collator=collator, **kw
        )
        return prepare_trainer(built)

    with pytest.raises(
        PackingError, match=r"per_device_eval_batch_size=2.*one row per batch, not per example"
    ):
        trainer(2).predict(packed)
    with pytest.raises(PackingError, match=r"per_device_eval_batch_size=2"):
        trainer(2, compute_metrics=lambda p: {}).evaluate()
    assert "eval_loss" in trainer(2).evaluate()  # the loss alone is no prediction: it runs

    one = trainer(1)
    out = one.predict(packed)
    assert out.predictions.shape[0] == out.label_ids.shape[0] == len(packed)
    for i, row in enumerate(packed):
        batch = one.data_collator([row])
        with torch.no_grad():
            logits = one.model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        n = batch["labels"].shape[1]
        assert out.label_ids[i, :n].tolist() == batch["labels"][0].tolist()
        assert (out.label_ids[i, n:] == -100).all()
        assert torch.allclose(torch.from_numpy(out.predictions[i, :n]), logits, atol=1e-5)
