"""The token counts a trainer logs on packed rows equal those of the same tokens unpacked.

TRL's ``SFTTrainer`` logs ``num_tokens`` from ``position_ids.size(1)`` when a batch has no ``attention_mask`` (its
own flat padding-free row ``[1, T]``); packtools' ``[B, T]`` rows (``PaddingFreeCollator(padding_free=False)``)
hold ``B x T`` positions, of which it counted one row's width.  Rows here are all ``T`` long (no padding), so
every layout must log exactly the dataset's tokens, as TRL's own padding-free collator does.

``include_num_input_tokens_seen="non_padding"`` counts ``input_ids != pad_token_id`` on packed batches (no
``attention_mask``): exact where no real token is the pad id, short by every one that is (an EOS used as pad),
which ``prepare_trainer`` says with the count.
"""

from __future__ import annotations

import pytest
from _hf_models import PAD, tiny_llama, torch, transformers, word_tokenizer

from packtools import PaddingFreeCollator, prepare_trainer

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

ROWS = {  # four packed rows of 12 tokens each, several sequences per row
    "input_ids": [[3 + (5 * r + j) % 90 for j in range(12)] for r in range(4)],
    "seq_lengths": [[5, 7], [12], [3, 4, 5], [6, 6]],
}


def logged_num_tokens(tmp_path, collator):
    from packtools.integrations import packed_sft_config

    rows = datasets.Dataset.from_dict({**ROWS, "labels": ROWS["input_ids"]})
    extra = {} if collator is None else {"padding_free": False}
    args = packed_sft_config(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        logging_steps=1,
        bf16=False,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        **extra,
    )
    trainer = trl.SFTTrainer(
        tiny_llama("sdpa"),
        args=args,
        train_dataset=rows,
        processing_class=word_tokenizer(),
        data_collator=collator,
    )
    prepare_trainer(trainer).train()
    return [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]


@pytest.mark.parametrize(
    "collator",
    [
        None,  # TRL's own padding-free collator (reads seq_lengths): the reference layout
        PaddingFreeCollator(PAD),  # one flat row per batch
        PaddingFreeCollator(
            PAD, padding_free=False, attn_implementation="sdpa"
        ),  # [B, T]: was one row's width
    ],
    ids=["trl-collator", "flat", "rows"],
)
def test_sft_trainer_logs_every_token_of_packed_rows(tmp_path, collator):
    torch.manual_seed(0)
    assert logged_num_tokens(tmp_path, collator) == [24.0, 48.0]  # 2 rows of 12 per step


def test_non_padding_token_count_warns_when_real_tokens_equal_the_pad_id(tmp_path):
    """``include_num_input_tokens_seen="non_padding"``: on packed rows (no ``attention_mask``) transformers counts
    ``input_ids != pad_token_id``; documents ending with an EOS that is also the pad id lose one token each from
    the count, with no error on main.  prepare_trainer says so, naming the count."""
    from _hf_models import plain_sgd_options

    from packtools import pack_dataset

    docs = [[3 + (7 * i + j) % 90 for j in range(n)] + [PAD] for i, n in enumerate([3, 5, 7, 2, 9, 4])]
    packed = pack_dataset(datasets.Dataset.from_dict({"input_ids": docs}), max_length=16)
    args = transformers.TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=2,
        num_train_epochs=1,
        include_num_input_tokens_seen="non_padding",
        **plain_sgd_options(),
    )
    trainer = transformers.Trainer(
        tiny_llama("sdpa"),
        args,
        train_dataset=packed,
        data_collator=PaddingFreeCollator(PAD),
        processing_class=word_tokenizer(),
    )
    with pytest.warns(UserWarning, match=r"non_padding.* 6 tokens of the training rows equal it"):
        prepare_trainer(trainer)
    trainer.train()
    assert trainer.state.num_input_tokens_seen == sum(map(len, docs)) - 6  # the count the warning announced


def test_non_padding_token_count_is_quiet_when_no_real_token_is_the_pad_id(tmp_path, recwarn):
    from _hf_models import plain_sgd_options

    from packtools import pack_dataset

    docs = [[3 + (7 * i + j) % 90 for j in range(n)] for i, n in enumerate([3, 5, 7, 2, 9, 4])]
    packed = pack_dataset(datasets.Dataset.from_dict({"input_ids": docs}), max_length=16)
    args = transformers.TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=2,
        num_train_epochs=1,
        include_num_input_tokens_seen="non_padding",
        **plain_sgd_options(),
    )
    trainer = transformers.Trainer(
        tiny_llama("sdpa"),
        args,
        train_dataset=packed,
        data_collator=PaddingFreeCollator(PAD, pad_to_multiple_of=8),
        processing_class=word_tokenizer(),
    )
    prepare_trainer(trainer).train()
    assert not [w for w in recwarn if "non_padding" in str(w.message)]
    assert trainer.state.num_input_tokens_seen == sum(
        map(len, docs)
    )  # exact: the collator's padding left out


@pytest.mark.slow
def test_two_processes_with_and_without_an_attention_mask_count_every_token(tmp_path):
    """2 processes (torchrun, gloo), one row each per step: a single-sequence row's batch carries an
    ``attention_mask``, a packed row's none.  The step owner's count ran its gather only on processes whose batch
    had no mask, so at the first step where the two differed the other process never joined it: the run hung
    (killed at the timeout on main).  Every rank logs the tokens of both ranks' rows, 24 per step."""
    import _launch

    # on a hang torchrun gets SIGTERM at the timeout (it forwards it to its workers, which run in sessions of their
    # own); the output goes to files, which no leftover process can keep the test waiting on
    try:
        _launch.torchrun(
            2, "_logged_tokens_worker.py", str(tmp_path), log=tmp_path / "torchrun.log", timeout=240
        )
    except AssertionError as err:
        if "timed out" in str(err).splitlines()[0]:
            pytest.fail("2 processes hung in the logged token count (a gather on some processes only)")
        raise
    logged = torch.load(tmp_path / "tokens.pt")
    assert logged == [[24.0, 48.0, 72.0, 96.0]] * 2
