"""The guard on a forward's cache, and its model type read once.

A cache passed in with a packed row: transformers' ``sdpa``/``eager`` masks read ``position_ids`` for packed
sequences only without a cache, so an explicit empty ``DynamicCache`` (no generation step: it holds no tokens) on
a packed training batch made the documents attend to each other.  The guard skipped every call that passed a
cache, as if it were a decode step; it now refuses an empty cache with a packed row and still lets generation
(a cache holding tokens, or one sequence per row) through."""

from __future__ import annotations

import pytest
from _hf_models import PAD, tiny_llama, torch, transformers

from packtools import PaddingFreeCollator
from packtools.errors import PackingError
from packtools.integrations.attention.mixers import generating
from packtools.integrations.trainers.guard import guard_model

ROW = {"input_ids": [5, 6, 7, 8, 9, 10, 11], "seq_lengths": [3, 4]}


def packed_batches():
    """The row as PaddingFreeCollator gives it (restarting positions and cu_seq_lens), with positions alone, and
    with cu_seq_lens alone (positions counted on across the documents)."""
    full = PaddingFreeCollator(PAD, return_flash_attn_kwargs=True)([ROW])
    full.pop("labels")
    positions = {k: v for k, v in full.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    counted = {**full, "position_ids": torch.arange(7)[None]}
    return {"collated": full, "positions": positions, "cu_seq_lens": counted}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_an_empty_cache_with_a_packed_row_is_refused(impl):
    model = tiny_llama(impl).train()
    batch = packed_batches()["positions"]
    with torch.no_grad():  # negative control, unguarded: the empty cache makes the documents see each other
        alone = model(input_ids=batch["input_ids"][:, 3:], use_cache=False).logits[0]
        leaked = model(**batch, past_key_values=transformers.DynamicCache()).logits[0, 3:]
        apart = model(**batch).logits[0, 3:]
    assert (apart - alone).abs().max() < 1e-5 and (leaked - alone).abs().max() > 1e-3
    guard_model(model)
    for name, batch in packed_batches().items():
        for key in ("past_key_values", "cache"):
            with pytest.raises(PackingError, match="cache was passed in.*no per-sequence mask") as err:
                model(**batch, **{key: transformers.DynamicCache()})
            assert err.value.param == key, name
    model.eval()  # the same inputs in eval mode attend across the documents just as well
    with pytest.raises(PackingError, match="cache was passed in"):
        model(**packed_batches()["collated"], past_key_values=transformers.DynamicCache())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_generation_with_a_cache_still_passes(impl):
    model = tiny_llama(impl)
    guard_model(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), use_cache=False).logits[0, -1]
        for mode in (model.eval, model.train):
            mode()
            cache = transformers.DynamicCache()
            model(input_ids=ids, past_key_values=cache, use_cache=True)  # one sequence: a prefill
            assert cache.get_seq_length() == 4 and generating({"past_key_values": cache})
            step = model(
                input_ids=torch.tensor([[9]]), position_ids=torch.tensor([[4]]), past_key_values=cache
            )
            assert (step.logits[0, -1] - plain).abs().max() < 1e-4
        model.eval()
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD)
    assert out.shape == (1, 7)


class OnGPU(torch.Tensor):
    """A CPU tensor that reports a CUDA device: StaticCache's count as it comes back on a GPU, without one."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_an_empty_static_cache_counting_on_the_gpu_is_refused_with_a_packed_row(monkeypatch):
    """StaticCache's layers count their tokens in a tensor on the cache's device once initialized
    (``get_seq_length()``: ``cumulative_length``); reset, or initialized early, the cache holds none, and a packed
    row with it attends across its documents (no per-sequence mask with a cache).  Before, a count on the GPU
    was taken for tokens held without reading it: the guard let the packed row through.  A decode step (one
    token per row) is a generation step whatever the count, and its count is not read (no host sync)."""
    model = tiny_llama("sdpa").train()
    guard_model(model)
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)  # a prefill
    cache.reset()  # initialized and empty: its count is a tensor 0 (on the GPU, on CUDA)
    counted = cache.get_seq_length()
    assert isinstance(counted, torch.Tensor) and int(counted) == 0
    monkeypatch.setattr(cache, "get_seq_length", lambda layer_idx=0: counted.as_subclass(OnGPU))
    assert cache.get_seq_length().device.type == "cuda"
    with pytest.raises(PackingError, match="cache was passed in.*no per-sequence mask"):
        model(**packed_batches()["positions"], past_key_values=cache)

    def unread(layer_idx=0):
        raise AssertionError("a decode step's cache count was read")

    monkeypatch.setattr(cache, "get_seq_length", unread)
    assert generating({"past_key_values": cache, "input_ids": torch.tensor([[9], [4]])})


def test_the_guard_reads_the_model_type_once(monkeypatch):
    """The model type decides the guard's GPT-OSS and Qwen2-VL checks: read once, at guard_model, not on every
    forward (before: two reads a forward)."""
    model = tiny_llama("sdpa")
    reads = []
    monkeypatch.setattr(type(model.config), "model_type", property(lambda self: reads.append(1) or "llama"))
    guard_model(model, check_isolation=False)
    at_guard = len(reads)
    batch = PaddingFreeCollator(PAD)([ROW])
    for _ in range(3):
        model(**batch)
    assert len(reads) == at_guard >= 1
