"""Contract item 6 on a real model: a packed padding-free batch trains exactly like its sequences one by one.

Tiny random ``LlamaForCausalLM`` on CPU in fp32, ``sdpa`` and ``eager``: the loss and every parameter gradient
of a packed batch equal those of the same sequences run alone (batch 1, no padding), token-weighted, within
1e-5.  A negative control shows the comparison is sharp enough to see cross-sequence attention.
"""

import numpy as np
import pyarrow as pa
import pytest
from _hf_models import (
    grads,
    max_diff,
    one_by_one_backward,
    predicted,
    sequences,
    split_rows,
    tiny_llama,
    torch,
)

from packtools import pack_table
from packtools.batches.collate import PaddingFreeCollator
from packtools.integrations.trainers.guard import guard_model

TOL = 1e-5
IMPLS = ["sdpa", "eager"]


def packed_rows(seqs, max_length=32, strategy="bfd"):
    table = pa.table({k: [s[k] for s in seqs] for k in ("input_ids", "completion_mask")})
    return pack_table(table, max_length, strategy).to_pylist()


def packed_step(model, rows, num_items=None, **collator_kwargs):
    batch = PaddingFreeCollator(0, **collator_kwargs)(rows)
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    out = model(**batch, **extra)
    out.loss.backward()
    return out.loss.item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
def test_packed_batch_equals_one_by_one(impl, pad_to_multiple_of):
    seqs = sequences(12, seed=1)
    rows = packed_rows(seqs)
    assert any(len(r["seq_lengths"]) > 1 for r in rows)
    model = tiny_llama(impl)
    # The model's default mean over the packed batch is the token-weighted mean over all sequences.
    loss_packed = packed_step(model, rows, pad_to_multiple_of=pad_to_multiple_of)
    g_packed = grads(model)
    model.zero_grad()
    unpacked = split_rows(rows)
    loss_ref = one_by_one_backward(model, unpacked, predicted(unpacked))
    assert abs(loss_packed - loss_ref) < TOL
    assert max_diff(g_packed, grads(model)) < TOL
    assert len(g_packed) == len(list(model.parameters()))


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_mode_rows_equal_one_by_one(impl):
    """PaddingFreeCollator(padding_free=False): [B, T] packed rows, no attention_mask, positions restart."""
    seqs = sequences(10, seed=2)
    rows = packed_rows(seqs, max_length=24)
    model = tiny_llama(impl)
    batch = PaddingFreeCollator(0, padding_free=False, attn_implementation=impl)(rows)
    assert batch["input_ids"].shape[0] == len(rows) and "attention_mask" not in batch
    out = model(**batch)
    out.loss.backward()
    g_packed = grads(model)
    model.zero_grad()
    unpacked = split_rows(rows)
    loss_ref = one_by_one_backward(model, unpacked, predicted(unpacked))
    assert abs(out.loss.item() - loss_ref) < TOL
    assert max_diff(g_packed, grads(model)) < TOL


def test_accumulation_window_is_token_weighted():
    """Two packed micro-batches, each loss divided by the window's predicted tokens, sum to the one-by-one loss."""
    seqs = sequences(16, seed=3)
    rows = packed_rows(seqs, max_length=24)
    first, second = rows[:-1], rows[-1:]  # BFD puts the emptiest row last: unequal token counts
    unpacked = split_rows(rows)
    n = predicted(unpacked)
    # The count the Trainer makes: labels[..., 1:] != -100 over every micro-batch of the window.
    count = sum(int((PaddingFreeCollator(0)(b)["labels"][:, 1:] != -100).sum()) for b in (first, second))
    assert count == n
    model = tiny_llama("sdpa")
    loss = packed_step(model, first, n) + packed_step(model, second, n)
    g_packed = grads(model)
    model.zero_grad()
    loss_ref = one_by_one_backward(model, unpacked, n)
    assert abs(loss - loss_ref) < TOL
    assert max_diff(g_packed, grads(model)) < TOL
    # Averaging the two per-batch means instead weighs tokens of the smaller batch more: visibly different.
    model.zero_grad()
    for half in (first, second):
        batch = PaddingFreeCollator(0)(half)
        (model(**batch).loss / 2).backward()
    assert max_diff(g_packed, grads(model)) > 10 * TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_comparison_detects_cross_sequence_attention(impl):
    """Negative control: an all-ones attention_mask (or a KV cache) lets tokens attend across sequences."""
    rows = packed_rows(sequences(12, seed=1))
    unpacked = split_rows(rows)
    model = tiny_llama(impl)
    one_by_one_backward(model, unpacked, predicted(unpacked))
    g_ref = grads(model)
    batch = PaddingFreeCollator(0)(rows)
    assert batch["use_cache"] is False
    for extra in ({"attention_mask": torch.ones_like(batch["input_ids"])}, {"use_cache": True}):
        model.zero_grad()
        model(**{**batch, **extra}).loss.backward()  # a cache: no packed-sequence detection
        assert max_diff(g_ref, grads(model)) > 1e-3
    # Without the batch's use_cache=False the config's use_cache=True applies: attention crosses sequences.
    plain = PaddingFreeCollator(0, return_use_cache=False)(rows)
    assert "use_cache" not in plain and model.config.use_cache
    model.zero_grad()
    model(**plain).loss.backward()
    assert max_diff(g_ref, grads(model)) > 1e-3
    # The batch as the collator gives it is right without anything else, and so is the other one guarded.
    for given in (batch, plain):
        model.zero_grad()
        model(**given).loss.backward()
        assert max_diff(g_ref, grads(model)) < TOL
        guard_model(model)


def test_bfd_split_chunks_train_as_separate_sequences():
    """A sequence longer than max_length, split by bfd_split, trains like its chunks run one by one."""
    rng = np.random.default_rng(4)
    seqs = [
        {"input_ids": rng.integers(1, 97, n).tolist(), "completion_mask": [1] * n} for n in (40, 7, 3, 19)
    ]
    rows = packed_rows(seqs, max_length=16, strategy="bfd_split")
    unpacked = split_rows(rows)
    assert sum(len(s["input_ids"]) for s in unpacked) == 69
    model = tiny_llama("sdpa")
    packed_step(model, rows)
    g_packed = grads(model)
    model.zero_grad()
    one_by_one_backward(model, unpacked, predicted(unpacked))
    assert max_diff(g_packed, grads(model)) < TOL
