"""Every column reaches the model or stops the run (adversarial-2026-12b, newcomer-2026-12b 3; review F10):
``PaddingFreeCollator`` refuses a column it does not carry unless told to leave it out, refuses packed ``[B, T]``
rows unless the attention backend builds the block mask from ``position_ids``, ``pack_dataset`` names image
columns it cannot pack, and multimodal models are refused by name."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from packtools import PackingError, PaddingFreeCollator
from packtools.core import pack_table

ROWS = [
    {
        "input_ids": [1, 2, 3, 4, 5],
        "seq_lengths": [2, 3],
        "pixel_values": [[0.5, 0.25]],
        "image_grid_thw": [[1, 2, 2]],
    },
    {"input_ids": [6, 7], "seq_lengths": [2], "pixel_values": [[0.0, 1.0]], "image_grid_thw": [[1, 2, 2]]},
]


def test_a_column_the_batch_does_not_carry_is_refused_by_name():
    """Image columns are refused whatever leave_out says: PaddingFreeCollator(leave_out=['pixel_values',
    'image_grid_thw']) made the text batch with each image's placeholder tokens and no pixels, no error (and its
    error for the rows advised that leave_out). Another column is left out when leave_out lists it."""
    collator = PaddingFreeCollator(0, return_tensors="np")
    image_error = (
        r"image column\(s\) \['image_grid_thw', 'pixel_values'\].*MultimodalCollator.*placeholder tokens"
    )
    for leave_out in ((), ["pixel_values", "image_grid_thw"]):
        with pytest.raises(PackingError, match=image_error) as err:
            collator.replace(leave_out=leave_out)(ROWS)
        assert err.value.param == "leave_out" and "leave_out=[" not in str(err.value)
    # another column, told to leave it out: the batch is the one of the rows without it
    rows = [
        {"input_ids": r["input_ids"], "seq_lengths": r["seq_lengths"], "id": i} for i, r in enumerate(ROWS)
    ]
    with pytest.raises(PackingError, match=r"\['id'\].*leave_out=\['id'\]"):
        collator(rows)
    told = PaddingFreeCollator(0, return_tensors="np", leave_out=["id"])(rows)
    plain = collator([{k: r[k] for k in ("input_ids", "seq_lengths")} for r in ROWS])
    assert set(told) == set(plain) and all(np.array_equal(told[k], plain[k]) for k in told)
    with pytest.raises(PackingError, match="leave_out must be a list"):
        PaddingFreeCollator(0, leave_out="pixel_values")


def test_leave_out_survives_replace_and_options():
    c = PaddingFreeCollator(0, leave_out=["id"], padding_free=False, attn_implementation="eager")
    assert c.replace(return_seq_idx=False).leave_out == frozenset({"id"})
    assert c.replace().attn_implementation == "eager"


PACKED = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}, {"input_ids": [6, 7], "seq_lengths": [2]}]


@pytest.mark.parametrize(
    "backend", [None, "flash_attention_2", "flash_attention_3", "kernels-community/flash-attn"]
)
def test_padded_packed_rows_need_a_backend_that_masks_from_positions(backend):
    collator = PaddingFreeCollator(0, padding_free=False, attn_implementation=backend, return_tensors="np")
    with pytest.raises(PackingError, match=r"padding_free=True.*attn_implementation='sdpa'") as err:
        collator(PACKED)
    assert err.value.param == "attn_implementation"


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex_attention"])
def test_padded_packed_rows_on_a_masking_backend(backend):
    b = PaddingFreeCollator(0, padding_free=False, attn_implementation=backend, return_tensors="np")(PACKED)
    assert b["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 0, 1, 2]] and "attention_mask" not in b


def test_padded_batches_that_cannot_leak_need_no_backend():
    collator = PaddingFreeCollator(0, padding_free=False, return_tensors="np")
    one_row = collator(PACKED[:1])  # one row: FlashAttention infers the sequences from position_ids too
    assert one_row["position_ids"].tolist() == [[0, 1, 0, 1, 2]]
    unpacked = collator(
        [{"input_ids": [1, 2, 3], "seq_lengths": [3]}, {"input_ids": [4], "seq_lengths": [1]}]
    )
    assert unpacked["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_pack_table_names_an_image_column_it_cannot_pack():
    """An image column is refused whatever columns= says (named token columns left it out with no error, its
    placeholder tokens kept without pixels); another column of nested lists is named, and columns=[...] leaves it
    out knowingly."""
    table = pa.table({"input_ids": [[1, 2, 3], [4, 5]], "pixel_values": [[[0.5, 0.25]], [[0.0, 1.0]]]})
    for columns in (None, ["input_ids"]):
        with pytest.raises(PackingError, match=r"\['pixel_values'\].*placeholder tokens.*pack_dataset"):
            pack_table(table, 8, columns=columns)
    table = table.rename_columns(["input_ids", "audio_features"])
    with pytest.raises(PackingError, match=r"'audio_features'.*not one value per token.*never sees it"):
        pack_table(table, 8)
    assert pack_table(table, 8, columns=["input_ids"]).column_names == ["input_ids", "seq_lengths"]


@pytest.fixture(scope="module")
def tiny_qwen2_vl():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from packtools.testing import tiny_vl_model

    return tiny_vl_model("qwen2_vl")


def test_multimodal_models_are_refused_by_name(tiny_qwen2_vl, monkeypatch):
    from packtools.batches import mrope
    from packtools.integrations.attention import backends

    # a verified type passes this check (prepare_trainer then requires its MultimodalCollator) ...
    backends.check_attention_implementation(tiny_qwen2_vl)
    # ... an unverified one is refused by name: the one list is packtools.batches.mrope.VERIFIED_MODEL_TYPES
    monkeypatch.setattr(mrope, "VERIFIED_MODEL_TYPES", ("qwen3_vl",))
    with pytest.raises(
        PackingError, match=r"Qwen2VLForConditionalGeneration \(model_type 'qwen2_vl'\) is a multimodal"
    ) as err:
        backends.check_attention_implementation(tiny_qwen2_vl)
    assert "instead of 'sdpa'" not in str(err.value) and "vision_config" in str(err.value)
    assert "['qwen3_vl']" in str(err.value)


def test_the_isolation_hint_never_names_the_backend_in_use():
    from packtools.integrations.attention.isolation import fix_hint as _fix_hint

    for impl in ("sdpa", "eager", "flash_attention_2"):
        hint = _fix_hint(["input_ids", "position_ids", "cu_seq_lens_q"], (), impl)
        assert f"instead of {impl!r}" not in hint and "something else in the model" in hint
    assert "instead of 'paged|eager'" in _fix_hint(["position_ids"], (), "paged|eager")


def test_prepare_trainer_names_the_models_backend_to_a_padded_collator():
    from _hf_models import tiny_llama

    from packtools.integrations.attention.backends import adapt_collator

    adapted = adapt_collator(PaddingFreeCollator(0, padding_free=False), tiny_llama("eager"))
    assert adapted.attn_implementation == "eager"
    assert adapted(PACKED)["input_ids"].shape == (2, 5)  # exact on eager: not refused
