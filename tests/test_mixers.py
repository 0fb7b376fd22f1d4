"""Token-mixing layers run per document (packtools.integrations.attention.mixers): hybrid models packed exactly on CPU.

Every hybrid family of the matrix, built tiny from its config: the packed batch against each document alone
(logits, loss, every gradient), with negative controls (the same layer over the whole row differs); the layer
itself per document against the layer run alone; gradient checkpointing; prepare_trainer and unprepare; the
varlen-kernel path's inputs; GPT-OSS's masks from position_ids; ALiBi under packtools_sdpa; probe messages.
"""

import re

import numpy as np
import pytest
from _hf_models import tiny_arch, tiny_llama, word_tokenizer
from _scripts import script

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packtools import PackingError, PaddingFreeCollator  # noqa: E402
from packtools.integrations import check_isolation  # noqa: E402
from packtools.integrations.attention.backends import check_attention_implementation, token_mixing_layers  # noqa: E402
from packtools.integrations.attention.mixers import (  # noqa: E402
    SEGMENTS_KEY,
    Segments,
    _PerDocument,
    document_mixers,
    run_mixers_per_document,
    segments_of,
)

HYBRIDS = ["Qwen3.5", "Qwen3.5-MoE", "Qwen3-Next", "Kimi Linear", "LFM2", "Nemotron-H", "Bamba", "Falcon-H1"]
POSITIONS_ONLY = dict(return_seq_idx=False, return_flash_attn_kwargs=False)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_packed_equals_documents_alone(arch):
    model = tiny_arch(arch, "sdpa")
    done = run_mixers_per_document(model)
    assert done is not None and set(done.modes.values()) == {"per-document"}
    assert token_mixing_layers(model) == [] and token_mixing_layers(model, include_handled=True) == list(
        done.modes
    )
    for collator in (
        None,
        PaddingFreeCollator(0, **POSITIONS_ONLY),
    ):  # cu_seq_lens + seq_idx, or positions only
        report = check_isolation(model, collator, backward=True)
        assert not report.leaks and report.perturb_diff <= report.perturb_tolerance
        assert max(report.alone_diff) < 1e-5 and report.grad_diff < 1e-5 and report.loss_diff < 1e-5


@pytest.mark.parametrize("arch", ["Qwen3.5", "Nemotron-H", "LFM2", "Kimi Linear"])
def test_negative_control_mixers_over_the_whole_row_leak(arch):
    """The same model without the per-document layers: the row runs as one sequence and the probe sees it."""
    model = tiny_arch(arch, "sdpa")
    report = check_isolation(model, PaddingFreeCollator(0, **POSITIONS_ONLY), raise_on_leak=False)
    assert report.leaks and report.perturb_diff > 1e-6
    with pytest.raises(PackingError, match="cannot keep packed sequences apart.*run_mixers_per_document"):
        check_isolation(model)  # seq_idx / cu_seq_lens reach the fallback: refused, by name


@pytest.mark.parametrize("arch", ["Qwen3.5", "Nemotron-H", "LFM2"])
def test_layer_per_document_equals_layer_alone_and_differs_from_whole_row(arch):
    model = tiny_arch(arch, "sdpa").eval()
    name = token_mixing_layers(model)[0]
    layer = dict(model.named_modules())[name]
    torch.manual_seed(1)
    hidden = torch.randn(1, 12, model.config.hidden_size)
    with torch.no_grad():
        whole = layer(hidden)
    run_mixers_per_document(model)
    bounds = (0, 5, 12)
    with torch.no_grad():
        per_doc = layer(hidden, **{SEGMENTS_KEY: Segments((bounds,), 12)})
        alone = torch.cat([layer(hidden[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    assert torch.allclose(per_doc, alone, rtol=0, atol=1e-7)  # each document's scan at its own chunk size
    rounding = float((per_doc[:, :5] - whole[:, :5]).abs().max())  # the first document has nothing before it
    control = float(
        (per_doc[:, 5:] - whole[:, 5:]).abs().max()
    )  # the row as one sequence: the second differs
    assert rounding < 1e-7 and control > 100 * max(rounding, 1e-9)


@pytest.mark.parametrize("arch", ["Nemotron-H", "LFM2", "Qwen3.5"])
def test_per_document_layers_hold_no_more_than_the_packed_row(arch, monkeypatch):
    """The benchmark's memory figure (benchmarks/bench_mixers.py: peak bytes of live tensors over forward +
    backward, rows of 4 and 16 documents): the prepared model holds no more than the same row on the model without
    per-document layers; the control (below) keeps what the recomputed layers save instead."""
    import packtools.integrations.attention.mixers as mixers

    bench = script("bench_mixers")
    for count in (4, 16):
        got = bench.measure(arch, count, repeat=1, memory=True)
        assert got["mem per-document"] <= got["mem whole-row"]
    from packtools.compat import release

    # the control: the per-document calls kept for backward hold more than the row, for short convolutions, and
    # for Mamba-2 with transformers 5.25's scan (5.15's holds more over the whole row than per document)
    if arch == "LFM2" or (arch == "Nemotron-H" and release(transformers.__version__) >= (5, 25, 0)):
        monkeypatch.setattr(mixers, "RECOMPUTED", ())
        got = bench.measure(arch, 4, repeat=1, memory=True)
        assert got["mem per-document"] > got["mem whole-row"]


class ToyMixer(torch.nn.Module):
    """A layer the per-document path recomputes (its name holds "Mixer"): dropout (random) and a running sum."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, hidden, scale=None):
        mixed = torch.nn.functional.dropout(self.proj(hidden), 0.5, training=True).cumsum(1)
        return mixed if scale is None else mixed * scale


def test_recomputed_documents_give_the_gradients_of_the_kept_ones():
    """Recomputed in backward (forward without saving, backward runs the documents again): the same output and
    gradients, dropout's random mask included, as the documents' calls kept for backward; a keyword tensor that
    needs a gradient is not recomputed (its gradient would be lost), and gets it."""
    torch.manual_seed(0)
    layer = ToyMixer()
    wrapper = _PerDocument("toy", layer.forward, kernel=False, module=layer)
    assert wrapper.recompute
    segments = {SEGMENTS_KEY: Segments(((0, 2, 5),), 5)}
    hidden = torch.randn(1, 5, 3, requires_grad=True)
    inputs = [hidden, *layer.parameters()]
    torch.manual_seed(1)
    out = wrapper(hidden, **segments)
    assert type(out.grad_fn).__name__ == "RecomputedBackward"
    got = torch.autograd.grad(out.square().sum(), inputs)
    torch.manual_seed(1)
    kept = wrapper._documents(torch, Segments(((0, 2, 5),), 5), hidden, (), {})
    assert type(kept.grad_fn).__name__ != "RecomputedBackward" and torch.equal(out, kept)
    want = torch.autograd.grad(kept.square().sum(), inputs)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    scale = torch.ones(1, 5, 1, requires_grad=True)
    out = wrapper(hidden, scale=scale, **segments)
    assert type(out.grad_fn).__name__ != "RecomputedBackward"
    assert torch.autograd.grad(out.sum(), scale)[0].abs().sum() > 0


def test_weights_held_outside_parameters_are_not_recomputed_away():
    """A layer whose weight is a plain tensor attribute needing a gradient, not a registered parameter (FSDP1
    with use_orig_params=False sets such views of its flat parameter on every module for the forward): the
    recomputation could not hand that weight its gradient, so the documents are kept for backward instead, and
    the weight gets the gradient it gets without packtools."""
    torch.manual_seed(0)
    layer = ToyMixer()
    flat = layer.proj.weight.detach().reshape(-1).clone().requires_grad_(True)  # the flat parameter
    del layer.proj.weight  # unregistered, as FSDP1 does for the forward
    layer.proj.weight = flat.view(3, 3)
    wrapper = _PerDocument("toy", layer.forward, kernel=False, module=layer)
    hidden = torch.randn(1, 5, 3, requires_grad=True)
    out = wrapper(hidden, **{SEGMENTS_KEY: Segments(((0, 2, 5),), 5)})
    assert type(out.grad_fn).__name__ != "RecomputedBackward"
    (got,) = torch.autograd.grad(out.square().sum(), flat)
    assert got.abs().sum() > 0


def test_segments_from_positions_seq_idx_and_cu_seq_lens():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert segments_of({"position_ids": pos}) == Segments(((0, 3, 5, 6), (0, 4, 6)), 6)
    assert segments_of({"position_ids": pos[None].expand(3, -1, -1)}).bounds[0] == (0, 3, 5, 6)  # 3-D rotary
    assert segments_of({"seq_idx": torch.tensor([[0, 0, 1, 1, 1]])}) == Segments(((0, 2, 5),), 5)
    assert segments_of({"cu_seq_lens_q": torch.tensor([0, 2, 7])}) == Segments(((0, 2, 7),), 7)
    assert (
        segments_of({"position_ids": torch.arange(6)[None]}) is None
    )  # one document a row: nothing to split
    assert segments_of({"position_ids": pos, "cache": object()}) is None  # generation: never split


def test_rotary_rows_counting_up_through_zero_are_one_document():
    """(3, B, T) rows that count up through 0 are one sequence: transformers' Qwen3.5 gives arange + rope_deltas
    to a forward of inputs_embeds alone after one with images (the deltas negative). Read as "all three 0 again",
    the per-document DeltaNet layers cut that row where attention does not (2e-2 in the logits, no error)."""
    through_zero = (torch.arange(8) - 5)[None, None].expand(3, 2, -1)
    assert segments_of({"position_ids": through_zero}) is None
    # a real restart still starts a document, after text or after an image (temporal row stays put)
    text_then_image = torch.tensor(
        [[[0, 1, 2, 2, 2, 2, 0, 1]], [[0, 1, 2, 2, 3, 3, 0, 1]], [[0, 1, 2, 3, 2, 3, 0, 1]]]
    )
    assert segments_of({"position_ids": text_then_image}) == Segments(((0, 6, 8),), 8)


def test_rows_of_several_documents_each():
    """Two packed rows ([2, T], padding_free=False): each row split on its own restarts."""
    model = tiny_arch("Qwen3.5", "sdpa")
    run_mixers_per_document(model)
    report = check_isolation(model, PaddingFreeCollator(0, padding_free=False), backward=True)
    assert not report.leaks and report.grad_diff < 1e-5


@pytest.mark.parametrize("arch", ["Qwen3.5", "Nemotron-H"])
def test_gradient_checkpointing_recomputes_with_the_forwards_own_documents(arch):
    """A checkpointed layer re-runs in backward after another forward (other documents) ran: the segments
    travel with each forward's kwargs, so the gradients are those of the documents alone.  A layer the per-document
    path recomputes itself (Mamba-2) leaves it to the checkpointed decoder layer (not run three times)."""
    model = tiny_arch(arch, "sdpa")
    run_mixers_per_document(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    wrappers = [vars(dict(model.named_modules())[name])["forward"] for name in document_mixers(model).modes]
    assert all(w._layer_recomputes() for w in wrappers)
    assert [w.recompute for w in wrappers] == [arch == "Nemotron-H"] * len(wrappers)
    rng = np.random.default_rng(0)
    docs = [torch.as_tensor(rng.integers(3, 100, n)) for n in (6, 4, 7)]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    loss = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float().square().mean()
    model(
        input_ids=ids[:, :9], position_ids=torch.arange(9)[None], use_cache=False
    )  # another forward between
    params = [p for p in model.parameters() if p.requires_grad]
    packed = torch.autograd.grad(loss, params, allow_unused=True)
    model.gradient_checkpointing_disable()
    alone_logits = [model(input_ids=d[None], use_cache=False).logits.float() for d in docs]
    alone = torch.autograd.grad(torch.cat(alone_logits, 1).square().mean(), params, allow_unused=True)
    worst = max(float((a - b).abs().max()) for a, b in zip(packed, alone) if a is not None and b is not None)
    assert worst < 1e-6


def test_prepare_trainer_runs_mixers_per_document_and_unprepare_restores(tmp_path):
    datasets = pytest.importorskip("datasets")
    from packtools import pack_dataset
    from packtools.integrations import prepare_trainer, unprepare

    model = tiny_arch("Nemotron-H", "sdpa")
    name = token_mixing_layers(model)[0]
    layer = dict(model.named_modules())[name]
    rows = pack_dataset(datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10, 11], [12, 13]]}), 16)
    args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    trainer = transformers.Trainer(model, args, train_dataset=rows, data_collator=PaddingFreeCollator(0))
    prepare_trainer(trainer)  # the probe runs on the prepared model: it would refuse a leak
    assert "forward" in vars(layer)
    assert name in document_mixers(model).summary() and "per-document" in document_mixers(model).summary()
    trainer.train()
    unprepare(trainer)
    assert "forward" not in vars(layer) and token_mixing_layers(model) == [name]
    assert not model.model._forward_pre_hooks  # the decoder's hook is gone too


@pytest.mark.parametrize("arch", ["Nemotron-H", "Falcon-H1"])
def test_documents_reach_a_mixer_its_layer_calls_with_fixed_arguments(arch, monkeypatch):
    """transformers 5.15's Nemotron-H and Falcon-H1 layers call their Mamba-2 layer without handing their keyword
    arguments on (Falcon-H1's decoder does not hand them to its layers either): the documents reach it from its
    decoder layer's call (its keyword arguments, or its position_ids).  Simulated here by a mixer that drops the
    keyword; the control drops what its layer handed over too, and leaks."""
    model = tiny_arch(arch, "sdpa")
    run_mixers_per_document(model)
    name = token_mixing_layers(model, include_handled=True)[0]
    mixer = dict(model.named_modules())[name]
    wrapper = vars(mixer)["forward"]

    def fixed_arguments(hidden_states, **kwargs):
        kwargs.pop(SEGMENTS_KEY, None)
        return wrapper(hidden_states, **kwargs)

    monkeypatch.setattr(mixer, "forward", fixed_arguments)
    report = check_isolation(model, PaddingFreeCollator(0, **POSITIONS_ONLY), backward=True)
    assert not report.leaks and report.grad_diff < 1e-5

    def nothing_handed_over(hidden_states, **kwargs):
        wrapper.from_layer = None
        return fixed_arguments(hidden_states, **kwargs)

    monkeypatch.setattr(mixer, "forward", nothing_handed_over)
    assert check_isolation(model, PaddingFreeCollator(0, **POSITIONS_ONLY), raise_on_leak=False).leaks


def test_two_trainers_sharing_a_model_each_undo_only_their_own_use(tmp_path):
    """Two trainers prepared on one model (a shared policy): unpreparing the first leaves the second's model
    exact (the per-document layers count their users); unpreparing the last puts the layers back, and the row
    then leaks again (the control)."""
    datasets = pytest.importorskip("datasets")
    from packtools import pack_dataset
    from packtools.integrations import prepare_trainer, unprepare

    model = tiny_arch("LFM2", "sdpa")
    layers = token_mixing_layers(model)
    rows = pack_dataset(datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8], [9, 10, 11], [12, 13]]}), 16)

    def trainer(name):
        args = transformers.TrainingArguments(str(tmp_path / name), report_to=[], use_cpu=True, max_steps=1)
        return transformers.Trainer(model, args, train_dataset=rows, data_collator=PaddingFreeCollator(0))

    first, second = trainer("first"), trainer("second")
    prepare_trainer(first)
    prepare_trainer(second)
    unprepare(first)
    assert document_mixers(model) is not None and token_mixing_layers(model) == []
    report = check_isolation(model, PaddingFreeCollator(0, **POSITIONS_ONLY), backward=True)
    assert not report.leaks and report.grad_diff < 1e-5
    second.train()
    unprepare(second)
    assert document_mixers(model) is None and token_mixing_layers(model) == layers
    assert check_isolation(model, PaddingFreeCollator(0, **POSITIONS_ONLY), raise_on_leak=False).leaks


def test_tree_and_context_parallel_still_refuse_handled_mixers():
    from packtools.integrations.attention.context_parallel import use_cp_attention

    model = tiny_arch("Qwen3.5", "sdpa")
    run_mixers_per_document(model)
    with pytest.raises(PackingError, match="mixes tokens outside attention"):
        use_cp_attention(model)


def test_varlen_kernel_inputs_and_cpu_fallback():
    """The kernel path's inputs (seq_idx, int32 cu_seq_lens) and, off CUDA, the per-document path instead."""
    got = _PerDocument._varlen({"seq_idx": "old", "other": 1}, (0, 2, 5), torch.device("cpu"))
    assert got["seq_idx"].tolist() == [[0, 0, 1, 1, 1]] and got["seq_idx"].dtype == torch.int32
    assert got["cu_seq_lens_q"].tolist() == [0, 2, 5] and got["cu_seq_lens_q"].dtype == torch.int32
    assert got["other"] == 1
    calls = []

    def original(hidden, **kwargs):
        calls.append((hidden.shape[1], sorted(kwargs)))
        return hidden * 2

    wrapper = _PerDocument("layer", original, kernel=True)  # decided for CUDA; these inputs are on the CPU
    out = wrapper(
        torch.ones(1, 5, 3),
        cu_seq_lens_q=torch.tensor([0, 2, 5]),
        **{SEGMENTS_KEY: Segments(((0, 2, 5),), 5)},
    )
    assert out.shape == (1, 5, 3) and calls == [(2, []), (3, [])]


def test_a_layer_that_does_not_return_the_documents_tokens_is_refused():
    wrapper = _PerDocument("layer", lambda hidden, **kw: (hidden, None), kernel=False)
    with pytest.raises(PackingError, match="cannot run it per document"):
        wrapper(torch.ones(1, 5, 3), **{SEGMENTS_KEY: Segments(((0, 2, 5),), 5)})
    with pytest.raises(PackingError, match="cannot tell which tokens"):
        wrapper(torch.ones(1, 4, 3), **{SEGMENTS_KEY: Segments(((0, 2, 5),), 5)})


def test_gpt_oss_eager_exact_with_masks_from_positions():
    model = tiny_arch("GPT-OSS", "eager")
    control = check_isolation(model, raise_on_leak=False)
    assert control.leaks and control.perturb_diff > 1e-3  # its forward builds masks without position_ids
    done = run_mixers_per_document(model)
    assert done.masks_from_positions and done.modes == {}
    report = check_isolation(model, backward=True)
    assert not report.leaks and report.grad_diff < 1e-5


def test_gpt_oss_guard_alone_refuses_packed_batches_without_masks_from_positions():
    """guard_model without run_mixers_per_document let GPT-OSS's packed sequences attend to each other (0.2 in
    the logits, no error) before the guard refused it; with the masks built from positions it passes."""
    from packtools.integrations.trainers.guard import guard_model

    model = tiny_arch("GPT-OSS", "eager")
    guard_model(model)
    for collator in (PaddingFreeCollator(0), PaddingFreeCollator(0, **POSITIONS_ONLY)):
        batch = collator([{"input_ids": list(range(3, 16)), "seq_lengths": [6, 7]}])
        with pytest.raises(
            PackingError, match="GptOssForCausalLM builds its attention masks.*run_mixers_per_doc"
        ):
            model(**batch)
    model(input_ids=torch.tensor([list(range(3, 10))]))  # one sequence, unpacked: not refused
    run_mixers_per_document(model)
    report = check_isolation(model)
    assert not report.leaks and max(report.alone_diff) < 1e-5


@pytest.mark.parametrize("arch", ["Qwen3.5", "Nemotron-H"])
def test_guard_without_per_document_layers_refuses_packed_batches_naming_the_fix(arch):
    """guard_model alone on a hybrid, on the CPU: a packed batch reached transformers' fallback, which raised a
    ValueError naming no fix (or, given positions only, the guard's advice to keep seq_idx, no fix here either);
    now a PackingError naming run_mixers_per_document.  One unpacked sequence still runs."""
    from packtools.integrations.trainers.guard import guard_model

    model = tiny_arch(arch, "sdpa")
    guard_model(model)
    for collator in (PaddingFreeCollator(0), PaddingFreeCollator(0, **POSITIONS_ONLY)):
        batch = collator([{"input_ids": list(range(3, 16)), "seq_lengths": [6, 7]}])
        with pytest.raises(PackingError, match="no varlen kernels on this machine.*run_mixers_per_document"):
            model(**batch)
    model(input_ids=torch.tensor([list(range(3, 10))]))


@pytest.mark.parametrize("arch", ["Qwen3.5", "LFM2"])
def test_guard_before_run_mixers_per_document_takes_the_handled_layers(arch):
    """guard_model listed the token-mixing layers when it was registered: called before run_mixers_per_document
    it refused a positions-only batch the per-document layers keep apart ("would run every packed row as one
    sequence", false) before it read the handled layers at each call."""
    from packtools.integrations.trainers.guard import guard_model

    model = tiny_arch(arch, "sdpa")
    guard_model(model)
    run_mixers_per_document(model)
    report = check_isolation(model, PaddingFreeCollator(0, **POSITIONS_ONLY))
    assert not report.leaks and max(report.alone_diff) < 1e-5


@pytest.mark.parametrize("arch", ["Qwen3.5", "LFM2"])
def test_per_document_layers_refuse_a_cache_on_a_packed_row(arch):
    """The model's config defaults to use_cache=True: a packed row's documents each read the cache the previous
    one filled (1.5e-3 at Qwen3.5's first linear attention, no error) before the layers refused it."""
    model = tiny_arch(arch, "sdpa").eval()
    run_mixers_per_document(model)
    assert model.config.use_cache
    batch = PaddingFreeCollator(0, return_use_cache=False)(
        [{"input_ids": list(range(3, 16)), "seq_lengths": [6, 7]}]
    )
    with torch.no_grad(), pytest.raises(PackingError, match="got a cache.*use_cache=False"):
        model(**batch)
    report = check_isolation(model)  # without a cache: exact
    assert not report.leaks and max(report.alone_diff) < 1e-5
    with torch.no_grad():  # generation passes its cache into rows without restarts: untouched
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("arch", ["Qwen3.5", "LFM2", "Nemotron-H"])
def test_left_padded_prefill_with_a_cache_runs_as_the_model_does(arch):
    """A left-padded batch whose position_ids a prefill computes from its attention_mask (the pads' positions,
    ``[1, 1, 0, 1, 2]``, do not follow by 1) is not packed: the per-document layers took each pad for a document
    and refused the cache as "a packed row" (before that, ran the documents on one cache: 0.12 off in
    Nemotron-H's logits). Padding starts no document: prepared, the model gives what it gives unprepared."""
    from packtools.integrations.trainers.guard import guard_model

    model = tiny_arch(arch, "sdpa").eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [4, 8, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    inputs = dict(input_ids=ids, attention_mask=mask, position_ids=positions)
    with torch.no_grad():
        plain = {cache: model(**inputs, use_cache=cache).logits for cache in (True, False)}
    run_mixers_per_document(model)
    guard_model(model)
    assert segments_of(inputs) is None and segments_of({"position_ids": positions}) is not None
    with torch.no_grad():
        for cache in (True, False):
            prepared = model(**inputs, use_cache=cache).logits
            assert (prepared - plain[cache])[mask.bool()].abs().max() < 1e-6, cache


def test_alibi_refused_under_packtools_sdpa_and_kept_on_sdpa():
    from packtools.integrations.attention.backends import use_segmented_sdpa
    from packtools.integrations.attention.segmented import register

    register()
    config = transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, alibi=True
    )
    config._attn_implementation = "packtools_sdpa"
    model = transformers.FalconForCausalLM(config)
    with pytest.raises(PackingError, match="ALiBi.*attn_implementation='sdpa'"):
        check_attention_implementation(model)
    model.config._attn_implementation = "sdpa"
    assert not use_segmented_sdpa(model) and model.config._attn_implementation == "sdpa"
    assert not check_isolation(model, backward=True).leaks  # sdpa separates them by position_ids


def test_every_figure_a_refusal_states_is_outside_its_tolerance():
    """A refusal for the gradient alone (logits inside the tolerance) names the gradient, not the logits."""
    model = tiny_llama("eager")
    report = check_isolation(model, backward=True, raise_on_leak=False)
    assert max(report.alone_diff) < report.grad_diff  # float32 rounding: gradients sum more terms
    tol = (max(report.alone_diff) + report.grad_diff) / 2  # the logits inside, the gradient outside
    with pytest.raises(PackingError) as err:
        check_isolation(model, backward=True, atol=tol)
    first = str(err.value).split("\n")[0]
    stated = re.findall(r"(\d\.\d\de[-+]\d\d) > tolerance (\d\.\d\de[-+]\d\d)", first)
    assert stated and all(float(value) > float(limit) for value, limit in stated)
    assert "relative gradient" in first and "logits of a packed sequence" not in first


def test_matrix_dpo_check_exact_for_a_hybrid_and_refused_without_per_document_layers(monkeypatch):
    pytest.importorskip("trl")
    from _scripts import script

    from packtools.testing import family

    matrix = script("model_matrix")  # the program's DPO check, under test
    arch = family("Qwen3.5")
    status, diff = matrix.dpo_check(arch, "sdpa")
    assert status == "exact" and diff < 1e-5
    import packtools.integrations.attention.mixers as mixers

    monkeypatch.setattr(mixers, "token_mixing_layers", lambda model, include_handled=False: [])
    assert matrix.dpo_check(arch, "sdpa") == (
        "refused",
        None,
    )  # control: the whole row leaks, DPO's probe refuses


def test_gemma4_eager_backward_not_refused_for_gradient_rounding():
    """A 6-layer Gemma 4 (eager, logit soft-capping): logits exact to ~1e-6, perturbation exactly 0, gradients
    1.02e-5 relative from float32 rounding over the layers -- isolated, within the backward tolerance."""
    from packtools.integrations.attention.isolation import BACKWARD_FACTOR, TOLERANCE

    config = transformers.Gemma4TextConfig(
        vocab_size=128,
        pad_token_id=0,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128,
        final_logit_softcapping=30.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    report = check_isolation(transformers.Gemma4ForCausalLM(config).float(), backward=True)
    assert report.perturb_diff == 0.0 and not report.leaks
    assert report.grad_diff < TOLERANCE["float32"] * BACKWARD_FACTOR == report.backward_tolerance


@pytest.mark.parametrize("grouped", [False, True])
def test_packtools_sdpa_attention_sinks_per_document_equal_gpt_oss_eager_alone(grouped):
    """packtools_sdpa with s_aux (GPT-OSS's sinks): each document of a padding-free row equals GPT-OSS's own eager
    attention run on it alone, forward and backward; the row without the boundaries (the control) differs."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from packtools.integrations.attention.segmented import segmented_sdpa_forward

    torch.manual_seed(0)
    heads, kv, dim, bounds = 4, 2 if grouped else 4, 8, [0, 5, 12, 15]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = heads // kv, False
    sinks = torch.randn(heads, requires_grad=True)
    module.sinks = sinks  # what GPT-OSS's eager attention reads
    q = torch.randn(1, heads, 15, dim, requires_grad=True)
    k, v = (torch.randn(1, kv, 15, dim, requires_grad=True) for _ in range(2))
    cu = torch.tensor(bounds, dtype=torch.int32)
    out, _ = segmented_sdpa_forward(
        module, q, k, v, None, scaling=0.3, s_aux=sinks, cu_seq_lens_q=cu, cu_seq_lens_k=cu
    )
    alone = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        causal = torch.zeros(b - a, b - a).masked_fill(torch.ones(b - a, b - a).triu(1).bool(), float("-inf"))
        got, _ = eager_attention_forward(
            module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal[None, None], 0.3
        )
        alone.append(got)
    alone = torch.cat(alone, dim=1)
    assert (out - alone).abs().max() < 1e-6
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    want = torch.autograd.grad(alone.square().sum(), (q, k, v, sinks))
    assert max(float((g - w).abs().max()) for g, w in zip(grads, want)) < 1e-5
    whole, _ = segmented_sdpa_forward(
        module, q, k, v, None, scaling=0.3, s_aux=sinks
    )  # no boundaries: one row
    assert (whole[:, 5:] - alone[:, 5:]).abs().max() > 1e-3


def test_lora_wrapped_hybrid_per_document():
    """A PEFT LoRA model (adapters inside the gated DeltaNet's projections): the layers under the wrapper run per
    document, packed equals alone, gradients of the adapters included."""
    peft = pytest.importorskip("peft")
    model = tiny_arch("Qwen3.5", "sdpa")
    lora = peft.LoraConfig(r=4, target_modules=["in_proj_qkv", "q_proj", "out_proj"], lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, lora)
    assert "model.layers.0.linear_attn" in run_mixers_per_document(wrapped).modes
    report = check_isolation(wrapped, backward=True)
    assert not report.leaks and report.grad_diff < 1e-5


@pytest.mark.parametrize(
    "arch, impl", [("Qwen3.5", "sdpa"), ("Nemotron-H", "sdpa"), ("LFM2", "sdpa"), ("GPT-OSS", "eager")]
)
def test_grpo_runs_hybrid_mixers_per_document_equal_trl_padded(tmp_path, arch, impl):
    """prepare_grpo_trainer runs a hybrid's token-mixing layers per document (as prepare_trainer and
    prepare_dpo_trainer do): its padding-free log-probabilities equal TRL's padded ones; unprepare restores them.
    Without it, transformers' CPU fallback refuses the padding-free row ("can't keep packed sequences apart"),
    and GPT-OSS, whose forward builds its masks without position_ids, let the sequences of the row see each
    other (log-probabilities 2.7e-2 off TRL's, with no error under check_isolation=False)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import tokenizers

    from packtools.compat.trl import trl_logps
    from packtools.integrations import unprepare
    from packtools.integrations.rl import prepare_grpo_trainer
    from packtools.integrations.rl.rows import probe_batch

    model = tiny_arch(arch, impl).float()
    words = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"<pad>": 0, "w1": 1, "w2": 2}, unk_token="<pad>")
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="w1"
    )
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
        report_to=[], use_cpu=True, bf16=False, beta=0.0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "w2 w2"}] * 4),
        processing_class=tokenizer,
    )
    layers = token_mixing_layers(model)
    assert layers or arch == "GPT-OSS"
    prepare_grpo_trainer(trainer)  # the isolation probe runs, and passes
    assert document_mixers(model) is not None and token_mixing_layers(model) == []
    plan = trainer.packtools_step  # the default (share_prompt="auto") falls back to plain rows, and says why
    assert not plan.share_prompt and "the prompt cannot be shared" in plan.summary()
    ids, mask, keep = probe_batch(model)
    with torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)[0]
        theirs = trl_logps(trl.GRPOTrainer, trainer, model, ids, mask, keep, compute_entropy=False)[0]
    assert float((ours - theirs).abs().max()) < 1e-5
    unprepare(trainer)
    assert type(trainer) is trl.GRPOTrainer and token_mixing_layers(model) == layers
    assert document_mixers(model) is None


@pytest.mark.parametrize("arch, impl", [("Qwen3.5", "sdpa"), ("Nemotron-H", "sdpa"), ("GPT-OSS", "eager")])
def test_kto_runs_hybrid_mixers_per_document_equal_trl_padded(tmp_path, arch, impl):
    """prepare_kto_trainer runs a hybrid's token-mixing layers per document (as DPO does): one micro-batch's
    loss and gradients equal TRL's padded ones; without it the CPU fallback refuses the padding-free row."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    from packtools.integrations.preference.kto import prepare_kto_trainer

    tokenizer, text = word_tokenizer(), few_words(0)
    rows = [
        {"prompt": text(1 + i % 5), "completion": " " + text(2 + 3 * i % 7), "label": i % 3 != 1}
        for i in range(8)
    ]

    def build():
        torch.manual_seed(0)
        args = trl.KTOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False,
            gradient_checkpointing=False, router_aux_loss_coef=0.0,  # GPT-OSS (MoE): KTO refuses its aux loss
        )  # fmt: skip
        return trl.KTOTrainer(
            tiny_arch(arch, impl).float(),
            ref_model=tiny_arch(arch, impl).float(),
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
        )

    prepared_equals_padded(build(), build(), prepare_kto_trainer, models=("model", "ref_model"))


@pytest.mark.parametrize(
    "arch, impl, head",
    [
        ("Qwen3-Next", "sdpa", "Qwen3NextForSequenceClassification"),
        ("GPT-OSS", "eager", "GptOssForSequenceClassification"),  # masks from position_ids
    ],
)
def test_reward_runs_hybrid_mixers_per_document_equal_trl_padded(tmp_path, arch, impl, head):
    """prepare_reward_trainer runs a hybrid's token-mixing layers per document (as prepare_trainer does): one
    micro-batch's loss and gradients equal TRL's padded ones; without it the CPU fallback refuses the row."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")

    from packtools.integrations.preference.reward import prepare_reward_trainer

    config = tiny_arch(arch, impl).config
    config.num_labels, config.pad_token_id = 1, 0
    tokenizer, text = word_tokenizer(), few_words(0)
    pairs = [{"chosen": text(2 + i % 5), "rejected": text(3 + 2 * i % 7)} for i in range(8)]

    def build():
        torch.manual_seed(0)
        args = trl.RewardConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False,
            gradient_checkpointing=False,
        )  # fmt: skip
        return trl.RewardTrainer(
            getattr(transformers, head)(config).float(),
            args=args,
            train_dataset=datasets.Dataset.from_list(pairs),
            processing_class=tokenizer,
        )

    prepared_equals_padded(build(), build(), prepare_reward_trainer)


def few_words(seed):
    """``text(k)``: k random words of ``w2`` .. ``w11`` (tokens 2..11 of ``word_tokenizer``), as text."""
    rng = np.random.default_rng(seed)
    return lambda k: " ".join(f"w{t}" for t in rng.integers(2, 12, k))


def prepared_equals_padded(padded, prepared, prepare, models=("model",)):
    """``prepare(prepared)`` (its isolation probe runs, and passes) runs the token-mixing layers of the trainer's
    ``models`` per document; one of TRL's padded micro-batches gives the same loss and gradients through both
    trainers; ``unprepare`` gives the layers back."""
    from packtools.integrations import unprepare

    layers = token_mixing_layers(prepared.model)
    prepare(prepared)
    assert all(document_mixers(getattr(prepared, name)) is not None for name in models)
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    assert int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()  # TRL padded this batch
    (want, want_grads), (got, got_grads) = loss_and_grads(padded, batch), loss_and_grads(prepared, batch)
    assert abs(want - got) < 1e-5 * max(1.0, abs(want)) and want_grads.keys() == got_grads.keys()
    assert max(float((want_grads[k] - got_grads[k]).abs().max()) for k in want_grads) < 1e-5
    unprepare(prepared)
    assert token_mixing_layers(prepared.model) == layers and document_mixers(prepared.model) is None


def loss_and_grads(trainer, batch):
    """One micro-batch through the trainer's own compute_loss: the loss and every gradient."""
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch, impl", [("Qwen3.5", "sdpa"), ("Qwen3-Next", "eager"), ("GPT-OSS", "eager")])
def test_documents_longer_than_the_scan_chunk_and_the_window(arch, impl):
    """Documents of several of the gated DeltaNet scan's 64-token chunks (run per document at their own chunk
    size, document_chunk) and far longer than GPT-OSS's 4-token window, beside a 2-token one: packed equals alone
    (logits within 1.2e-7, gradients 2.5e-7, the others moved by 0.0 in the run that added it)."""
    model = tiny_arch(arch, impl)
    run_mixers_per_document(model)
    report = check_isolation(model, lengths=(120, 2, 70, 65), backward=True)
    assert not report.leaks and report.perturb_diff <= report.perturb_tolerance
    assert max(report.alone_diff) < 1e-5 and report.grad_diff < 1e-5 and report.loss_diff < 1e-5
