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
from packtools.integrations.attention.backends import token_mixing_layers
from packtools.integrations.attention.isolation import IsolationReport
from packtools.integrations.trainers.guard import check_forward_inputs, guard_model


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
    first = str(err.value).split("\n")[0]  # attention stays isolated; the positions are what is wrong
    assert "logits of a packed sequence" in first and "change of the other sequences" not in first
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
    guard_model(model)  # and the guard refuses a packed batch before it reaches the model: no kernels here
    with pytest.raises(PackingError, match="no varlen kernels on this machine.*run_mixers_per_document"):
        check_isolation(model, position_only)
    # where the kernels are (CUDA), a batch without seq_idx / cu_seq_lens is still refused by the input check
    with pytest.raises(PackingError, match="neither seq_idx nor cu_seq_lens"):
        check_forward_inputs(
            {"position_ids": torch.tensor([[0, 1, 0, 1]])}, "sdpa", ("model.layers.0.mamba",)
        )


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


LEAK = "packtools_test_leaky_sdpa"


def register_leaky_sdpa(eps):
    """sdpa plus ``eps`` times the mean query over the whole row: a small leak across packed sequences."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def leaky(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out + eps * query.mean(dim=2)[:, None], weights

    AttentionInterface.register(LEAK, leaky)
    ALL_MASK_ATTENTION_FUNCTIONS.register(LEAK, sdpa_mask)
    return LEAK


def test_bfloat16_verdicts_both_ways():
    """bfloat16: rounding noise is not a leak, and a leak too small to stand out of it still is.

    The packed-against-alone logits carry rounding noise (tolerance 5e-2 x max |logit|); the perturbation
    signal does not: an isolated model moves the other sequences by exactly 0, so it is judged against ~0.
    """
    model = tiny_llama("sdpa").to(torch.bfloat16)
    report = check_isolation(model)  # raises if it judged the isolated model leaking
    assert report.dtype == "bfloat16" and report.tolerance >= 5e-2 and not report.leaks
    assert report.perturb_diff == 0.0 and report.perturb_tolerance < 1e-4
    assert max(report.alone_diff) > 0  # the rounding noise the loose tolerance is for

    leaky = tiny_llama("sdpa").to(torch.bfloat16)
    leaky.set_attn_implementation(register_leaky_sdpa(eps=0.02))
    with pytest.raises(PackingError, match="lets packed sequences see each other"):
        check_isolation(leaky)
    report = check_isolation(leaky, raise_on_leak=False)
    assert report.leaks
    # Negative control: judged by the loose bfloat16 tolerance alone (the old rule) this leak passed.
    assert max(*report.alone_diff, report.perturb_diff) < report.tolerance, report
    assert report.perturb_diff > 100 * report.perturb_tolerance
    # The same leak in float32 is plain to see in every measure.
    leaky32 = tiny_llama("sdpa")
    leaky32.set_attn_implementation(LEAK)
    assert check_isolation(leaky32, raise_on_leak=False).leaks


def test_a_dropped_boundary_in_bfloat16_moves_the_other_sequences():
    model = tiny_llama("sdpa").to(torch.bfloat16)
    leaky = Rows(PaddingFreeCollator(0, unpacked=True), rows=drop_seq_lengths)
    report = check_isolation(model, leaky, raise_on_leak=False)
    assert report.leaks and report.perturb_diff > report.perturb_tolerance


def test_probe_finds_the_sequences_in_a_padded_or_left_padded_batch():
    """Any collator's layout: one sequence per row (packed=False), right- or left-padded, with its mask."""
    model = tiny_llama("sdpa")
    tok = PaddingFreeCollator(0, padding_free=False, unpacked=True)

    def left_padded(rows):
        batch = tok(rows)
        ids, keep = batch["input_ids"], batch["attention_mask"].bool()
        width = ids.shape[1]
        out = {k: torch.zeros_like(v) for k, v in batch.items() if torch.is_tensor(v) and k != "labels"}
        for b in range(ids.shape[0]):
            n = int(keep[b].sum())
            out["input_ids"][b, width - n :] = ids[b, :n]
            out["attention_mask"][b, width - n :] = 1
            out["position_ids"][b, width - n :] = torch.arange(n)
        return out

    assert not check_isolation(model, tok, packed=False).leaks
    assert not check_isolation(model, left_padded, packed=False).leaks

    def merged(rows):  # two sequences merged into one row: the probe cannot find its rows and says so
        return tok([{"input_ids": rows[0]["input_ids"] + rows[1]["input_ids"]}, *rows[2:]])

    with pytest.raises(PackingError, match="does not hold the probe's 4 rows in order"):
        check_isolation(model, merged, packed=False)


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


def _jitter(model, size, seed=0):
    """Make the model's forward not bitwise reproducible, as CUDA's unordered atomic sums make a MoE block:
    every call adds fresh noise of ``size`` (relative to the logits) to its logits."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, kwargs, out):
        scale = out.logits.abs().max()
        out.logits = out.logits + size * scale * (torch.rand(out.logits.shape, generator=gen) - 0.5)
        return out

    model.register_forward_hook(hook, with_kwargs=True)
    return model


def test_a_model_with_run_to_run_noise_is_judged_by_its_own_noise():
    """Off the CPU the probe runs the same inputs twice and takes the model's own noise into its tolerances
    (stated in the report); an isolated but noisy model is not refused, a leak is still caught, and on the CPU
    nothing changes (exact)."""
    noisy = _jitter(tiny_llama("sdpa"), 1e-4)
    # negative control: judged as if the forward were reproducible (the CPU rule), its noise reads as a leak
    assert check_isolation(noisy, raise_on_leak=False).leaks
    report = check_isolation(noisy, measure_noise=True)  # raises if judged leaking
    assert report.noise is not None and 0 < report.noise < 1e-3
    assert report.perturb_tolerance >= 10 * report.noise and "run-to-run noise" in str(report)
    leaky = _jitter(tiny_llama("sdpa"), 1e-4)
    leaky.set_attn_implementation(register_leaky_sdpa(eps=0.02))
    with pytest.raises(PackingError, match="lets packed sequences see each other"):
        check_isolation(leaky, measure_noise=True)
    exact = check_isolation(tiny_llama("sdpa"))
    assert exact.noise is None and exact.perturb_tolerance < 1e-4 and "not measured" in str(exact)
