"""TRL's KTOTrainer without padding equals TRL's padded step: loss, logged metrics and every gradient.

Two trainers from the same seeds, TRL's as it is and one prepared by ``prepare_kto_trainer`` (every forward of
a micro-batch -- completions, the KL term's mismatched sequences, the reference -- one padding-free row), on
tiny Llama and Qwen3 causal LMs in fp32 on CPU; loss, metrics and gradients must agree within 1e-5.  Negative
control: sequences of a row attending each other (one merged sequence per two) must differ from TRL.
"""

import numpy as np
import pytest
from _hf_models import (
    exact_step_args,
    lora_causal_config,
    loss_metrics_grads,
    random_words,
    tiny_preference_model,
    word_tokenizer,
)
from _trl_setup import TOL, datasets, torch, trl

from packtools import prepare_trainer
from packtools.errors import PackingError
from packtools.integrations import unprepare
from packtools.integrations.preference.kto import prepare_kto_trainer

METRICS = (
    "kl",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "rewards/chosen",
    "logps/chosen",
    "num_tokens",
)


def tiny_lm(family="llama", impl="sdpa", seed=0):
    return tiny_preference_model(family, impl, seed)


def examples(n, seed=0):
    rng = np.random.default_rng(seed)
    words = random_words(rng)
    return [
        {
            "prompt": words(int(rng.integers(1, 9))),
            "completion": " " + words(int(rng.integers(1, 15))),
            "label": bool(i % 3 != 1),
        }
        for i in range(n)
    ]


def build(tmp_path, family="llama", impl="sdpa", ref=True, lora=False, n=12, **config):
    peft_config = None
    if lora:
        peft_config = lora_causal_config()
    kwargs = exact_step_args(tmp_path, **config)
    return trl.KTOTrainer(
        tiny_lm(family, impl),
        ref_model=tiny_lm(family, impl, seed=1) if ref else None,
        args=trl.KTOConfig(**kwargs),
        train_dataset=datasets.Dataset.from_list(examples(n)),
        processing_class=word_tokenizer(),
        peft_config=peft_config,
    )


def assert_same(a, b, tol=TOL):
    (la, ma, ga), (lb, mb, gb) = a, b
    assert abs(la - lb) <= tol * max(1.0, abs(la)), (la, lb)
    assert ma.keys() == mb.keys()
    bad = {k: (ma[k], mb[k]) for k in ma if abs(ma[k] - mb[k]) > tol * max(1.0, abs(ma[k]))}
    assert not bad, bad
    assert ga.keys() == gb.keys() and len(ga) > 0
    worst = max(float((ga[k] - gb[k]).abs().max()) / max(1.0, float(ga[k].abs().max())) for k in ga)
    assert worst < tol, worst
    assert max(float(g.abs().max()) for g in ga.values()) > 1e-4  # gradients that could differ


class ShapeRecorder:
    """The input_ids shape and attention_mask presence of every backbone call of a model."""

    def __init__(self, *models):
        self.calls = []
        for model in models:
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        self.calls.append((tuple(ids.shape), kwargs.get("attention_mask") is not None))


CASES = {
    "kto-llama": dict(),
    "kto-qwen3": dict(family="qwen3"),
    "kto-eager-weights": dict(impl="eager", desirable_weight=1.3, undesirable_weight=0.7),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired"),
    "precompute_ref_log_probs": dict(ref=False, precompute_ref_log_probs=True),
    "lora": dict(ref=False, lora=True),
    "qwen3-checkpointing": dict(family="qwen3", gradient_checkpointing=True),
    "llama-no-checkpointing": dict(gradient_checkpointing=False),  # KTOConfig's default is True
}


@pytest.mark.parametrize("case", list(CASES))
def test_micro_batch_equals_trl_padded(tmp_path, case):
    config = CASES[case]
    padded = build(tmp_path, **config)
    prepared = prepare_kto_trainer(build(tmp_path, **config))
    for trainer in (padded, prepared):
        if trainer.args.gradient_checkpointing:
            trainer.model.gradient_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)
    models = [m for m in (prepared.model, prepared.ref_model) if m is not None]
    recorder = ShapeRecorder(*models)
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    want = loss_metrics_grads(padded, batch)
    assert set(METRICS[1:]) <= want[1].keys()
    assert ("KL_input_ids" in batch) == (config.get("loss_type", "kto") == "kto")  # the KL term is estimated
    assert_same(want, loss_metrics_grads(prepared, batch))
    real = int(batch["attention_mask"].sum())
    assert real < batch["attention_mask"].numel()  # TRL padded this batch
    assert recorder.calls and all(shape[0] == 1 and not mask for shape, mask in recorder.calls)
    assert ((1, real), False) in recorder.calls  # the completions
    if "KL_attention_mask" in batch:  # the KL term's mismatched sequences, one row too
        assert ((1, int(batch["KL_attention_mask"].sum())), False) in recorder.calls


@pytest.mark.slow
def test_training_with_accumulation_equals_trl(tmp_path):
    config = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2)
    padded = build(tmp_path, **config)
    prepared = prepare_kto_trainer(build(tmp_path, **config))
    start = {k: p.detach().clone() for k, p in padded.model.named_parameters()}
    padded.train()
    prepared.train()
    pa_, pb = dict(padded.model.named_parameters()), dict(prepared.model.named_parameters())
    moved = {k: (pa_[k] - start[k]).detach() for k in pa_}
    num = sum(float((pb[k].detach() - start[k] - moved[k]).pow(2).sum()) for k in pa_)
    assert (num / sum(float(m.pow(2).sum()) for m in moved.values())) ** 0.5 < TOL
    assert max(float(m.abs().max()) for m in moved.values()) > 1e-3


def test_negative_control_sequences_attending_each_other_differ(tmp_path):
    """The same padding-free rows with their sequence boundaries erased (one causal sequence per row): every
    completion and KL sequence sees the ones before it, and the step is no longer TRL's."""
    padded = build(tmp_path)
    prepared = prepare_kto_trainer(build(tmp_path))
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    want = loss_metrics_grads(padded, batch)

    def one_sequence(module, args, kwargs):
        n = kwargs["position_ids"].shape[1]
        kwargs["position_ids"] = torch.arange(n)[None]
        kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = torch.tensor([0, n], dtype=torch.int32)
        kwargs["max_length_q"] = kwargs["max_length_k"] = n
        return args, kwargs

    for model in (prepared.model, prepared.ref_model):
        model.model.register_forward_pre_hook(one_sequence, with_kwargs=True)
    with pytest.raises(AssertionError):
        assert_same(want, loss_metrics_grads(prepared, batch))


def test_unprepare_and_refusals(tmp_path):
    trainer = build(tmp_path)
    forward = vars(trainer.model)["forward"]
    with pytest.raises(PackingError, match="prepare_kto_trainer"):
        prepare_trainer(trainer)
    prepare_kto_trainer(trainer)
    assert vars(trainer.model)["forward"] is not forward
    assert trainer.model.config._attn_implementation == "packtools_sdpa"
    with pytest.raises(PackingError, match="already called"):
        prepare_kto_trainer(trainer)
    unprepare(trainer)
    assert vars(trainer.model)["forward"] is forward
    assert trainer.model.config._attn_implementation == "sdpa"
    trainer.aux_loss_enabled = True
    with pytest.raises(PackingError, match="router auxiliary loss"):
        prepare_kto_trainer(trainer)
    with pytest.raises(PackingError, match="expects a trl.KTOTrainer"):
        prepare_kto_trainer(object())


def test_prepared_block_dispatches_kto_trainers(tmp_path):
    """``with prepared(trainer)`` on a KTOTrainer: prepare_kto_trainer (its models' forwards padding-free), undone after."""
    from packtools.integrations import prepared
    from packtools.integrations.attention.backends import base_model
    from packtools.integrations.preference import kto

    trainer = build(tmp_path)
    models = [base_model(m) for m in (trainer.model, trainer.ref_model)]
    with prepared(trainer):
        assert all(vars(m).get(kto._WRAPPED) for m in models)
        with pytest.raises(PackingError, match="already called"):
            prepare_kto_trainer(trainer)
    assert not any(vars(m).get(kto._WRAPPED) for m in models)


def test_a_leaking_forward_is_refused_as_kto_not_dpo(tmp_path, monkeypatch):
    """The isolation probe's refusal under prepare_kto_trainer said "padding-free DPO row" and "do not call
    prepare_dpo_trainer": it names KTO and prepare_kto_trainer (a tolerance below any difference stands in
    for a model whose sequences leak)."""
    from packtools.integrations.preference import probe

    monkeypatch.setitem(probe.TOLERANCE, "float32", -1.0)
    trainer = build(tmp_path)
    with pytest.raises(PackingError, match="padding-free KTO row see each other") as err:
        prepare_kto_trainer(trainer)
    assert "prepare_kto_trainer" in str(err.value) and "DPO" not in str(err.value)


def test_neftune_is_refused_by_name(tmp_path):
    """NEFTune's noise shrinks with the width of the batch the embeddings see, which padding-free rows change."""
    trainer = build(tmp_path, neftune_noise_alpha=5.0)
    with pytest.raises(
        PackingError, match=r"neftune_noise_alpha=5.0: .*do not call prepare_kto_trainer"
    ) as err:
        prepare_kto_trainer(trainer)
    assert err.value.param == "neftune_noise_alpha"


def test_several_gpus_in_one_process_are_refused_by_name(tmp_path):
    """``args.n_gpu > 1`` (torch.nn.DataParallel) is refused as by prepare_trainer, the message naming the
    prepare_* that refused it (it named none)."""
    trainer = build(tmp_path)
    trainer.args._n_gpu = 2
    with pytest.raises(PackingError, match=r"prepare_kto_trainer: n_gpu=2.*DataParallel.*torchrun"):
        prepare_kto_trainer(trainer)
    assert type(trainer) is trl.KTOTrainer
