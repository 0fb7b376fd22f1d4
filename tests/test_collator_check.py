"""prepare_trainer / prepare_dpo_trainer check the trainer's REAL collator on a real batch of its own dataset.

Other people's collators (transformers' DataCollatorForLanguageModeling and DataCollatorWithFlattening, TRL's
SFT collator with padding_free=False) train packed rows as one long sequence with no error; each is refused
here with the fix, and its negative control (check_isolation=False, the old behaviour) trains one SGD step
measurably away from the sequences run one by one.  Collators that keep sequences apart -- PaddingFreeCollator,
TRL's padding-free collator, a padding collator on unpacked rows -- are accepted, judged by their batch, and train
within 1e-5 of one by one.
"""

import copy

import numpy as np
import pytest
from _hf_models import (
    PAD,
    VOCAB,
    Recorder,
    one_by_one_gap,
    sequences,
    tiny_llama,
    torch,
    transformers,
    word_tokenizer,
)
from test_hf import LR, train_args

from packtools import PaddingFreeCollator, pack_dataset, prepare_trainer
from packtools.errors import PackingError
from packtools.integrations import packed_sft_config, unprepare
from packtools.integrations.trainers.collator_check import batch_problems, in_check

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

TOL = 1e-5


def packed_rows():
    """16 sequences of 8 tokens packed 4 to a row: equal seq_lengths, which even tokenizer.pad can batch."""
    rng = np.random.default_rng(3)
    rows = [{"input_ids": rng.integers(1, VOCAB, 8).tolist()} for _ in range(16)]
    return pack_dataset(datasets.Dataset.from_list(rows), 32)


def step_args(tmp_path, cls=None, **overrides):
    return train_args(tmp_path, cls=cls, gradient_accumulation_steps=1, max_steps=1, **overrides)


def build(case, model, tmp_path, dataset):
    tok = word_tokenizer()
    if case == "DataCollatorForLanguageModeling":
        collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
        return transformers.Trainer(
            model=model, args=step_args(tmp_path), train_dataset=dataset, data_collator=collator
        )
    if case == "DataCollatorWithFlattening":
        collator = transformers.DataCollatorWithFlattening()
        return transformers.Trainer(
            model=model, args=step_args(tmp_path), train_dataset=dataset, data_collator=collator
        )
    if case == "SFTTrainer default collator":  # padding_free=False is the opt-out for passing our collator
        args = step_args(tmp_path, cls=packed_sft_config, bf16=False, padding_free=False)
        return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok)
    if case == "PaddingFreeCollator":
        collator = PaddingFreeCollator(PAD)
        return transformers.Trainer(
            model=model, args=step_args(tmp_path), train_dataset=dataset, data_collator=collator
        )
    if case == "TRL padding-free collator":  # TRL's own, reading seq_lengths: correct, so accepted
        args = step_args(
            tmp_path,
            cls=trl.SFTConfig,
            bf16=False,
            padding_free=True,
            max_length=None,
            dataset_kwargs={"skip_prepare_dataset": True},
        )
        return trl.SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok)
    if case == "padding collator, unpacked rows":
        collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
        return transformers.Trainer(
            model=model, args=step_args(tmp_path), train_dataset=dataset, data_collator=collator
        )
    raise AssertionError(case)


def one_step(case, tmp_path, check, dataset=None):
    """One SGD step through Trainer + prepare_trainer; returns (trained - one-by-one, trained - start)."""
    model = tiny_llama("sdpa")
    start = copy.deepcopy(model)
    trainer = build(case, model, tmp_path, packed_rows() if dataset is None else dataset)
    recorder = Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    prepare_trainer(trainer, check_isolation=check)
    trainer.train()
    assert trainer.state.global_step == 1
    # The loader reads one batch ahead: only the first one was trained on.
    assert all("seq_lengths" in row for row in recorder.batches[0]) or dataset is not None
    return one_by_one_gap(model, start, recorder.batches[:1], 1, LR)


REFUSED = {
    "DataCollatorForLanguageModeling": r"2-D attention_mask over batch row 0, which holds 4 sequences",
    "DataCollatorWithFlattening": r"position_ids for sequence 1 .* not 0, 1, 2",
    "SFTTrainer default collator": r"TRL's own.*2-D attention_mask over batch row 0",
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_collators_that_merge_packed_sequences_are_refused(tmp_path, case):
    trainer = build(case, tiny_llama("sdpa"), tmp_path, packed_rows())
    with pytest.raises(PackingError, match=REFUSED[case]) as err:
        prepare_trainer(trainer)
    assert "data_collator=packtools.PaddingFreeCollator(0)" in str(err.value)
    if case == "DataCollatorForLanguageModeling":  # its batches carry seq_lengths to the model: the guard too
        seq_lengths_reach_the_model_and_are_refused(tmp_path)
        return
    # Negative control: without the check (the old behaviour) the same trainer trains, with no error, away
    # from the sequences run one by one.
    off, moved = one_step(case, tmp_path, check=False)
    assert off > 1e-3 and moved > 1e-2, (off, moved)


def seq_lengths_reach_the_model_and_are_refused(tmp_path):
    """DataCollatorForLanguageModeling passes seq_lengths through with an all-ones attention_mask: without the
    collator check the guard still refuses the first step (it trained on with no error before), and the model
    unguarded runs each row as one sequence (negative control: a later document's logits are not its own)."""
    with pytest.raises(PackingError, match="carries seq_lengths.*PaddingFreeCollator"):
        one_step("DataCollatorForLanguageModeling", tmp_path, check=False)
    row = packed_rows()[0]
    batch = transformers.DataCollatorForLanguageModeling(word_tokenizer(), mlm=False)([row])
    assert "seq_lengths" in batch and "position_ids" not in batch
    model = tiny_llama("sdpa").eval()
    first = int(row["seq_lengths"][0])
    with torch.no_grad():
        merged = model(**batch).logits[0, first:]
        alone = model(input_ids=batch["input_ids"][:, first:]).logits[0]
    assert (merged[: alone.shape[0]] - alone).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["PaddingFreeCollator", "TRL padding-free collator"])
def test_collators_that_keep_sequences_apart_are_accepted_and_exact(tmp_path, case):
    off, moved = one_step(case, tmp_path, check=True)
    assert off < TOL and moved > 1e-2, (off, moved)


def test_padding_collator_on_unpacked_rows_is_not_a_false_alarm(tmp_path):
    """Rows without seq_lengths are one sequence each: a padded batch with its attention_mask is right."""
    unpacked = datasets.Dataset.from_list(sequences(12, seed=2, masks=False))
    off, moved = one_step("padding collator, unpacked rows", tmp_path, check=True, dataset=unpacked)
    assert off < TOL and moved > 1e-2, (off, moved)


def test_the_probe_runs_through_the_trainers_collator(tmp_path):
    calls = []
    inner = PaddingFreeCollator(PAD)

    def collator(features):
        calls.append((in_check(), sorted(features[0])))
        return inner(features)

    trainer = transformers.Trainer(
        model=tiny_llama("sdpa"),
        args=step_args(tmp_path),
        train_dataset=packed_rows(),
        data_collator=collator,
    )
    prepare_trainer(trainer)
    # One real batch of the dataset, then the probe's packed batch and its perturbed copy; none counted as
    # training, all with the keys the trainer's rows carry.
    assert [c[0] for c in calls] == [True, True, True]
    assert all(keys == ["input_ids", "seq_lengths"] for _, keys in calls)
    calls.clear()
    unprepare(trainer)  # a prepared trainer is refused a second preparation by name
    prepare_trainer(trainer, check_isolation=False)
    assert calls == []


def batch_of(rows, **options):
    return PaddingFreeCollator(PAD, return_tensors="np", **options)(rows)


def test_batch_problems_names_each_way_a_batch_can_merge_sequences():
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [2, 3]},
        {"input_ids": [3, 4, 5], "seq_lengths": [3]},
    ]
    tokens, lengths = [r["input_ids"] for r in rows], [r["seq_lengths"] for r in rows]
    good = batch_of(rows)
    assert batch_problems(good, tokens, lengths) == []  # negative control: the intact batch passes
    assert (
        batch_problems(batch_of(rows, padding_free=False, attn_implementation="sdpa"), tokens, lengths) == []
    )
    assert batch_problems(batch_of(rows, pad_to_multiple_of=4), tokens, lengths) == []
    assert batch_problems(batch_of(rows, pad_to_buckets=(16,), pad_cu_seq_lens_to=9), tokens, lengths) == []

    def broken(**changes):
        return batch_problems({**good, **changes}, tokens, lengths)

    per_row = np.array([[0, 1, 2, 3, 4, 0, 1, 2]])
    labels = good["labels"].copy()
    labels[0, 2] = 7
    assert "2-D attention_mask" in broken(attention_mask=np.ones((1, 8)))[0]
    assert "not 0, 1, 2" in broken(position_ids=per_row)[0]
    assert "not -100 at the first token" in broken(labels=labels)[0]
    assert "do not mark the sequences' boundaries" in broken(cu_seq_lens_q=np.array([0, 5, 8], np.int32))[0]
    assert "below the longest" in broken(max_length_k=2)[0]
    assert "seq_idx" in broken(seq_idx=np.zeros((1, 8), np.int32))[0]
    assert "merges, cuts or reorders" in broken(input_ids=good["input_ids"][:, :7])[0]
    no_positions = {k: v for k, v in good.items() if k not in ("position_ids", "cu_seq_lens_q")}
    assert "no position_ids" in batch_problems(no_positions, tokens, lengths)[0]
    padded = batch_of(rows, padding_free=False, attn_implementation="sdpa")
    padded["labels"][1, 4] = 1
    assert "-100 on padding" in batch_problems(padded, tokens, lengths)[0]


def test_a_collator_that_fails_on_the_trainers_rows_is_named(tmp_path):
    """tokenizer.pad cannot batch ragged seq_lengths: refused before training, naming the collator."""
    ragged = pack_dataset(datasets.Dataset.from_list(sequences(30, seed=5, masks=False)), 32)
    collator = transformers.DataCollatorForLanguageModeling(word_tokenizer(), mlm=False)
    trainer = transformers.Trainer(
        model=tiny_llama("sdpa"), args=step_args(tmp_path), train_dataset=ragged, data_collator=collator
    )
    with pytest.raises(PackingError, match=r"DataCollatorForLanguageModeling failed on 2 rows"):
        prepare_trainer(trainer)


def test_dpo_collator_that_merges_pairs_is_refused(tmp_path):
    from test_dpo import build as build_dpo

    from packtools import prepare_dpo_trainer

    trainer = build_dpo(tmp_path, n=6)
    tokens = trainer.train_dataset[0]
    assert {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(tokens)
    own = trainer.data_collator

    def merge_previous_pair(features):
        """Puts the previous pair's prompt and chosen answer in front of each prompt: one row, two pairs."""
        out, previous = [], []
        for f in features:
            out.append({**f, "prompt_ids": previous + list(f["prompt_ids"])})
            previous = list(f["prompt_ids"]) + list(f["chosen_ids"])
        return own(out)

    trainer.data_collator = merge_previous_pair
    with pytest.raises(PackingError, match=r"row 1 does not hold pair 1's prompt \+ chosen tokens alone"):
        prepare_dpo_trainer(trainer)
    # Negative control: unchecked, the merged batch runs through the padding-free forward without a word.
    prepare_dpo_trainer(trainer, check_isolation=False)
    batch = merge_previous_pair([trainer.train_dataset[i] for i in range(2)])
    assert torch.isfinite(trainer.compute_loss(trainer.model, batch))
    # TRL's own collator passes the same check: every prepare_dpo_trainer in tests/test_dpo.py runs it.


def test_in_check_is_the_checking_threads_own_and_restored_after_a_nested_check():
    """The flag belongs to the thread running a check: a collator another thread calls meanwhile (a training
    batch) reads False; a nested check leaves the outer one's flag set, and the end of the outer one clears it."""
    import threading

    from packtools.integrations.trainers.collator_check import _checking

    seen = []
    with _checking():
        with _checking():
            pass
        seen.append(in_check())
        other = threading.Thread(target=lambda: seen.append(in_check()))
        other.start()
        other.join()
    seen.append(in_check())
    assert seen == [True, False, False]
