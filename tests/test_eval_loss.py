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


@pytest.mark.parametrize("split", [False, True])
def test_rows_accelerate_repeats_to_even_out_processes_are_told_from_their_position(split):
    """accelerate's BatchSamplerShard (even_batches, its default) fills the last batches of every process with
    rows from the start; batches_with_first_seen tells them apart: over every process, the rows counted are each
    row of the set exactly once (each batch's counted rows first), for every row count, batch size and process
    count up to 4 (split_batches: the batch size is the global one)."""
    from accelerate.data_loader import BatchSamplerShard

    from packtools.compat.accelerate import batches_with_first_seen

    for rows in range(1, 14):
        for batch in range(1, 5):
            for processes in range(2, 5):
                size = batch * processes if split else batch
                counted = []
                for rank in range(processes):
                    shard = BatchSamplerShard(
                        torch.utils.data.BatchSampler(range(rows), size, False), processes, rank, split
                    )
                    loader = torch.utils.data.DataLoader(range(rows), batch_sampler=shard)
                    dealt = list(batches_with_first_seen(loader))
                    assert [d[0] for d in dealt] == list(shard)
                    counted += [i for indices, first in dealt for i in indices[:first]]
                assert sorted(counted) == list(range(rows)), (rows, batch, processes)
    one = torch.utils.data.DataLoader(range(3), batch_sampler=BatchSamplerShard(
        torch.utils.data.BatchSampler(range(3), 2, False), 1, 0))  # fmt: skip
    assert batches_with_first_seen(one) is None


def test_an_evaluation_order_that_changes_between_iterations_is_refused():
    """token_mean_loss finds a batch's repeated rows by iterating accelerate's shard again: a random evaluation
    sampler would give other rows, and is refused by name instead of miscounted."""
    from accelerate.data_loader import BatchSamplerShard

    from packtools.compat.accelerate import batches_with_first_seen
    from packtools.errors import PackingError
    from packtools.integrations.trainers.evaluation import CHANGED, _first_seen, order_changed

    rows = [{"input_ids": [i + 1, i + 2, i + 3]} for i in range(0, 50, 5)]
    sampler = torch.utils.data.RandomSampler(rows, generator=torch.Generator().manual_seed(0))
    shard = BatchSamplerShard(torch.utils.data.BatchSampler(sampler, 4, False), 2, 0)
    loader = torch.utils.data.DataLoader(
        rows, batch_sampler=shard, collate_fn=PaddingFreeCollator(PAD, unpacked=True)
    )
    last = list(loader)[-1]  # 10 rows, 2 processes of 4: process 0 has 2 rows and 2 repeats last
    dealt = list(batches_with_first_seen(loader))[-1]
    assert dealt[1] == 2 and len(dealt[0]) == 4
    assert _first_seen(loader, last, dealt) is CHANGED  # refused after the loop, on every process at once
    refusal = order_changed(loader)
    assert isinstance(refusal, PackingError) and "another order when iterated again (RandomSampler)" in str(
        refusal
    )
