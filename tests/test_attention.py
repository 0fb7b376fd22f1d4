"""varlen_attention: the PyTorch reference against dense masked attention (forward and backward), input
validation, and the flash-attn branch's argument plumbing (with a fake flash_attn module)."""

from __future__ import annotations

import math
import sys
import types

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from packtools import PackingError  # noqa: E402
from packtools.batches.attention import varlen_attention  # noqa: E402
from packtools.batches.collate import PaddingFreeCollator  # noqa: E402


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def dense_attention(q, k, v, lq, lk, causal, scale):
    """Plain softmax attention over all tokens with an explicit block-diagonal (and causal) mask."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    tq, tk = q.shape[0], k.shape[0]
    allowed = torch.zeros(tq, tk, dtype=torch.bool)
    qs = ks = 0
    for a, b in zip(lq, lk):
        for i in range(a):
            for j in range(b):
                allowed[qs + i, ks + j] = (not causal) or j <= i + (b - a)
        qs += a
        ks += b
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # rows that see no key
    return torch.einsum("hqk,khd->qhd", weights, v)


heads = st.sampled_from([(2, 2), (4, 2), (4, 1), (3, 1)])


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    hq_hk=heads,
    causal=st.booleans(),
    head_dim=st.sampled_from([4, 8]),
    scale=st.sampled_from([None, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_dense_forward_and_backward(lengths, hq_hk, causal, head_dim, scale, seed):
    _compare(lengths, lengths, hq_hk, causal, head_dim, scale, seed)


@settings(max_examples=25, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=3),
    hq_hk=heads,
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reference_with_different_query_and_key_lengths(pairs, hq_hk, causal, seed):
    lq = [a for a, _ in pairs]
    lk = [b for _, b in pairs]
    _compare(lq, lk, hq_hk, causal, 4, None, seed)


def _compare(lq, lk, hq_hk, causal, head_dim, scale, seed):
    g = torch.Generator().manual_seed(seed)
    hq, hk = hq_hk
    q = torch.randn(sum(lq), hq, head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lk), hk, head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lk), hk, head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(sum(lq), hq, head_dim, generator=g, dtype=torch.float64)
    out = varlen_attention(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, softmax_scale=scale)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    s = 1.0 / math.sqrt(head_dim) if scale is None else scale
    ref = dense_attention(q, k, v, lq, lk, causal, s)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    assert out.shape == (sum(lq), hq, head_dim)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_collator_output_feeds_varlen_attention_like_one_by_one():
    rows = [
        {"input_ids": list(range(7)), "seq_lengths": [3, 4]},
        {"input_ids": list(range(5)), "seq_lengths": [5]},
    ]
    b = PaddingFreeCollator(pad_token_id=0, pad_to_multiple_of=8)(rows)
    T = b["input_ids"].shape[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, 4, 8, generator=g) for _ in range(3))
    out = varlen_attention(
        q, k, v, b["cu_seq_lens_q"], b["cu_seq_lens_k"], b["max_length_q"], b["max_length_k"], causal=True
    )
    cu = b["cu_seq_lens_q"].tolist()
    for lo, hi in zip(cu[:-1], cu[1:]):
        one = _cu([hi - lo])
        alone = varlen_attention(q[lo:hi], k[lo:hi], v[lo:hi], one, one, hi - lo, hi - lo)
        torch.testing.assert_close(out[lo:hi], alone)


def _qkv(t=5, hq=2, hk=2, d=4):
    return torch.randn(t, hq, d), torch.randn(t, hk, d), torch.randn(t, hk, d)


@pytest.mark.parametrize(
    "cu, max_len, match",
    [
        (torch.tensor([0, 3, 5], dtype=torch.int64), 3, "int32"),
        (torch.tensor([[0, 3, 5]], dtype=torch.int32), 3, "1-D"),
        (torch.tensor([1, 3, 5], dtype=torch.int32), 3, r"cu_seqlens_q\[0\] = 1"),
        (torch.tensor([0, 3, 3, 5], dtype=torch.int32), 3, "not strictly increasing at index 2"),
        (torch.tensor([0, 3, 4], dtype=torch.int32), 3, r"cu_seqlens_q\[-1\] = 4 but the tensor has 5"),
        (torch.tensor([0, 3, 5], dtype=torch.int32), 2, "max_seqlen_q=2 is smaller than the longest"),
        (torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor(3), "max_seqlen_q must be a Python int"),
        ([0, 3, 5], 3, "must be a torch.Tensor"),
    ],
)
def test_bad_cu_seqlens_and_max_seqlen(cu, max_len, match):
    q, k, v = _qkv()
    good = torch.tensor([0, 3, 5], dtype=torch.int32)
    with pytest.raises(PackingError, match=match):
        varlen_attention(q, k, v, cu, good, max_len, 3)


def test_bad_shapes_and_arguments():
    q, k, v = _qkv(hq=3, hk=2)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(PackingError, match="multiple of heads_k"):
        varlen_attention(q, k, v, cu, cu, 5, 5)
    q, k, v = _qkv()
    with pytest.raises(PackingError, match="q must be a"):
        varlen_attention(q[0], k, v, cu, cu, 5, 5)
    with pytest.raises(PackingError, match="sequences but cu_seqlens_k has"):
        varlen_attention(q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32), cu, 5, 5)
    with pytest.raises(PackingError, match="backend"):
        varlen_attention(q, k, v, cu, cu, 5, 5, backend="triton")


@pytest.fixture
def fake_flash(monkeypatch):
    calls = []
    module = types.ModuleType("flash_attn")

    def flash_attn_varlen_func(*args, **kwargs):
        calls.append((args, kwargs))
        return "flash-output"

    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


def test_flash_branch_passes_the_documented_arguments(fake_flash):
    q, k, v = _qkv(hq=4, hk=2, d=16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, cu, 3, 4, causal=False, softmax_scale=0.5, backend="flash")
    assert out == "flash-output"
    ((args, kwargs),) = fake_flash
    assert args == ()  # every argument by name: flash-attn's positional order cannot be misread
    assert kwargs["q"] is q and kwargs["k"] is k and kwargs["v"] is v
    assert kwargs["cu_seqlens_q"] is cu and kwargs["cu_seqlens_k"] is cu
    assert (kwargs["max_seqlen_q"], kwargs["max_seqlen_k"]) == (3, 4)
    assert {k: kwargs[k] for k in ("dropout_p", "softmax_scale", "causal")} == {
        "dropout_p": 0.0,
        "softmax_scale": 0.5,
        "causal": False,
    }


def test_flash_branch_default_scale_and_validation(fake_flash):
    q, k, v = _qkv(d=16)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    varlen_attention(q, k, v, cu, cu, 3, 3, backend="flash")
    assert fake_flash[0][1]["softmax_scale"] == pytest.approx(0.25)
    assert fake_flash[0][1]["causal"] is True
    with pytest.raises(PackingError, match="smaller than the longest"):
        varlen_attention(q, k, v, cu, cu, 2, 3, backend="flash")


def test_auto_uses_flash_only_for_cuda_half_tensors(fake_flash, monkeypatch):
    import packtools.batches.attention as attention

    q, k, v = _qkv()
    cu = torch.tensor([0, 5], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, cu, 5, 5)  # CPU fp32: reference
    assert isinstance(out, torch.Tensor) and fake_flash == []
    monkeypatch.setattr(attention, "_flash_eligible", lambda q, k, v: True)
    assert varlen_attention(q, k, v, cu, cu, 5, 5) == "flash-output"


def test_flash_eligible_needs_cuda_and_half():
    from packtools.batches.attention import _flash_eligible

    x = torch.zeros(2, 1, 4, dtype=torch.bfloat16)
    assert not _flash_eligible(x, x, x)  # on CPU


def test_forcing_flash_without_flash_attn_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    q, k, v = _qkv()
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ImportError, match=r"packtools\[flash\]"):
        varlen_attention(q, k, v, cu, cu, 5, 5, backend="flash")
    # auto falls back to the reference
    assert varlen_attention(q, k, v, cu, cu, 5, 5).shape == q.shape


def test_flash_attn_call_shape_is_refused():
    """flash_attn_varlen_func's 8th positional argument is dropout_p; here it would have been causal."""
    q, k, v = _qkv()
    cu = _cu([2, 3])
    with pytest.raises(TypeError, match="positional"):
        varlen_attention(q, k, v, cu, cu, 3, 3, 0.0)
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        varlen_attention(q, k, v, cu, cu, 3, 3, casual=True)


def test_collator_batch_unpacks_into_varlen_attention():
    rows = [{"input_ids": list(range(7)), "seq_lengths": [3, 4]}]
    batch = PaddingFreeCollator(pad_token_id=0)(rows)
    q, k, v = _qkv(t=7)
    out = varlen_attention(q, k, v, **batch)
    ref = varlen_attention(q, k, v, batch["cu_seq_lens_q"], batch["cu_seq_lens_k"], 4, 4)
    assert torch.equal(out, ref)
    with pytest.raises(PackingError, match="both cu_seqlens_q and cu_seq_lens_q"):
        varlen_attention(q, k, v, _cu([7]), **batch)
    with pytest.raises(PackingError, match="needs"):
        varlen_attention(q, k, v)


def test_dropout_and_causal_arguments():
    q, k, v = _qkv()
    cu = _cu([2, 3])
    torch.manual_seed(0)
    dropped = varlen_attention(q, k, v, cu, cu, 3, 3, dropout_p=0.5)
    assert not torch.allclose(dropped, varlen_attention(q, k, v, cu, cu, 3, 3))
    for bad in ({"dropout_p": 1.0}, {"dropout_p": -0.1}, {"causal": 0.0}):
        with pytest.raises(PackingError):
            varlen_attention(q, k, v, cu, cu, 3, 3, **bad)
