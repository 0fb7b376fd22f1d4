"""Regressions from the sweep of every causal-LM family transformers 5.25 ships on packtools' padding-free batches
(/tmp/arch45_sweep.py in issue arch45): each test failed before its fix.

- guard_model's first-batch probe: the plain loop of docs/training.md on families whose forward builds masks or
  positions without position_ids (OPT, BLOOM, MPT, ...) trained with every packed sequence attending to the ones
  before it (per-document logits 5e-3 to 0.5 away from each document alone), with no error.
- length-dependent rotary embeddings (longrope, dynamic NTK): frequencies picked from the longest sequence of the
  forward, which the isolation probe's short sequences never reach.
- Doge on packtools' per-sequence sdpa (an AttributeError out of prepare_trainer), RecurrentGemma's decoder layers
  run per document (a shape error: positional position_ids and the row's 4-D mask were passed whole).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packtools import PackingError, PaddingFreeCollator  # noqa: E402
from packtools.integrations.trainers.guard import guard_model  # noqa: E402
from packtools.testing import SMALL  # noqa: E402

ROWS = [[7, 13, 4], [11, 6]]  # two packed rows of 3 and 2 documents
#: packtools.testing's tiny sizes, for the configs that name them like Llama's.
LLAMA_SIZES = {k: v for k, v in SMALL.items() if k != "vocab_size"}
OPT_SIZES = dict(
    hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32
)
#: model class, config class, tiny sizes, backend: families the sweep found silently wrong in the plain loop.
SILENT = {
    "opt-sdpa": ("OPTForCausalLM", "OPTConfig", OPT_SIZES, "sdpa"),
    "opt-eager": ("OPTForCausalLM", "OPTConfig", OPT_SIZES, "eager"),
    "bloom-eager": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4), "eager"),
    "mpt-eager": (
        "MptForCausalLM",
        "MptConfig",
        dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=128),
        "eager",
    ),
}


def build(cls, config_cls, sizes, impl):
    ids = {k: SMALL[k] for k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
    config = getattr(transformers, config_cls)(**{**ids, **sizes})
    torch.manual_seed(0)
    return getattr(transformers, cls)._from_config(config, attn_implementation=impl).float().eval()


def documents(seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(3, 101, size=n) for n in row] for row in ROWS]


def packed_batch(docs):
    rows = [{"input_ids": np.concatenate(r).tolist(), "seq_lengths": [len(d) for d in r]} for r in docs]
    return PaddingFreeCollator(0)(rows)


def gap_to_alone(model, docs, logits):
    """The largest |logit| difference of any document between the packed batch (one flat row) and it alone."""
    worst, start = 0.0, 0
    with torch.no_grad():
        for doc in (d for r in docs for d in r):
            alone = model(input_ids=torch.as_tensor(doc[None]), use_cache=False).logits[0]
            worst = max(worst, float((logits[0, start : start + len(doc)] - alone).abs().max()))
            start += len(doc)
    return worst


@pytest.mark.parametrize("name", sorted(SILENT))
def test_guard_refuses_a_family_that_mixes_packed_documents(name):
    model = build(*SILENT[name])
    docs = documents()
    batch = packed_batch(docs)
    with torch.no_grad():  # negative control: unguarded, the packed documents see each other, with no error
        leaked = model(**batch).logits
    assert gap_to_alone(model, docs, leaked) > 1e-3
    guard_model(model)
    with pytest.raises(PackingError, match=rf"guard_model: the first packed batch.*{SILENT[name][0]}"):
        model(**batch)
    with pytest.raises(PackingError, match="guard_model"):  # refused every time, not only once
        model(**batch)


def test_guard_probes_once_and_isolated_families_stay_exact():
    model = build("LlamaForCausalLM", "LlamaConfig", LLAMA_SIZES, "sdpa")
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    guard_model(model)
    docs = documents()
    batch = packed_batch(docs)
    with torch.no_grad():
        first = model(**batch).logits
    probe_calls = len(calls) - 1
    assert probe_calls > 0  # the first packed batch ran the probe
    with torch.no_grad():
        model(**batch)
    assert len(calls) == probe_calls + 2  # and only the first
    assert gap_to_alone(model, docs, first) < 1e-5


def test_opt_on_segmented_sdpa_is_exact_under_the_guard():
    from packtools.integrations import use_segmented_sdpa

    model = build(*SILENT["opt-sdpa"])
    use_segmented_sdpa(model)  # the fix the refusal names on sdpa
    guard_model(model)
    docs = documents()
    with torch.no_grad():
        logits = model(**packed_batch(docs)).logits
    assert gap_to_alone(model, docs, logits) < 1e-5


def test_torch_compile_after_the_guard_trains_and_the_probe_still_refuses():
    """torch.compile(model) traces the guard's hook: the first packed batch's probe ran inside Dynamo's trace and
    failed there ('Dynamo failed to run FX node' on the probe's numpy), so no compiled model with the default guard
    could take a packed batch; it runs outside the trace now, and still refuses a family that mixes documents."""
    model = build("LlamaForCausalLM", "LlamaConfig", LLAMA_SIZES, "sdpa").train()
    batch = packed_batch(documents())
    torch.manual_seed(0)
    expected = model(**batch).loss
    guard_model(model)
    compiled = torch.compile(model, backend="eager")
    torch.manual_seed(0)
    loss = compiled(**batch).loss
    loss.backward()
    assert torch.allclose(loss, expected, atol=1e-6)
    assert model.training  # the probe compared in eval mode and restored train mode

    opt = build(*SILENT["opt-sdpa"])
    guard_model(opt)
    with pytest.raises(PackingError, match="guard_model: the first packed batch.*OPTForCausalLM"):
        torch.compile(opt, backend="eager")(**batch)


@pytest.mark.slow  # inductor generates and builds C++ for the forward: a minute or more on 2 shared cores
def test_inductor_compiled_model_after_the_guard_equals_eager_and_the_probe_still_refuses():
    """The same with torch.compile's default backend, inductor (the test above uses backend="eager"): the probe,
    kept out of the trace, runs on the first packed batch and refuses OPT; the guarded Llama's compiled packed
    loss equals the eager one (by hand: the training step too, every gradient within 7.5e-8, and Trainer's
    torch_compile=True after prepare_trainer: 5.9e-8 from the eager step)."""
    model = build("LlamaForCausalLM", "LlamaConfig", LLAMA_SIZES, "sdpa").train()
    batch = packed_batch(documents())
    with torch.no_grad():
        expected = model(**batch).loss
    guard_model(model)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            loss = torch.compile(model)(**batch).loss
        assert abs(float(loss) - float(expected)) < 1e-5
        opt = build(*SILENT["opt-sdpa"])
        guard_model(opt)
        with pytest.raises(PackingError, match="guard_model: the first packed batch.*OPTForCausalLM"):
            torch.compile(opt)(**batch)
    finally:
        torch._dynamo.reset()


def test_the_probe_leaves_a_seeded_training_run_with_dropout_unchanged():
    """The first packed batch's probe compares in eval mode and draws no random numbers of torch's: a seeded run with
    attention dropout gives the same losses guarded and unguarded, in train mode throughout."""

    def losses(guarded, seed=1):
        model = build(
            "LlamaForCausalLM", "LlamaConfig", {**LLAMA_SIZES, "attention_dropout": 0.2}, "eager"
        ).train()
        if guarded:
            guard_model(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(seed)
        seen = []
        for step in range(3):
            loss = model(**packed_batch(documents(step))).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seen.append(loss.item())
            assert model.training and all(m.training for m in model.modules())
        return seen

    plain = losses(False)
    assert losses(True) == plain
    assert losses(False, seed=2) != plain  # negative control: dropout draws, so another seed trains otherwise


#: Rotary embeddings whose frequencies transformers picks from the longest sequence of a forward (threshold 10 here;
#: 4096 on Phi-3-mini-128k): the isolation probe's short sequences never reach it.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 10}
ROPES = {
    "phi3-longrope": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            original_max_position_embeddings=10,
            rope_parameters=dict(
                LONGROPE, partial_rotary_factor=0.5, short_factor=[1.0] * 2, long_factor=[4.0] * 2
            ),
        ),
    ),
    "llama-longrope": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(rope_parameters=dict(LONGROPE, short_factor=[1.0] * 4, long_factor=[4.0] * 4)),
    ),
    "llama-dynamic": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            max_position_embeddings=10,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
}


def rope_model(name, impl="sdpa"):
    cls, config_cls, extra = ROPES[name]
    return build(cls, config_cls, {**LLAMA_SIZES, **extra}, impl)


def packed_trainer(model, docs, output_dir):
    """A transformers Trainer on the packed rows of ``docs`` with packtools' collator (the quickstart)."""
    from datasets import Dataset

    rows = {
        "input_ids": [np.concatenate(r).tolist() for r in docs],
        "seq_lengths": [[len(d) for d in r] for r in docs],
    }
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, report_to="none", use_cpu=True, max_steps=1
    )
    return transformers.Trainer(
        model, args, train_dataset=Dataset.from_dict(rows), data_collator=PaddingFreeCollator(0)
    )


@pytest.mark.parametrize("name", sorted(ROPES))
def test_guard_refuses_a_batch_a_length_dependent_rope_would_rotate_wrong(name):
    model = rope_model(name)
    docs = documents()  # documents of 4 to 13 tokens: some over the threshold (10), some not
    batch = packed_batch(docs)
    with torch.no_grad():  # negative control: unguarded, the short documents get the long one's frequencies
        wrong = model(**batch).logits
    assert gap_to_alone(model, docs, wrong) > 1e-5
    guard_model(model)
    with pytest.raises(PackingError, match=r"wrong positions.*max_length <= 10"):
        model(**batch)
    short = [[d[:4] for d in row] for row in docs]  # every document under the threshold: exact, accepted
    with torch.no_grad():
        logits = model(**packed_batch(short)).logits
    assert gap_to_alone(model, short, logits) < 1e-5


def test_a_context_parallel_shard_is_judged_by_its_documents_against_the_ranks_own_positions():
    """Under CP a rank's rotary embedding picks its frequencies from its own max(position_ids): rank 1 of 2 holds
    the middle chunks of a 12-token document (positions 3..8), so longrope rotated them with the short factors where
    the document alone gets the long ones (threshold 10), and the guard saw one run of positions, no packing, and
    let it through; rank 0's head and tail chunks of documents all over the threshold (runs of 3 and 12 tokens)
    were refused, though every token of that rank gets the long factors as alone."""
    from packtools.batches.context_parallel import shard_row
    from packtools.integrations.attention.context_parallel import use_cp_attention
    from packtools.integrations.parallel.shard_loss import model_inputs
    from packtools.integrations.trainers.guard import check_length_dependent_rope, length_dependent_rope

    model = rope_model("phi3-longrope")
    use_cp_attention(model)
    guard_model(model, check_isolation=False)

    def shard(lengths, rank):
        ids = list(range(3, 3 + sum(lengths)))
        cut = shard_row(ids, ids, lengths, 2, rank, 0)
        return model_inputs(
            {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in cut.items()}, model
        )

    middle = shard([12], 1)
    pos = middle["position_ids"]
    assert pos.tolist() == [[3, 4, 5, 6, 7, 8]]
    # negative control: this rank's rotation of those positions is not the document's alone
    cos_rank, _ = model.model.rotary_emb(torch.zeros(1), pos)
    cos_alone, _ = model.model.rotary_emb(torch.zeros(1), torch.arange(12)[None])
    assert float((cos_rank[0] - cos_alone[0, pos[0]]).abs().max()) > 1e-2
    with pytest.raises(
        PackingError, match=r"context-parallel shard of rank 1.*reach 9.*sequence of 12 tokens.*long factors"
    ):
        model(**middle)  # refused in the guard, before any collective
    rope = length_dependent_rope(model)
    with pytest.raises(PackingError, match=r"shard of rank 1 .*every rank of the group refuses"):
        check_length_dependent_rope(rope, shard([12], 0))  # right here, but rank 1 refuses: so does rank 0
    for rank in (0, 1):  # documents all over the threshold: every rank reaches past it
        check_length_dependent_rope(rope, shard([12, 14], rank))
    with pytest.raises(PackingError, match=r"reach 12.*sequence of 4 tokens.*short factors"):
        check_length_dependent_rope(rope, shard([12, 4], 0))


def test_prepare_trainer_refuses_the_longrope_rows_up_front(tmp_path):
    from packtools import prepare_trainer

    trainer = packed_trainer(rope_model("phi3-longrope"), documents(), tmp_path)
    with pytest.raises(  # the dataset's seq_lengths, read before training (tests/test_rope_rows.py)
        PackingError,
        match="prepare_trainer: Phi3ForCausalLM's packed sequences would train with wrong positions",
    ):
        prepare_trainer(trainer)


def test_prepare_trainer_keeps_doge_on_its_own_sdpa(tmp_path):
    """Doge's attention reads the mask tensor itself (``attention_mask.dtype``): on packtools' per-sequence sdpa
    prepare_trainer's probe crashed with an AttributeError from transformers. Now it stays on 'sdpa' (probed) and
    trains each packed document as alone."""
    from packtools import prepare_trainer

    model = build("DogeForCausalLM", "DogeConfig", LLAMA_SIZES, "sdpa")
    docs = documents()
    trainer = packed_trainer(model, docs, tmp_path)
    with pytest.warns(UserWarning, match="DogeForCausalLM cannot run packtools' per-sequence sdpa"):
        prepare_trainer(trainer)
    assert model.config._attn_implementation == "sdpa"
    batch = next(iter(trainer.get_train_dataloader()))
    batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch).logits
    assert gap_to_alone(model.eval(), docs, logits) < 1e-5


def test_recurrent_gemma_layers_run_per_document_exactly():
    from packtools.integrations.attention.mixers import run_mixers_per_document

    sizes = dict(
        LLAMA_SIZES, num_hidden_layers=3, lru_width=32, attention_window_size=4
    )  # recurrent x2, attention
    model = build("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", sizes, "sdpa")
    docs = documents()
    batch = packed_batch(docs)
    with torch.no_grad():  # negative control: its convolutions run the packed row as one sequence
        assert gap_to_alone(model, docs, model(**batch).logits) > 1e-3
    run_mixers_per_document(model)
    guard_model(model)
    with torch.no_grad():
        logits = model(**batch).logits
    assert gap_to_alone(model, docs, logits) < 1e-5


@pytest.mark.slow  # flex_attention compiles on the CPU (~9 s)
def test_recurrent_gemma_on_flex_attention_is_refused_by_name():
    """flex_attention's BlockMask of the packed row cannot be cut to one document (it crashed inside torch)."""
    from packtools.integrations.attention.mixers import run_mixers_per_document

    sizes = dict(LLAMA_SIZES, num_hidden_layers=3, lru_width=32, attention_window_size=4)
    model = build("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", sizes, "flex_attention")
    run_mixers_per_document(model)
    with pytest.raises(PackingError, match="BlockMask attention mask.*'sdpa' or 'eager'"), torch.no_grad():
        model(**packed_batch(documents()))
