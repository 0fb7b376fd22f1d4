"""packtools' per-sequence sdpa (``packtools_sdpa``) equals transformers' sdpa with the block-diagonal mask.

Forward and backward, on a flat padding-free row with a one-token sequence, with grouped-query attention,
with a sliding window (the diagonal blocks of the mask are used, not a plain causal triangle), and through
transformers' own sdpa on every call that is not one padding-free row.  Negative controls: a boundary off by
one and a backend that ignores the boundaries both change the result, and prepare_dpo_trainer refuses the
latter, naming it.
"""

import json

import pytest
from _hf_models import tiny_arch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packtools import PaddingFreeCollator  # noqa: E402
from packtools.errors import PackingError  # noqa: E402
from packtools.integrations import check_isolation, use_segmented_sdpa  # noqa: E402
from packtools.integrations.attention import segmented  # noqa: E402

LENGTHS = [5, 1, 9, 3, 12]
VOCAB = 61


def flat_batch(lengths=LENGTHS, seed=0, shift=0):
    """One padding-free row; ``shift`` moves the third boundary of cu_seq_lens (a negative control)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (1, sum(lengths)), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    if shift:
        cu = cu.clone()
        cu[3] += shift
    longest = max(lengths)
    return dict(
        input_ids=ids,
        position_ids=positions,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
        use_cache=False,
    )


def logits_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch).logits
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def same_model_two_backends(kind, batch):
    model = tiny_arch(kind)
    block_mask = logits_and_grads(model, batch)
    model.set_attn_implementation(segmented.register())
    calls = []
    real = segmented._segments_apply

    def spy(*args):
        calls.append(real(*args))
        return calls[-1]

    segmented._segments_apply = spy
    try:
        ours = logits_and_grads(model, batch)
    finally:
        segmented._segments_apply = real
    return block_mask, ours, calls


def worst(a, b):
    (la, ga), (lb, gb) = a, b
    assert ga.keys() == gb.keys() and ga
    return max(float((la - lb).abs().max()), max(float((ga[k] - gb[k]).abs().max()) for k in ga))


@pytest.mark.parametrize("kind", ["Llama", "Mistral"])
def test_equals_sdpa_with_the_block_diagonal_mask_forward_and_backward(kind):
    block_mask, ours, calls = same_model_two_backends(kind, flat_batch())
    assert calls and all(bounds is not None for bounds in calls)  # every layer ran per sequence
    assert worst(block_mask, ours) < 1e-5


def test_sliding_window_is_kept():
    """Mistral's window of 4 tokens matters here: dropping it (a plain causal block) would change the logits."""
    batch = flat_batch()
    windowed = tiny_arch("Mistral")
    windowed.set_attn_implementation(segmented.register())
    unwindowed = tiny_arch("Mistral")
    unwindowed.config.sliding_window = None
    unwindowed.set_attn_implementation(segmented.register())
    a, b = windowed(**batch).logits, unwindowed(**batch).logits
    assert float((a - b).abs().max()) > 1e-3
    assert (
        worst(same_model_two_backends("Mistral", batch)[0], same_model_two_backends("Mistral", batch)[1])
        < 1e-5
    )


def test_each_sequence_equals_it_alone():
    model = tiny_arch("Llama")
    model.set_attn_implementation(segmented.register())
    report = check_isolation(model, PaddingFreeCollator(0), lengths=(5, 2, 9, 3), backward=True)
    assert not report.leaks and report.max_diff < 1e-5 and report.grad_diff < 1e-5


def test_boundary_off_by_one_changes_the_result():
    """Negative control: the per-sequence runs follow cu_seq_lens, so a wrong boundary shows."""
    model = tiny_arch("Llama")
    model.set_attn_implementation(segmented.register())
    right = model(**flat_batch()).logits
    wrong = model(**flat_batch(shift=-1)).logits  # the 9-token sequence loses its last token's keys
    assert float((right - wrong).abs().max()) > 1e-3


def test_other_calls_go_to_transformers_sdpa_unchanged():
    """Padded batches with an attention_mask, rows without cu_seq_lens, several rows: plain sdpa, bit for bit."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 7), generator=g)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    sdpa = tiny_arch("Llama")
    ours = tiny_arch("Llama")
    ours.set_attn_implementation(segmented.register())
    for kwargs in (dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids[:1])):
        assert torch.equal(sdpa(**kwargs).logits, ours(**kwargs).logits)
    batch = flat_batch()
    del batch["cu_seq_lens_q"], batch["cu_seq_lens_k"], batch["max_length_q"], batch["max_length_k"]
    assert torch.equal(sdpa(**batch).logits, ours(**batch).logits)  # position_ids alone: sdpa's mask


def test_generation_with_a_cache_is_unchanged():
    sdpa, ours = tiny_arch("Llama"), tiny_arch("Llama")
    ours.set_attn_implementation(segmented.register())
    prompt = torch.tensor([[5, 6, 7, 8]])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(sdpa.generate(prompt, **kwargs), ours.generate(prompt, **kwargs))


def test_use_segmented_sdpa_switches_only_sdpa_and_is_not_saved(tmp_path):
    eager = tiny_arch("Llama", "eager")
    assert not use_segmented_sdpa(eager) and eager.config._attn_implementation == "eager"
    model = tiny_arch("Llama")
    assert use_segmented_sdpa(model) and model.config._attn_implementation == "packtools_sdpa"
    assert not use_segmented_sdpa(model)  # already switched
    # Falcon routes attention through transformers' interface from 5.25 on; before, it kept its own sdpa.
    # Either way use_segmented_sdpa's answer must match what the model runs, and a switched model must be exact.
    config = transformers.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    falcon, reference = (
        transformers.FalconForCausalLM(config).eval(),
        transformers.FalconForCausalLM(config).eval(),
    )
    reference.load_state_dict(falcon.state_dict())
    switched = use_segmented_sdpa(falcon)
    assert falcon.config._attn_implementation == ("packtools_sdpa" if switched else "sdpa")
    if switched:
        with torch.no_grad():
            assert torch.allclose(falcon(**flat_batch()).logits, reference(**flat_batch()).logits, atol=1e-6)
        assert not check_isolation(falcon).leaks
    # A model whose switch does not take keeps its backend, and use_segmented_sdpa says it did not switch.
    stubborn = tiny_arch("Llama")
    stubborn.set_attn_implementation = lambda name: None
    assert not use_segmented_sdpa(stubborn) and stubborn.config._attn_implementation == "sdpa"
    model.config.save_pretrained(tmp_path)
    assert "packtools_sdpa" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_prepare_dpo_trainer_refuses_a_per_sequence_backend_that_leaks(monkeypatch, tmp_path):
    """If packtools_sdpa leaked where sdpa does not, prepare_dpo_trainer says so and switches the models back."""
    pytest.importorskip("trl")
    from test_dpo import build
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from packtools import prepare_dpo_trainer

    def whole_row(module, query, key, value, attention_mask, **kwargs):  # ignores mask and boundaries
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)

    segmented.register()
    monkeypatch.setitem(AttentionInterface._global_mapping, segmented.SEGMENTED_SDPA, whole_row)
    trainer = build(tmp_path)
    with pytest.raises(PackingError, match="per-sequence sdpa .'packtools_sdpa'. let packed sequences"):
        prepare_dpo_trainer(trainer)
    assert (
        trainer.model.config._attn_implementation == trainer.ref_model.config._attn_implementation == "sdpa"
    )
    monkeypatch.undo()
    prepare_dpo_trainer(trainer, segmented_sdpa=False)  # the model itself is fine with sdpa


def test_boundaries_changed_in_place_are_followed():
    """The per-forward cache of cu_seq_lens is keyed on the tensor's version: an in-place change is seen."""
    model = tiny_arch("Llama")
    model.set_attn_implementation(segmented.register())
    batch = flat_batch()
    first = model(**batch).logits
    moved = flat_batch(shift=-1)
    batch["cu_seq_lens_q"].copy_(moved["cu_seq_lens_q"])  # the same tensor object, new boundaries
    batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"]
    again = model(**batch).logits
    fresh = model(**moved).logits
    assert torch.equal(again, fresh) and float((again - first).abs().max()) > 1e-3


def test_inference_mode_and_masks_not_kept_alive(monkeypatch):
    import gc
    import weakref

    made = []
    real_init = segmented.DocumentMask.__init__

    def spy(self, arguments):
        real_init(self, arguments)
        made.append(weakref.ref(self))

    monkeypatch.setattr(segmented.DocumentMask, "__init__", spy)
    model = tiny_arch("Mistral")  # sliding window: the documents' blocks are checked and their kinds cached
    model.set_attn_implementation(segmented.register())
    batch = flat_batch()
    with torch.inference_mode():  # inference tensors have no version counter: still exact
        inferred = model(**batch).logits
    with torch.no_grad():
        plain = model(**batch).logits
    assert torch.equal(inferred, plain)
    gc.collect()
    assert made and all(ref() is None for ref in made)  # one lazy mask per forward, gone with it
    # A 4-D mask tensor passed by the caller: its blocks' kinds are cached weakly too.
    mask = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool).tril() for n in LENGTHS])[None, None]
    with torch.no_grad():
        given = model(**batch, attention_mask=mask).logits
    del mask
    gc.collect()
    assert segmented._BLOCK_KINDS and all(entry[0]() is None for entry in segmented._BLOCK_KINDS.values())
    assert given.shape == plain.shape


def test_padding_free_forward_builds_no_row_by_row_mask(monkeypatch):
    """The mask function of packtools_sdpa builds nothing for a padding-free row (F9): sdpa_mask is never called
    over the whole row, only over each document's block when it is not plain causal (Mistral's window); the
    result equals transformers' sdpa with its block-diagonal mask (tested above)."""
    from transformers import masking_utils

    calls = []
    real = masking_utils.sdpa_mask

    def spy(**arguments):
        calls.append((arguments["q_length"], arguments["kv_length"]))
        return real(**arguments)

    monkeypatch.setattr(segmented, "_FUNCTIONS", (*segmented._functions()[:3], spy))
    total = sum(LENGTHS)
    for kind in ("Llama", "Mistral"):
        calls.clear()
        model = tiny_arch(kind)
        model.set_attn_implementation(segmented.register())
        with torch.no_grad():
            model(**flat_batch())
        assert calls and all(q == k and q in LENGTHS for q, k in calls)
        if kind == "Llama":  # every block plain causal: each built once, to check it, then plain is_causal
            assert calls == [(n, n) for n in LENGTHS]
    # Without cu_seq_lens the call goes to transformers' sdpa, which needs the whole mask: built once.
    calls.clear()
    batch = flat_batch()
    del batch["cu_seq_lens_q"], batch["cu_seq_lens_k"], batch["max_length_q"], batch["max_length_k"]
    with torch.no_grad():
        model = tiny_arch("Llama")
        model.set_attn_implementation(segmented.register())
        model(**batch)
    assert calls == [(total, total)]


def test_no_grad_output_equals_the_autograd_one_and_keys_are_never_repeated_over_the_row(monkeypatch):
    """Grouped keys/values go to sdpa as they are (its own GQA) where the block is plain causal, and are repeated
    per document, never over the whole row, where it is not (Mistral's window).  Without autograd each document's
    output is written into one buffer (no concatenation, no transposed copy): the same numbers, bit for bit, as
    the autograd path, and within float rounding of transformers' sdpa with the block-diagonal mask."""
    repeated = []
    torch_, forward, repeat_kv, mask = segmented._functions()

    def spy(hidden, groups):
        repeated.append(hidden.shape[2])
        return repeat_kv(hidden, groups)

    monkeypatch.setattr(segmented, "_FUNCTIONS", (torch_, forward, spy, mask))
    batch = flat_batch()
    for kind in ("Llama", "Mistral"):
        repeated.clear()
        reference = tiny_arch(kind)
        assert reference.config.num_key_value_heads < reference.config.num_attention_heads
        with torch.no_grad():
            expected = reference(**batch).logits
        model = tiny_arch(kind)
        model.set_attn_implementation(segmented.register())
        with torch.no_grad():
            buffered = model(**batch).logits
        tracked = model(**batch).logits
        assert tracked.requires_grad and torch.equal(buffered, tracked.detach())
        assert float((buffered - expected).abs().max()) < 1e-5
        if kind == "Llama":
            assert repeated == []
        else:
            assert repeated and all(n in LENGTHS for n in repeated)


def sgd_step(model, batch, lr=0.5):
    """One SGD step on the summed next-token loss of ``batch``; returns the new parameters."""
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return {k: p.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.slow
def test_compiled_training_step_equals_the_eager_step(monkeypatch):
    """torch.compile of a packtools_sdpa model: while Dynamo traces, every call goes to transformers' sdpa with the
    block-diagonal mask (the per-sequence loop would read the boundaries to the host: a graph break per layer and a
    recompile per set of boundaries), so the step compiles to one graph and equals the eager step.

    backend="aot_eager": Dynamo and AOT autograd, what a graph break or a host read would trip; inductor's C++
    code generation adds nothing here and takes minutes on this 2-core machine.
    """
    import copy

    from _hf_models import tiny_llama

    rows = [
        {"input_ids": list(range(2, 14)), "seq_lengths": [5, 7]},
        {"input_ids": [30, 31, 32], "seq_lengths": [3]},
    ]
    batch = dict(PaddingFreeCollator(0)(rows), use_cache=False)
    model = tiny_llama("sdpa")
    assert use_segmented_sdpa(model)
    unpacked = copy.deepcopy(model)
    compiled_model = copy.deepcopy(model)
    eager = sgd_step(model, batch)
    torch._dynamo.reset()
    segmented._LAST_BOUNDS = ()
    sgd_step(torch.compile(compiled_model, backend="aot_eager", fullgraph=True), batch)  # no graph break
    assert segmented._LAST_BOUNDS == ()  # the compiled graph never read the boundaries to the host
    assert max(float((eager[k] - p).abs().max()) for k, p in compiled_model.named_parameters()) < 1e-5
    # Negative controls: the same rows with their sequences merged (no seq_lengths) move the weights elsewhere,
    # so the comparison above can fail; and the per-sequence loop under Dynamo breaks the graph.
    merged_rows = [{"input_ids": r["input_ids"]} for r in rows]
    merged = dict(PaddingFreeCollator(0, unpacked=True)(merged_rows), use_cache=False)
    wrong = sgd_step(unpacked, merged)
    assert max(float((eager[k] - wrong[k]).abs().max()) for k in eager) > 1e-3
    torch._dynamo.reset()
    monkeypatch.setattr(segmented, "_compiling", lambda torch: False)
    with pytest.raises(Exception, match="(?i)data.dependent|graph break|local_scalar_dense"):
        torch.compile(copy.deepcopy(unpacked), backend="aot_eager", fullgraph=True)(**batch)
    torch._dynamo.reset()


def test_attention_functions_are_found_by_their_module_and_name():
    """The per-sequence sdpa, the tree and the CP attention functions (written by segmented.attention_function)
    are found where they are defined, as pickle (a spawned process, a saved object) and docs look them up."""
    import importlib
    import pickle

    from packtools.integrations.attention import context_parallel, tree

    for module, name in (
        (segmented, "segmented_sdpa_forward"),
        (tree, "tree_attention_forward"),
        (context_parallel, "cp_attention_forward"),
    ):
        fn = getattr(module, name)
        assert (fn.__module__, fn.__qualname__) == (module.__name__, name)
        assert getattr(importlib.import_module(fn.__module__), fn.__qualname__) is fn
        assert pickle.loads(pickle.dumps(fn)) is fn
