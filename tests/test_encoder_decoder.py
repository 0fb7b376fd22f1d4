"""Encoder-decoder models refused by name where packtools would compute or shape their loss.

packtools' packed rows are decoder-only: labels laid out for a next-token loss (position ``i`` predicts
``labels[i + 1]``, ``-100`` on each sequence start) and documents told apart by ``position_ids``.  Whisper
(session 45: "its own-loop loss does not shift labels") shifts ``labels`` right into its decoder inputs itself,
scores position ``i`` against ``labels[i]`` and reads ``decoder_position_ids``, not ``position_ids``: a guarded
own loop ran a packed row through it with no error (each document's first token dropped from the loss, the
documents attending each other in the decoder).  ``guard_model`` (which every prepare function calls) and
``token_mean_loss`` (a next-token loss over labels it shifts itself) now refuse an encoder-decoder model."""

from __future__ import annotations

import pytest
from _hf_models import torch, transformers

from packtools import PaddingFreeCollator
from packtools.errors import PackingError
from packtools.integrations.trainers.evaluation import token_mean_loss
from packtools.integrations.trainers.guard import guard_model

datasets = pytest.importorskip("datasets")

ROW = {"input_ids": [5, 6, 7, 8, 9, 10, 11], "seq_lengths": [3, 4]}
SIZES = dict(
    vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
)  # fmt: skip


def whisper():
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        **SIZES, num_mel_bins=8, max_source_positions=16, max_target_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=3,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def bart_config():
    return transformers.BartConfig(**SIZES, max_position_embeddings=64, pad_token_id=0)


def test_guard_model_refuses_an_encoder_decoder_model_by_name():
    """Failed before: guard_model(whisper) hooked it, and a packed row (its decoder positions as
    decoder_position_ids, the audio as input_features) trained with no error."""
    model = whisper().train()
    batch = PaddingFreeCollator(0)([ROW])
    inputs = {
        "input_features": torch.randn(1, 8, 32),
        "labels": batch["labels"],
        "decoder_position_ids": batch["position_ids"],
    }
    assert torch.isfinite(model(**inputs).loss)  # unguarded: it runs, no error (the silent path)
    with pytest.raises(
        PackingError, match=r"guard_model: WhisperForConditionalGeneration is an encoder-decoder"
    ):
        guard_model(model)
    with pytest.raises(PackingError, match=r"BartForConditionalGeneration is an encoder-decoder") as err:
        guard_model(transformers.BartForConditionalGeneration(bart_config()))
    assert err.value.param == "model"
    guard_model(transformers.BartForCausalLM(bart_config()))  # the decoder-only sibling: not this rule's


def test_token_mean_loss_refuses_an_encoder_decoder_model(tmp_path):
    """Failed before: token_mean_loss ran BART without labels (its decoder fed input_ids shifted right) and
    scored the logits as a next-token loss over labels it shifted again: a number, no error."""
    model = transformers.BartForConditionalGeneration(bart_config())
    args = transformers.TrainingArguments(
        str(tmp_path),
        per_device_eval_batch_size=1,
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
    )
    data = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8]], "seq_lengths": [[4]]})
    trainer = transformers.Trainer(model, args, eval_dataset=data, data_collator=PaddingFreeCollator(0))
    with pytest.raises(PackingError, match=r"token_mean_loss: BartForConditionalGeneration is an encoder"):
        token_mean_loss(trainer)
