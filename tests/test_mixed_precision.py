"""Mixed precision (``bf16=True`` on a float32 model): every prepare function probes at the precision training runs.

accelerate runs a float32 model's forward under bfloat16 autocast when the trainer has ``bf16=True``.  The probes
of ``prepare_trainer``, ``prepare_dpo_trainer`` (padding-free and prompt-shared), ``prepare_kto_trainer`` and
``prepare_reward_trainer`` ran outside that autocast, in float32, so a kernel path training takes only at half
precision (packtools' flash paths take half-precision CUDA inputs only) was never probed.  They now run under the
trainer's autocast (``isolation.trainer_autocast``) at the tolerance of the precision they compute in
(``isolation.compute_dtype``), the one rule GRPO's probe uses too.  A hook that lets packed sequences see each
other only under autocast stands in for such a path: refused at ``bf16=True``, never reached at float32.  And
TRL's reference models already ran under accelerate's autocast, where float32's tolerance refused them.
"""

import pytest
from _hf_models import (
    PAD,
    exact_step_args,
    sequences,
    sgd_train_args,
    text_pairs,
    tiny_llama,
    tiny_preference_model,
    word_tokenizer,
)
from _trl_setup import datasets, torch, transformers, trl
from test_kto import examples as kto_examples

from packtools import prepare_dpo_trainer, prepare_trainer
from packtools.batches.collate import PaddingFreeCollator
from packtools.errors import PackingError
from packtools.integrations import check_isolation
from packtools.integrations.attention.backends import base_model
from packtools.integrations.preference.dpo import install_padding_free_forward
from packtools.integrations.preference.kto import prepare_kto_trainer
from packtools.integrations.preference.probe import check_padding_free_forward
from packtools.integrations.preference.reward import prepare_reward_trainer


def build(kind, tmp_path, bf16):
    """A trainer of ``kind`` on tiny float32 models, with ``bf16`` mixed precision or not; and its prepare call."""
    if kind == "trainer":
        args = sgd_train_args(str(tmp_path), 0.5, bf16=bf16)
        trainer = transformers.Trainer(
            model=tiny_llama("sdpa"),
            args=args,
            train_dataset=datasets.Dataset.from_list(sequences(8, seed=5, masks=False)),
            data_collator=PaddingFreeCollator(PAD, unpacked=True),
        )
        return trainer, prepare_trainer
    kwargs = exact_step_args(tmp_path, bf16=bf16)
    if kind == "reward":
        trainer = trl.RewardTrainer(
            tiny_preference_model("llama", "sdpa", 0, num_labels=1),
            args=trl.RewardConfig(**kwargs),
            train_dataset=datasets.Dataset.from_list(text_pairs(4)),
            processing_class=word_tokenizer(),
        )
        return trainer, prepare_reward_trainer
    kto = kind == "kto"
    trainer = (trl.KTOTrainer if kto else trl.DPOTrainer)(
        tiny_preference_model("llama", "sdpa", 0),
        ref_model=tiny_preference_model("llama", "sdpa", 1),
        args=(trl.KTOConfig if kto else trl.DPOConfig)(**kwargs),
        train_dataset=datasets.Dataset.from_list(kto_examples(4) if kto else text_pairs(4)),
        processing_class=word_tokenizer(),
    )
    if kto:
        return trainer, prepare_kto_trainer
    share = kind == "dpo-shared-prompt"
    return trainer, lambda t: prepare_dpo_trainer(t, share_prompt=share)


def leak_under_autocast(model, tree_only=False):
    """What a kernel taken only at half precision would do if it ignored sequence boundaries: under autocast,
    each packed row's sequences run as one (positions counted on, one ``cu_seq_lens`` span; the tree attention's
    layout dropped, so its completions run as one causal row); in float32, nothing changes.  ``tree_only``:
    only prompt-shared rows leak (the tree attention's own half-precision path)."""

    def hook(module, args, kwargs):
        if not torch.is_autocast_enabled("cpu") or (tree_only and "packtools_tree" not in kwargs):
            return args, kwargs
        kwargs = {k: v for k, v in kwargs.items() if k != "packtools_tree"}
        positions = kwargs.get("position_ids")
        if positions is not None:
            n = positions.shape[-1]
            kwargs["position_ids"] = torch.arange(n).expand_as(positions)
            for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
                if kwargs.get(key) is not None:
                    kwargs[key] = torch.tensor([0, n], dtype=torch.int32)
            for key in ("max_length_q", "max_length_k"):
                if kwargs.get(key) is not None:
                    kwargs[key] = n
        return args, kwargs

    base_model(model).model.register_forward_pre_hook(hook, with_kwargs=True)


KINDS = ["trainer", "dpo", "dpo-shared-prompt", "kto", "reward"]


@pytest.mark.parametrize("kind", KINDS)
def test_prepare_probes_under_the_trainers_mixed_precision(tmp_path, kind):
    """``bf16=True``: the model prepares (no false refusal at bfloat16's rounding), and a leak that shows only
    under autocast is refused; at float32 the same hook never fires and the trainer prepares.  Failed before:
    every prepare function probed outside autocast and let the bf16-only leak train."""
    trainer, prepare = build(kind, tmp_path, bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16"
    assert next(trainer.model.parameters()).dtype == torch.float32
    prepare(trainer)
    tree = kind == "dpo-shared-prompt"  # the generic probe sees no tree: leak only there, for the tree probe
    trainer, prepare = build(kind, tmp_path, bf16=True)
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            leak_under_autocast(model, tree_only=tree)
    with pytest.raises(PackingError, match="tree attention" if tree else "see each other|differently"):
        prepare(trainer)
    trainer, prepare = build(kind, tmp_path, bf16=False)
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            leak_under_autocast(model, tree_only=tree)
    prepare(trainer)  # the hook leaks only under autocast: float32 training is right, and prepares


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_reference_model_in_accelerates_autocast_is_probed_at_its_precision(tmp_path, kind):
    """TRL prepares the reference model with accelerate when it builds the trainer, so its forward runs under
    bfloat16 autocast even where the probe did not ask for it.  With transformers' ``sdpa`` (packtools' own
    per-sequence sdpa happens to round each sequence the same packed or alone on the CPU) its packed logits
    round differently from the sequences alone.  Failed before: the reference model was judged at float32's
    tolerance and refused (DPO: 1.95e-03 > 1.00e-05; KTO: 8.59e-04 > 4.7e-05)."""
    trainer, _ = build(kind, tmp_path, bf16=True)
    prepare = prepare_dpo_trainer if kind == "dpo" else prepare_kto_trainer
    prepare(trainer, segmented_sdpa=False)
    assert trainer.ref_model.config._attn_implementation == "sdpa"


def test_check_isolation_called_directly_on_a_reference_model_in_accelerates_autocast(tmp_path):
    """``check_isolation(trainer.ref_model)`` outside any prepare function, ``bf16=True``: the forward accelerate
    wrapped enters bfloat16 autocast itself, so the probe reads the precision from inside the forward and judges
    at bfloat16's tolerance; a real leak (no positions: one long row) is still refused.  Failed before: the
    dtype was read outside that wrapper (float32), and the isolated model was refused (1.95e-03 > 1.00e-05)."""
    trainer, _ = build("dpo", tmp_path, bf16=True)
    model = trainer.ref_model
    assert not torch.is_autocast_enabled("cpu") and next(model.parameters()).dtype == torch.float32
    report = check_isolation(model)
    assert report.dtype == "bfloat16" and not report.leaks
    assert 1e-5 < max(report.alone_diff) < report.tolerance  # bfloat16's rounding: over float32's tolerance
    with pytest.raises(PackingError, match="lets packed sequences see each other"):
        check_isolation(model, PaddingFreeCollator(PAD, return_position_ids=False))


def test_padding_free_forward_probe_called_directly_on_a_reference_model_in_accelerates_autocast(tmp_path):
    """``check_padding_free_forward(trainer.ref_model)`` after ``prepare_dpo_trainer``, ``bf16=True``: the same
    rule, the precision read from inside the forward accelerate wrapped.  Failed before: refused at float32's
    tolerance (8.59e-04 > 4.7e-05)."""
    trainer, _ = build("dpo", tmp_path, bf16=True)
    prepare_dpo_trainer(trainer, segmented_sdpa=False)
    assert not torch.is_autocast_enabled("cpu")
    assert 5e-5 < check_padding_free_forward(trainer.ref_model) < 3e-2  # bfloat16's rounding, accepted


def test_vision_probe_called_directly_on_a_model_whose_forward_enters_bfloat16_autocast():
    """``check_vision_isolation(trainer.model)`` after ``train()`` with ``bf16=True``: accelerate's prepare_model
    wrapped the float32 model's forward in bfloat16 autocast (as here, by hand).  The probe read the precision
    from outside it (float32) and refused the isolated model (2.0e-03 over float32's tolerance); it reads it
    from inside the forward now, as check_isolation does.  Control: the model unwrapped is exact in float32."""
    from packtools.batches.vision import MultimodalCollator
    from packtools.integrations.multimodal.models import check_vision_isolation
    from packtools.testing import tiny_vl_model

    plain = check_vision_isolation(
        tiny_vl_model("qwen2_vl"), MultimodalCollator(tiny_vl_model("qwen2_vl"), 0)
    )
    assert plain.dtype == "float32" and max(plain.alone_diff) < 1e-5
    model = tiny_vl_model("qwen2_vl")
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # accelerate's wrapper
    assert not torch.is_autocast_enabled("cpu") and next(model.parameters()).dtype == torch.float32
    report = check_vision_isolation(model, MultimodalCollator(model, 0))
    assert report.dtype == "bfloat16" and not report.leaks
    assert max(report.alone_diff) > 1e-4 and report.perturb_diff == 0.0  # bfloat16's rounding, nothing moved


def test_probes_called_under_autocast_judge_at_its_precision_and_still_catch_a_leak():
    """A user's ``torch.autocast`` around a probe: the float32 model computes in bfloat16, so the probe takes
    bfloat16's tolerance.  Failed before: check_isolation judged ``packed - alone`` 1.95e-3 against float32's
    1e-5 and check_padding_free_forward 7.0e-4 against 5e-5, and refused an isolated Llama.  A real leak (no
    positions for eager attention: one long row) is still refused under autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = check_isolation(tiny_llama("sdpa"))
        assert report.dtype == "bfloat16" and not report.leaks
        assert (
            1e-5 < max(report.alone_diff) < report.tolerance
        )  # bfloat16's rounding, float32's tolerance exceeded
        assert report.perturb_diff == 0.0
        policy = tiny_preference_model("llama", "sdpa", 0)
        trl.trainer.utils.add_fused_lm_head(policy)
        install_padding_free_forward(policy)
        assert 5e-5 < check_padding_free_forward(policy)
        with pytest.raises(PackingError, match="lets packed sequences see each other"):
            check_isolation(tiny_llama("eager"), PaddingFreeCollator(PAD, return_position_ids=False))


def accelerate_wrapped(model):
    """What accelerate's prepare_model does to a float32 model under bf16=True: its forward enters bfloat16
    autocast itself (the caller's code sees none)."""
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    assert not torch.is_autocast_enabled("cpu") and next(model.parameters()).dtype == torch.float32
    return model


def test_tree_and_reward_probes_called_directly_in_accelerates_autocast_judge_at_its_precision(monkeypatch):
    """``check_tree_isolation`` and ``check_reward_isolation`` on a model whose forward accelerate wrapped:
    read the precision from inside the forward, as check_isolation does.  Failed before: refused at float32's
    tolerance (tree: 1.95e-03 > 1e-4; reward: 4.88e-04 > 1e-5).  Controls: unwrapped, both are exact in
    float32; a real leak (the reward probe's rows with no positions) is still refused wrapped.

    The precision each probe judged at is read from its ``compute_dtype`` call, not inferred from a rounding
    difference: how far bfloat16 moves the logits depends on the CPU's kernels (on an AVX512-BF16 CPU the tree
    probe's packed and alone logits are bit-equal, 0.0; under ``ATEN_CPU_CAPABILITY=avx2`` 1.95e-03)."""
    from packtools.integrations.attention import tree
    from packtools.integrations.attention.tree import check_tree_isolation, use_tree_attention
    from packtools.integrations.preference import reward_scores
    from packtools.integrations.preference.reward_scores import check_reward_isolation

    judged = []

    def spy(module):
        real = module.compute_dtype

        def compute_dtype(*args, **kwargs):
            judged.append(real(*args, **kwargs))
            return judged[-1]

        monkeypatch.setattr(module, "compute_dtype", compute_dtype)

    spy(tree)
    spy(reward_scores)

    def tree_model(wrapped):
        model = tiny_llama("sdpa")
        use_tree_attention(accelerate_wrapped(model) if wrapped else model, check_isolation=False)
        return model

    assert check_tree_isolation(tree_model(False)) < 1e-6 and judged == ["float32"]
    assert check_tree_isolation(tree_model(True)) < 3e-2  # bfloat16's rounding (if any), accepted
    assert judged[1:] == ["bfloat16"]

    def reward_model():
        return tiny_preference_model("llama", "sdpa", 0, num_labels=1)

    del judged[:]
    assert check_reward_isolation(reward_model()) < 1e-6 and judged == ["float32"]
    assert check_reward_isolation(accelerate_wrapped(reward_model())) < 3e-2
    assert judged[1:] == ["bfloat16"]
    real = reward_scores.reward_batch

    def no_positions(inputs, send=False):
        batch = real(inputs, send)
        batch.flat.pop("position_ids")
        for key in [k for k in batch.flat if k.startswith(("cu_seq_lens", "max_length"))]:
            batch.flat.pop(key)
        return batch

    model = accelerate_wrapped(reward_model())
    model.config._attn_implementation = "eager"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reward_scores, "reward_batch", no_positions)
        with pytest.raises(PackingError, match="scores packed sequences differently"):
            check_reward_isolation(model)


@pytest.mark.parametrize("share", [False, True])
def test_grpo_probe_called_directly_in_accelerates_autocast_judges_at_its_precision(tmp_path, share):
    """``check_rl_forward`` (plain padding-free rows and prompt-shared tree rows) on a policy whose forward
    accelerate wrapped in bfloat16 autocast.  Failed before: judged at float32's tolerance (1e-4) and refused."""
    from test_grpo import build

    from packtools.integrations.rl.grpo import check_rl_forward

    trainer = build(tmp_path, prepared=True, share=share)
    assert check_rl_forward(trainer, trainer.model, entropy=True) < 1e-4  # float32: exact
    accelerate_wrapped(trainer.model)
    assert check_rl_forward(trainer, trainer.model, entropy=True) > 1e-4  # bfloat16's rounding, accepted
