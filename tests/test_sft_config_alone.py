"""TRL's SFTTrainer with ``packed_sft_config`` and nothing else (no ``data_collator``, no ``prepare_trainer``).

A user porting a TRL script easily drops both.  The config alone must then train exactly: TRL's own
padding-free collator reads ``seq_lengths``, and the model (plain ``sdpa`` / ``eager``, never switched by
packtools) keeps the packed sequences apart from the restarting ``position_ids``.  Checked against every
sequence run alone (one SGD window at a time, token-weighted), with the opt-out ``padding_free=False`` as the
negative control: TRL's collator then hands the model an all-ones ``attention_mask`` and the sequences see each
other.
"""

import copy

import pytest
from _hf_models import PAD, Recorder, one_by_one_gap, sequences, tiny_llama, word_tokenizer
from test_hf import packed_dataset, train_args

from packtools import PaddingFreeCollator, pack_dataset, prepare_trainer
from packtools.errors import PackingError
from packtools.integrations import packed_sft_config

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

TOL = 1e-5


def labelled_rows():
    """Packed rows with a ``labels`` column (TRL refuses mask columns without labels when preparation is off)."""
    rows = []
    for s in sequences(40, seed=5, masks=True):
        mask = s.pop("completion_mask")
        s["labels"] = [t if m else -100 for t, m in zip(s["input_ids"], mask)]
        rows.append(s)
    return pack_dataset(datasets.Dataset.from_list(rows), 32)


def train_config_alone(tmp_path, impl, model=None, prepare=False, **config):
    model = tiny_llama(impl) if model is None else model
    start = copy.deepcopy(model)
    args = train_args(tmp_path, cls=packed_sft_config, bf16=False, **config)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=labelled_rows(), processing_class=word_tokenizer()
    )
    trainer.data_collator = Recorder(trainer.data_collator)  # TRL's own collator, watched
    if prepare:
        prepare_trainer(trainer)
    trainer.train()
    batches = [[_with_completion_mask(r) for r in batch] for batch in trainer.data_collator.batches]
    return one_by_one_gap(model, start, batches, 2, args.learning_rate)


def _with_completion_mask(row):
    """The reference reads labels through ``completion_mask``; these rows' labels are their tokens or -100."""
    return {
        "input_ids": row["input_ids"],
        "seq_lengths": row["seq_lengths"],
        "completion_mask": [int(lab != -100) for lab in row["labels"]],
    }


@pytest.mark.parametrize(("impl", "checkpointing"), [("sdpa", True), ("eager", True), ("sdpa", False)])
def test_packed_sft_config_alone_trains_like_one_by_one(tmp_path, impl, checkpointing):
    # TRL turns gradient checkpointing on by default (and with it use_cache off); without it the model's
    # default use_cache=True must not merge the sequences either
    off, moved = train_config_alone(tmp_path, impl, gradient_checkpointing=checkpointing)
    assert moved > 1e-2  # it trained
    assert off < TOL


def test_gpt_oss_needs_prepare_trainer(tmp_path):
    """docs/training.md: the config alone is exact only where the masks come from position_ids. GPT-OSS builds
    its masks without them: the config alone trains its packed sequences as one (no error), prepare_trainer
    exactly. (Its MoE load-balancing loss, a statistic of the whole batch, is off to compare with one by one.)"""
    from packtools.testing import tiny_model

    no_aux = dict(router_aux_loss_coef=0.0)
    off, moved = train_config_alone(tmp_path, "eager", model=tiny_model("GPT-OSS", "eager"), **no_aux)
    assert moved > 1e-2 and off > 1e-3
    off, _ = train_config_alone(
        tmp_path, "eager", model=tiny_model("GPT-OSS", "eager"), prepare=True, **no_aux
    )
    assert off < TOL


def test_padding_free_false_without_collator_is_the_contaminated_opt_out(tmp_path):
    # negative control: the explicit opt-out (for passing data_collator=PaddingFreeCollator) without the
    # collator trains the packed rows as one long sequence each
    off, _ = train_config_alone(tmp_path, "sdpa", padding_free=False)
    assert off > 1e-3


def test_padding_free_false_with_packtools_collator_and_prepare(tmp_path):
    args = train_args(tmp_path, cls=packed_sft_config, bf16=False, padding_free=False)
    trainer = trl.SFTTrainer(
        model=tiny_llama(),
        args=args,
        train_dataset=packed_dataset(n=8),
        processing_class=word_tokenizer(),
        data_collator=PaddingFreeCollator(PAD),
    )
    assert prepare_trainer(trainer) is trainer


def test_packed_sft_config_refusals_name_the_argument(tmp_path):
    args = packed_sft_config(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert (args.packing, args.padding_free, args.max_length) == (False, True, None)
    with pytest.raises(PackingError, match="max_length=128") as err:
        packed_sft_config(output_dir=str(tmp_path), max_length=128)
    assert err.value.param == "max_length"
    with pytest.raises(PackingError, match="padding_free='yes'"):
        packed_sft_config(output_dir=str(tmp_path), padding_free="yes")
    kept = packed_sft_config(output_dir=str(tmp_path), use_cpu=True, padding_free=False, max_length=64)
    assert (kept.padding_free, kept.max_length) == (False, 64)
