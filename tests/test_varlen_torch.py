"""varlen_attention's PyTorch varlen_attn path (CUDA only): the arguments it builds from the installed signature.

CPU has no varlen_attn kernel, so the call is exercised with a stand-in that has the installed function's
signature and computes the reference; the GPU comparison is benchmarks/gpu_check.py's.
"""

import inspect
import math

import pytest

torch = pytest.importorskip("torch")

from packtools.batches import attention  # noqa: E402
from packtools.errors import PackingError  # noqa: E402


def test_kwargs_from_the_installed_signature():
    fn = attention._torch_varlen()
    if fn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen.varlen_attn")
    kwargs = attention.torch_varlen_kwargs(fn, True, 0.125, 8, 2)
    assert kwargs == {"window_size": (-1, 0), "scale": 0.125, "enable_gqa": True}
    assert attention.torch_varlen_kwargs(fn, False, 0.5, 4, 4) == {"window_size": (-1, -1), "scale": 0.5}


def test_older_and_unknown_signatures():
    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        pass

    def unknown(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
        pass

    assert attention.torch_varlen_kwargs(old, True, 1.0, 2, 2) == {"is_causal": True, "scale": 1.0}
    with pytest.raises(PackingError, match="enable_gqa"):
        attention.torch_varlen_kwargs(old, True, 1.0, 4, 2)
    with pytest.raises(PackingError, match="neither window_size nor is_causal"):
        attention.torch_varlen_kwargs(unknown, True, 1.0, 2, 2)


def test_auto_uses_torch_varlen_without_flash_attn_on_eligible_tensors(monkeypatch):
    real = attention._torch_varlen()
    calls = []

    def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), scale=None,
             enable_gqa=False):  # fmt: skip
        calls.append({"window_size": window_size, "scale": scale, "enable_gqa": enable_gqa})
        return attention.varlen_attention(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=window_size == (-1, 0),
            softmax_scale=scale, backend="reference",
        )  # fmt: skip

    if real is not None:
        assert list(inspect.signature(fake).parameters)[:7] == list(inspect.signature(real).parameters)[:7]
    monkeypatch.setattr(attention, "_torch_varlen", lambda: fake)
    monkeypatch.setattr(attention, "_flash_module", lambda: None)
    monkeypatch.setattr(attention, "_flash_eligible", lambda q, k, v: True)
    q = torch.randn(7, 4, 8)
    k = v = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out = attention.varlen_attention(q, k, v, cu, cu, 4, 4)
    ref = attention.varlen_attention(q, k, v, cu, cu, 4, 4, backend="reference")
    assert calls == [{"window_size": (-1, 0), "scale": 1.0 / math.sqrt(8), "enable_gqa": True}]
    assert torch.equal(out, ref)
    attention.varlen_attention(q, k, v, cu, cu, 4, 4, dropout_p=0.1)  # no dropout in varlen_attn: reference
    assert len(calls) == 1


def test_forced_torch_backend_on_cpu_is_refused():
    q = k = v = torch.randn(5, 2, 4)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(PackingError, match="no CPU kernel"):
        attention.varlen_attention(q, k, v, cu, cu, 5, 5, backend="torch")
