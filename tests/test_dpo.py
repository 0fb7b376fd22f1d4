"""TRL's DPOTrainer without padding equals TRL's padded computation: loss, logged metrics and gradients.

Each case builds two trainers from the same seeds: TRL as it is (padded batches) and one prepared by
``prepare_dpo_trainer``.  Both compute the loss of the same pairs; the loss, every metric TRL logs and every
gradient must agree within 1e-5 (fp32 on CPU; TRL's configs default to bf16, which autocasts the reference
model on CPU, so the tests turn it off).  Packed mode is checked the same way against TRL on the pairs of each
packed micro-batch, and gradient accumulation against the whole optimizer step computed at once.
"""

import copy

import numpy as np
import pytest
from _hf_models import (
    PAD,
    VOCAB,
    exact_step_args,
    lora_causal_config,
    loss_metrics_grads,
    text_pairs,
    tiny_preference_model,
    word_tokenizer,
)
from _trl_setup import TOL, datasets, torch, transformers, trl

from packtools import prepare_dpo_trainer
from packtools.batches.preference import PreferenceCollator
from packtools.dpo import pack_preference, sequence_logps
from packtools.errors import PackingError

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
)


def tiny_llama(impl="sdpa", seed=0):
    return tiny_preference_model("llama", impl, seed)


def build(tmp_path, impl="sdpa", ref=True, lora=False, n=12, arch=None, **config):
    peft_config = None
    if lora:
        peft_config = lora_causal_config()
    kwargs = exact_step_args(tmp_path, **config)
    if arch is not None:  # a model of the compatibility matrix (tests/_hf_models.tiny_arch)
        from _hf_models import tiny_arch

        policy, reference = tiny_arch(arch, impl), tiny_arch(arch, impl) if ref else None
    else:
        policy, reference = tiny_llama(impl), tiny_llama(impl, seed=1) if ref else None
    trainer = trl.DPOTrainer(
        policy,
        ref_model=reference,
        args=trl.DPOConfig(**kwargs),
        train_dataset=datasets.Dataset.from_list(text_pairs(n)),
        processing_class=word_tokenizer(),
        peft_config=peft_config,
    )
    if trainer.precompute_ref_logps:
        untie_reference(trainer)
    return trainer


UNTIE = 1.0  # log-prob units; times beta (0.1) a reward margin of 0.1, far above float rounding (~1e-6)


def untie_reference(trainer):
    """Move the precomputed reference log-probs off the policy's, pair by pair.

    Without a reference model TRL precomputes the reference log-probs with the policy itself (LoRA starts as
    the identity), so before any step every reward is 0 up to float rounding and ``rewards/accuracies``
    (``chosen > rejected``, a step function) compares rounding noise: one ulp of a log-prob flips a pair.
    Lowering ``ref_chosen_logps`` of even pairs and ``ref_rejected_logps`` of odd ones by ``UNTIE`` gives even
    pairs the margin ``+beta * UNTIE`` and odd pairs ``-beta * UNTIE``, so the metric is decided, and it says
    whether the columns reached the right pairs: it must be the share of even pairs (``assert_untied``).
    Both trainers of a comparison are built here, so both get the same columns.
    """

    def shift(row, i):
        even = i % 2 == 0
        return {
            "ref_chosen_logps": row["ref_chosen_logps"] - (UNTIE if even else 0.0),
            "ref_rejected_logps": row["ref_rejected_logps"] - (0.0 if even else UNTIE),
        }

    trainer.train_dataset = trainer.train_dataset.map(shift, with_indices=True)


def assert_untied(trainer, result, pairs):
    """With precomputed reference log-probs, ``rewards/accuracies`` before any step is the share of even pairs
    among ``pairs`` (see ``untie_reference``): the columns reached their pairs, and the metric is no tie."""
    if trainer.precompute_ref_logps:
        want = sum(int(i) % 2 == 0 for i in pairs) / len(pairs)
        assert result[1]["rewards/accuracies"] == want, (result[1]["rewards/accuracies"], want, pairs)


def assert_same(a, b, tol=TOL):
    (la, ma, ga), (lb, mb, gb) = a, b
    assert abs(la - lb) < tol, (la, lb)
    assert set(METRICS) <= ma.keys() == mb.keys()
    bad = {k: (ma[k], mb[k]) for k in ma if abs(ma[k] - mb[k]) > tol * max(1.0, abs(ma[k]))}
    assert not bad, bad
    assert ga.keys() == gb.keys() and len(ga) > 0
    worst = max(float((ga[k] - gb[k]).abs().max()) for k in ga)
    assert worst < tol, worst
    assert max(float(g.abs().max()) for g in ga.values()) > 1e-3  # gradients that could differ


class ShapeRecorder:
    """Records the input_ids shape and attention_mask presence of every backbone call."""

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.calls = []
        base.model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.calls.append((tuple(kwargs["input_ids"].shape), kwargs.get("attention_mask") is not None))


CASES = {
    "sigmoid-sdpa": dict(),
    "sigmoid-sdpa-block-mask": dict(segmented_sdpa=False),
    "sigmoid-eager": dict(impl="eager"),
    "precompute_ref_log_probs": dict(ref=False, precompute_ref_log_probs=True),
    "lora": dict(ref=False, lora=True),
    "gradient_checkpointing": dict(gradient_checkpointing=True),
    "ipo": dict(loss_type=["ipo"]),
    "ld_alpha": dict(ld_alpha=0.5),
    "ipo-eager-ld_alpha": dict(impl="eager", loss_type=["ipo"], ld_alpha=0.3),
    "lora-checkpointing-precompute": dict(
        ref=False, lora=True, gradient_checkpointing=True, precompute_ref_log_probs=True
    ),
}


def engage_checkpointing(trainer):
    """Turn on the gradient checkpointing ``args`` ask for: Trainer does it only in ``train()``, and these tests
    call ``compute_loss`` directly, so without this the checkpointing cases would not checkpoint."""
    if not trainer.args.gradient_checkpointing:
        return
    trainer.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
    )
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    assert base.is_gradient_checkpointing


@pytest.mark.parametrize("case", list(CASES))
def test_unpacked_micro_batch_equals_trl_padded(tmp_path, case):
    config = dict(CASES[case])
    segmented = config.pop("segmented_sdpa", True)
    padded = build(tmp_path, **config)
    prepared = prepare_dpo_trainer(build(tmp_path, **config), segmented_sdpa=segmented)
    for trainer in (padded, prepared):
        engage_checkpointing(trainer)
    impl = prepared.model.config._attn_implementation
    assert impl == (
        "packtools_sdpa" if segmented and config.get("impl", "sdpa") == "sdpa" else config.get("impl", "sdpa")
    )
    recorder = ShapeRecorder(prepared.model)
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    want = loss_metrics_grads(padded, batch)
    assert_same(want, loss_metrics_grads(prepared, batch))
    assert_untied(padded, want, range(4))
    real = int(batch["attention_mask"].sum())
    assert real < batch["attention_mask"].numel()  # TRL padded this batch
    assert recorder.calls and all(call == ((1, real), False) for call in recorder.calls)


@pytest.mark.parametrize("arch", ["Qwen3.5", "Nemotron-H"])
def test_hybrid_micro_batch_equals_trl_padded(tmp_path, arch):
    """Hybrid models (gated DeltaNet, Mamba-2): their token-mixing layers run per document on the padding-free
    row (packtools.integrations.attention.mixers), so loss, metrics and gradients equal TRL's padded batch."""
    from packtools.integrations.attention.mixers import document_mixers

    padded = build(tmp_path, arch=arch)
    prepared = prepare_dpo_trainer(build(tmp_path, arch=arch))
    summary = document_mixers(prepared.model).summary()
    assert "per-document" in summary and document_mixers(prepared.ref_model).modes
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    want = loss_metrics_grads(padded, batch)
    assert_same(want, loss_metrics_grads(prepared, batch))


def test_full_training_run_equals_trl(tmp_path):
    """trainer.train() with accumulation: same parameters as TRL's padded run (equal micro-batches)."""
    padded = build(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2)
    prepared = prepare_dpo_trainer(
        build(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2)
    )
    start = {k: p.detach().clone() for k, p in padded.model.named_parameters()}
    padded.train()
    prepared.train()
    pa_, pb = dict(padded.model.named_parameters()), dict(prepared.model.named_parameters())
    assert max(float((pa_[k] - pb[k]).detach().abs().max()) for k in pa_) < TOL
    assert max(float((pa_[k] - start[k]).detach().abs().max()) for k in pa_) > 1e-3


def packed_trainer(tmp_path, max_length=64, **config):
    trainer = build(tmp_path, n=16, **config)
    columns = ["ref_chosen_logps", "ref_rejected_logps"] if trainer.precompute_ref_logps else []
    indexed = trainer.train_dataset.add_column("pair", list(range(len(trainer.train_dataset))))
    packed = pack_preference(indexed, max_length, columns=[*columns, "pair"])
    return prepare_dpo_trainer(trainer, train_dataset=packed), packed


def trl_batch(reference, pairs):
    return reference.data_collator([reference.train_dataset[int(i)] for i in pairs])


@pytest.mark.parametrize("case", ["sigmoid-sdpa", "precompute_ref_log_probs", "ipo-eager-ld_alpha", "lora"])
def test_packed_micro_batch_equals_trl_padded_on_its_pairs(tmp_path, case):
    prepared, packed = packed_trainer(tmp_path, **CASES[case])
    reference = build(tmp_path, n=16, **CASES[case])
    rows = [packed[0], packed[1]]
    pairs = [i for r in rows for i in r["pair"]]
    assert len(pairs) > 2
    batch = prepared.data_collator(rows)
    assert batch["input_ids"].shape[0] == 2 * len(pairs)
    want = loss_metrics_grads(reference, trl_batch(reference, pairs))
    assert_same(want, loss_metrics_grads(prepared, batch))
    assert_untied(reference, want, pairs)


def step_gradients(trainer):
    """Train one optimizer step (SGD, lr 1); return the parameter change (= minus the gradient) and the rows."""
    seen = []
    inner = trainer.data_collator

    def record(features):
        seen.append([list(f["pair"]) for f in features])
        return inner(features)

    trainer.data_collator = record
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    return {k: before[k] - after[k].detach() for k in before}, seen


#: One logged optimizer step over 3 micro-batches of one packed row each (rows of unequal pair counts).
ONE_LOGGED_STEP = dict(
    gradient_accumulation_steps=3,
    per_device_train_batch_size=1,
    max_steps=1,
    logging_strategy="steps",
    logging_steps=1,
    remove_unused_columns=False,
)


def check_step_is_the_whole_step(tmp_path, prepared):
    """Train ``prepared`` one :data:`ONE_LOGGED_STEP` step; check that its micro-batches hold unequal pair
    counts and that its gradient and logged loss are those of all its pairs at once in TRL's padded step.
    Returns ``(TRL trainer, the pairs of each micro-batch, TRL's (loss, metrics, gradients) of all of them)``."""
    step, seen = step_gradients(prepared)
    micro = [[p for row in batch for p in row] for batch in seen[:3]]  # accelerate fetches one batch ahead
    assert len(seen) >= 3 and len({len(m) for m in micro}) > 1, micro  # unequal micro-batches
    reference = build(tmp_path, n=16)
    whole = loss_metrics_grads(reference, trl_batch(reference, [p for m in micro for p in m]))
    assert max(float((step[k] - whole[2][k]).abs().max()) for k in whole[2]) < TOL
    assert abs(prepared.state.log_history[0]["loss"] - whole[0]) < 1e-4
    return reference, micro, whole


def test_accumulation_is_the_mean_over_all_pairs_of_the_step(tmp_path):
    """Micro-batches of unequal pair counts: the step's gradient is that of all its pairs at once (TRL padded),
    and the logged loss is their mean.  Negative control: TRL's per-micro-batch mean differs."""
    prepared, _ = packed_trainer(tmp_path, max_length=64, **ONE_LOGGED_STEP)
    reference, micro, whole = check_step_is_the_whole_step(tmp_path, prepared)
    per_micro = np.mean([loss_metrics_grads(reference, trl_batch(reference, m))[0] for m in micro])
    assert abs(per_micro - whole[0]) > 1e-3  # what TRL alone would have optimized


def test_logged_metrics_are_those_of_all_pairs_of_the_step(tmp_path):
    """Micro-batches of unequal pair counts (packed rows of 2, 2 and 1 pairs): the logged rewards, log-probs,
    logits, entropy and accuracy are TRL's over all the step's pairs at once.  On main they were means of the
    micro-batches' means, each pair of the 1-pair row weighing twice (rewards/margins 0.0437 for 0.0230)."""
    prepared, _ = packed_trainer(tmp_path, max_length=64, **ONE_LOGGED_STEP)
    _, _, whole = check_step_is_the_whole_step(tmp_path, prepared)
    logged = prepared.state.log_history[0]
    bad = {
        k: (logged[k], whole[1][k])
        for k in METRICS
        if abs(logged[k] - whole[1][k]) > TOL * max(1.0, abs(whole[1][k]))
    }
    assert not bad, bad


def test_sequence_logps_is_exact_per_sequence_and_off_by_one_fails():
    model = tiny_llama()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(2, VOCAB, int(n)).tolist() for n in rng.integers(2, 12, 6)]
    masks = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in seqs]
    collator = PreferenceCollator(PAD)
    row = {
        "input_ids": sum(seqs, []),
        "completion_mask": sum(masks, []),
        "seq_lengths": [len(s) for s in seqs],
    }
    batch = collator([row])
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits
        out = sequence_logps(logits, batch["labels"], batch["cu_seq_lens_q"])
        alone, counts = [], []
        for s, m in zip(seqs, masks):
            lp = model(input_ids=torch.tensor([s])).logits[0, :-1].float().log_softmax(-1)
            picked = lp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
            keep = torch.tensor(m[1:]).bool()
            alone.append(float(picked[keep].sum()))
            counts.append(int(keep.sum()))
        per_token = torch.zeros_like(batch["labels"], dtype=torch.float32)
        per_token[0, 1:] = logits[0, :-1].log_softmax(-1).gather(-1, batch["input_ids"][0, 1:, None])[:, 0]
        from_logprobs = sequence_logps(per_token, batch["labels"], batch["cu_seq_lens_q"])
    assert np.allclose(out.logps.numpy(), alone, atol=TOL) and out.tokens.tolist() == counts
    assert np.allclose(from_logprobs.logps.numpy(), alone, atol=TOL)
    chosen_rejected, tokens = out.pairs()
    assert chosen_rejected.shape == (3, 2) and tokens[:, 1].tolist() == counts[1::2]
    shifted = batch["cu_seq_lens_q"].clone()
    shifted[2] -= 1  # a boundary off by one: the last completion token of sequence 1 moves to sequence 2
    wrong = sequence_logps(logits, batch["labels"], shifted).logps.numpy()
    assert np.abs(wrong - np.array(alone)).max() > 1e-3
    labels_across = batch["labels"].clone()
    labels_across[0, batch["cu_seq_lens_q"][1:-1].long()] = batch["input_ids"][
        0, batch["cu_seq_lens_q"][1:-1].long()
    ]
    across = sequence_logps(
        logits, labels_across, batch["cu_seq_lens_q"]
    )  # a start's label is never a target
    assert torch.equal(across.logps, out.logps)


def test_sequence_logps_refuses_bad_boundaries():
    logits = torch.zeros(1, 5, 4)
    labels = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(PackingError, match="end at the 5 tokens"):
        sequence_logps(logits, labels, torch.tensor([0, 3]))
    with pytest.raises(PackingError, match="strictly increasing"):
        sequence_logps(logits, labels, torch.tensor([0, 3, 3, 5]))
    with pytest.raises(PackingError, match="do not form pairs"):
        sequence_logps(logits, labels, torch.tensor([0, 2, 3, 5])).pairs()


def test_guards(tmp_path):
    trainer = build(tmp_path)
    trainer.model.config._attn_implementation = "paged|eager"
    with pytest.raises(PackingError, match="cannot keep packed sequences apart"):
        prepare_dpo_trainer(trainer)
    trainer = prepare_dpo_trainer(build(tmp_path))
    assert "_packtools_guard" in vars(trainer.model) and "_packtools_guard" in vars(trainer.ref_model)
    with pytest.raises(PackingError, match="already called"):
        prepare_dpo_trainer(trainer)
    with pytest.raises(PackingError, match="expects a trl.DPOTrainer"):
        prepare_dpo_trainer(copy.copy(transformers.Trainer))
    with pytest.raises(PackingError, match="lacks"):
        prepare_dpo_trainer(build(tmp_path), train_dataset=datasets.Dataset.from_dict({"input_ids": [[1]]}))
    left = {
        "input_ids": torch.tensor([[0, 5, 6]]),
        "attention_mask": torch.tensor([[0, 1, 1]]),
        "labels": torch.tensor([[-100, 5, 6]]),
    }
    with pytest.raises(PackingError, match="not right-padded"):
        trainer.model(**left, fused_lm_head=True)


@pytest.mark.slow
def test_bench_dpo_runs_the_same_pairs_and_packtools_sees_only_real_tokens(capsys):
    from _scripts import script

    bench = script("bench_dpo")
    rows, (seconds, report), peaks = bench.main(
        ["--pairs", "16", "--pairs-per-step", "4", "--steps", "2", "--hidden", "64", "--pack-pairs", "3000"]
        + ["--peak-rss"]
    )
    # Each variant ran its steps in its own process and reported the resident memory they added.
    assert list(peaks) == ["TRL padded", "packtools", "block mask"]
    assert all(0 <= mib < 4096 for mib in peaks.values())
    assert [r[0] for r in rows] == ["TRL padded", "packtools", "block mask"]
    assert rows[0][2] > 1.0 and rows[1][2] == rows[2][2] == 1.0
    assert report.pairs_out == 3000 and report.rows >= report.lower_bound


@pytest.mark.parametrize("packed", [False, True])
def test_evaluate_equals_trl(tmp_path, packed):
    """evaluate() on a text eval set: TRL's one-pair rows still work (packed mode keeps TRL's collator for them)."""
    eval_set = datasets.Dataset.from_list(text_pairs(6, seed=9))
    reference = build(tmp_path, n=16, per_device_eval_batch_size=3).evaluate(eval_set)
    if packed:
        prepared, _ = packed_trainer(tmp_path, per_device_eval_batch_size=3)
    else:
        prepared = prepare_dpo_trainer(build(tmp_path, n=16, per_device_eval_batch_size=3))
    got = prepared.evaluate(eval_set)
    keys = [k for k in reference if k.startswith("eval_") and "runtime" not in k and "per_second" not in k]
    assert "eval_rewards/margins" in keys and "eval_loss" in keys
    assert all(abs(reference[k] - got[k]) < TOL for k in keys), {k: (reference[k], got[k]) for k in keys}


def test_prepare_dpo_trainer_runs_the_isolation_probe(tmp_path, monkeypatch):
    """A reference model whose packed sequences leak (a hybrid on CPU with its token-mixing layers left over the
    whole row: packtools' per-document layers switched off here) is refused before training."""
    from _hf_models import tiny_arch

    import packtools.integrations.preference.dpo as trl_module

    monkeypatch.setattr(trl_module, "run_mixers_per_document", lambda model, owner=None: None)
    trainer = build(tmp_path)
    trainer.ref_model = tiny_arch("Falcon-H1", "sdpa")
    with pytest.raises(PackingError, match="FalconH1ForCausalLM with attn_implementation='sdpa' cannot keep"):
        prepare_dpo_trainer(trainer)
    # A refused trainer is left as it came: no model stays on packtools' per-sequence sdpa.
    assert (
        trainer.model.config._attn_implementation == trainer.ref_model.config._attn_implementation == "sdpa"
    )
    trainer = build(tmp_path)
    trainer.ref_model = tiny_arch("Falcon-H1", "sdpa")
    # Without the probe the next check speaks: this ref model was not built by DPOTrainer (no fused head).
    with pytest.raises(PackingError, match="no fused LM head"):
        prepare_dpo_trainer(trainer, check_isolation=False)


def test_neftune_is_refused_by_name(tmp_path):
    """NEFTune's noise shrinks with the width of the batch the embeddings see, which padding-free rows change."""
    trainer = build(tmp_path, neftune_noise_alpha=5.0)
    with pytest.raises(
        PackingError, match=r"neftune_noise_alpha=5.0: .*do not call prepare_dpo_trainer"
    ) as err:
        prepare_dpo_trainer(trainer)
    assert err.value.param == "neftune_noise_alpha"


def test_several_gpus_in_one_process_are_refused_by_name(tmp_path):
    """``args.n_gpu > 1`` (torch.nn.DataParallel) is refused as by prepare_trainer, the message naming the
    prepare_* that refused it (it named none)."""
    trainer = build(tmp_path)
    trainer.args._n_gpu = 2
    with pytest.raises(PackingError, match=r"prepare_dpo_trainer: n_gpu=2.*DataParallel.*torchrun"):
        prepare_dpo_trainer(trainer)
    assert type(trainer) is trl.DPOTrainer
