"""The isolation probe (packtools.integrations.check_isolation): it passes isolated models and catches every kind of leak.

Negative controls: each way packed sequences can leak into each other -- an attention_mask in the batch,
seq_lengths dropped, position_ids dropped, wrong absolute positions, a hybrid model's mixers without seq_idx --
is fed to the probe, which must raise PackingError naming the model, the backend and the fix.
"""

import numpy as np
import pytest
from _hf_models import tiny_arch, tiny_llama, torch

from packtools import PaddingFreeCollator
from packtools.errors import PackingError
from packtools.integrations import check_isolation
from packtools.integrations.isolation import IsolationReport
from packtools.integrations.transformers import guard_model, token_mixing_layers


class Rows:
    """A collator that changes the rows or the batch on the way (the leaks the probe must catch)."""

    def __init__(self, inner, rows=None, batch=None):
        self.inner, self.rows, self.batch = inner, rows, batch

    def __call__(self, features):
        features = [self.rows(dict(f)) for f in features] if self.rows else features
        out = self.inner(features)
        return self.batch(out) if self.batch else out


def drop_seq_lengths(row):
    row.pop("seq_lengths")
    return row


def add_attention_mask(batch):
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def shift_positions(batch):
    batch["position_ids"] = batch["position_ids"] + 1  # still restarting per sequence, but from 1
    return batch


def test_isolated_model_passes_with_a_report():
    report = check_isolation(tiny_llama("sdpa"), backward=True)
    assert isinstance(report, IsolationReport) and not report.leaks
    assert report.model == "LlamaForCausalLM" and report.backend == "sdpa" and report.dtype == "float32"
    assert report.lengths == (5, 9, 3, 7) and len(report.alone_diff) == 4
    assert set(report.keys) >= {"input_ids", "position_ids", "cu_seq_lens_q", "seq_idx"}
    assert "labels" not in report.keys and "attention_mask" not in report.keys
    assert max(report.alone_diff) < 1e-5 and report.perturb_diff == 0.0
    assert report.loss_diff < 1e-5 and report.grad_diff < 1e-5
    assert "isolated" in str(report)


def test_probe_restores_train_mode_and_leaves_grads_alone():
    model = tiny_llama("eager")
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back as it was
    before = {n: m.training for n, m in model.named_modules()}
    check_isolation(model, backward=True)
    assert {n: m.training for n, m in model.named_modules()} == before
    assert all(p.grad is None for p in model.parameters())


def test_report_without_raising_and_custom_lengths():
    model = tiny_llama("sdpa")
    collator = Rows(PaddingFreeCollator(0, unpacked=True), rows=drop_seq_lengths)
    report = check_isolation(model, collator, lengths=(4, 6, 2), raise_on_leak=False)
    assert report.leaks and report.lengths == (4, 6, 2) and report.perturb_diff > 1e-3
    with pytest.raises(PackingError, match="at least two sequences"):
        check_isolation(model, lengths=(5,))


def test_leak_attention_mask_in_the_batch():
    model = tiny_llama("sdpa")
    collator = Rows(PaddingFreeCollator(0), batch=add_attention_mask)
    with pytest.raises(
        PackingError, match=r"LlamaForCausalLM with attn_implementation='sdpa'.*attention_mask"
    ):
        check_isolation(model, collator)
    guard_model(model)  # the adapter's guard refuses the same batch before the model runs
    with pytest.raises(PackingError, match="ignores position_ids"):
        check_isolation(model, collator)


def test_leak_seq_lengths_dropped():
    model = tiny_llama("sdpa")
    with pytest.raises(PackingError, match="LlamaForCausalLM.*see each other"):
        check_isolation(model, Rows(PaddingFreeCollator(0, unpacked=True), rows=drop_seq_lengths))
    with pytest.raises(PackingError, match="remove_unused_columns.*prepare_trainer"):
        check_isolation(model, Rows(PaddingFreeCollator(0), rows=drop_seq_lengths))


def test_leak_position_ids_dropped():
    model = tiny_llama("eager")
    collator = PaddingFreeCollator(0, return_position_ids=False)
    with pytest.raises(PackingError, match="'eager' lets packed sequences see each other"):
        check_isolation(model, collator)
    guard_model(model)
    with pytest.raises(PackingError, match="no position_ids"):
        check_isolation(model, collator)


def test_leak_wrong_absolute_positions():
    """GPT-2 adds learned absolute position embeddings: positions starting at 1 give wrong logits."""
    collator = Rows(PaddingFreeCollator(0), batch=shift_positions)
    with pytest.raises(PackingError, match="GPT2LMHeadModel") as err:
        check_isolation(tiny_arch("GPT-2", "sdpa"), collator)
    assert "move by 0.0e+00" in str(err.value)  # attention stays isolated; the positions are what is wrong
    # Rotary positions are relative: the same shift leaves Llama exact, and the probe does not cry wolf.
    assert not check_isolation(tiny_llama("sdpa"), collator).leaks


@pytest.mark.parametrize("arch", ["Falcon-H1", "Bamba", "Qwen3-Next"])
def test_leak_hybrid_mixers_without_seq_idx(arch):
    model = tiny_arch(arch, "sdpa")
    assert token_mixing_layers(model)
    # Without seq_idx / cu_seq_lens the convolution and scan layers run the packed row as one sequence.
    position_only = PaddingFreeCollator(0, return_seq_idx=False, return_flash_attn_kwargs=False)
    with pytest.raises(PackingError, match="mix tokens outside attention and need seq_idx"):
        check_isolation(model, position_only)
    report = check_isolation(model, position_only, raise_on_leak=False)
    assert report.perturb_diff > 1e-4 and max(report.alone_diff) > 1e-4
    # With them, transformers' PyTorch fallback (no CUDA kernels here) refuses: packtools says what to do.
    with pytest.raises(PackingError, match="cannot keep packed sequences apart on this machine.*do not pack"):
        check_isolation(model)
    guard_model(model)  # and the guard refuses a packed batch without seq_idx before it reaches the model
    with pytest.raises(PackingError, match="neither seq_idx nor cu_seq_lens"):
        check_isolation(model, position_only)


def test_attention_only_models_have_no_token_mixing_layers():
    assert token_mixing_layers(tiny_llama()) == []
    assert token_mixing_layers(tiny_arch("GPT-2", "eager")) == []  # its Conv1D is a linear layer


def test_probe_uses_the_models_vocabulary_without_special_tokens(monkeypatch):
    model = tiny_llama("sdpa")
    seen = []
    inner = PaddingFreeCollator(0)

    def record(rows):
        seen.extend(t for r in rows for t in r["input_ids"])
        return inner(rows)

    check_isolation(model, record)
    assert max(seen) < model.config.vocab_size and 0 not in seen
    assert len(np.unique(seen)) > 10


def test_tolerance_follows_the_weights_dtype():
    """bfloat16 weights: rounding noise is not a leak, a real leak still is."""
    model = tiny_llama("sdpa").to(torch.bfloat16)
    report = check_isolation(model)
    assert report.dtype == "bfloat16" and report.tolerance >= 5e-2 and report.perturb_diff == 0.0
    leaky = Rows(PaddingFreeCollator(0, unpacked=True), rows=drop_seq_lengths)
    assert check_isolation(model, leaky, raise_on_leak=False).perturb_diff > 0


def leaky_conv_llama():
    """A Llama whose embeddings pass through a causal Conv1d that ignores seq_idx (as transformers before 5.20's
    PyTorch fallback of the Mamba/conv mixers does: it takes seq_idx and runs the packed row as one)."""
    model = tiny_llama("sdpa")
    hidden = model.config.hidden_size
    conv = torch.nn.Conv1d(hidden, hidden, 3, padding=2, groups=hidden)
    model.model.embed_tokens.add_module("conv_mixer", conv)
    model.model.embed_tokens.register_forward_hook(
        lambda _m, _i, out: out + conv(out.transpose(1, 2))[..., : out.shape[1]].transpose(1, 2)
    )
    return model


def test_mixers_that_take_seq_idx_but_leak_are_refused_with_the_mixer_fix():
    model = leaky_conv_llama()
    assert token_mixing_layers(model) == ["model.embed_tokens"]
    # seq_idx reaches the model (its forward takes **kwargs) and the leak is measured: the message names the
    # mixers and says not to pack, not "use sdpa instead of 'sdpa'" (the hint for attention-only models).
    with pytest.raises(PackingError, match="cannot keep packed sequences apart on this machine") as err:
        check_isolation(model)
    assert "model.embed_tokens" in str(err.value) and "do not pack" in str(err.value)
    assert "instead of 'sdpa'" not in str(err.value)
    report = check_isolation(model, raise_on_leak=False)
    assert "seq_idx" in report.keys and report.leaks
