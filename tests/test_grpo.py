"""TRL's GRPOTrainer and RLOOTrainer with padding-free log-probability forwards equal TRL's padded ones.

Each case builds two trainers from the same seeds and weights: TRL as it is, and one prepared by
``prepare_grpo_trainer``.  Generation is TRL's (transformers' ``generate``, sampling from the global RNG seeded
right before each run), so both trainers see the same completions as long as their models agree.  Whole training
runs (2 optimizer steps, generation included) must end with the same weights and log the same metrics; one
micro-batch through ``compute_loss`` must give the same loss, metrics and gradients (1e-5 relative, fp32 CPU).
Negative controls (completions seeing each other, a completion offset by one) must fail the same comparison.
"""

import os
import shutil

import numpy as np
import pytest
from _hf_models import tiny_config, word_tokenizer
from _scripts import script
from _trl_setup import TOL, datasets, torch, transformers, trl

from packtools.errors import PackingError
from packtools.integrations import unprepare
from packtools.integrations.rl import grpo as rl_grpo
from packtools.integrations.rl import prepare_grpo_trainer
from packtools.integrations.rl.rows import Row, share_prompts, unpad_completions

VOCAB = 12  # small, so a random model ends completions (EOS) at varied lengths
PAD, EOS = 0, 1
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def tiny(kind="llama", seed=0):
    torch.manual_seed(seed)
    common = tiny_config(
        hidden_size=32,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        eos_token_id=EOS,
        # Wide initial weights spread the per-token entropies (0.02 leaves them all near log(VOCAB)), so the
        # top_entropy_quantile mask, a step function, is not decided by float rounding between near-equal values.
        initializer_range=0.3,
    )
    if (
        kind == "mixtral"
    ):  # MoE: TRL asks for the router logits and adds the load-balancing loss (not in generate)
        config = transformers.MixtralConfig(
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
            **common,
        )
        return transformers.MixtralForCausalLM(config).float()
    if kind == "gpt2":  # absolute (learned) positions
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128, pad_token_id=PAD,
            eos_token_id=EOS, bos_token_id=EOS, attn_implementation="sdpa", initializer_range=0.3,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config).float()
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **common)).float()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).float()


def prompts(n=8, seed=0):
    rng = np.random.default_rng(seed)
    words = [" ".join(f"w{t}" for t in rng.integers(2, VOCAB, int(rng.integers(1, 8)))) for _ in range(n)]
    return [{"prompt": w} for w in words]


def reward_len(completions, **kwargs):
    """A reward in Python: longer completions with more distinct words score higher."""
    return [len(c) / 10 + len(set(c.split())) for c in completions]


def build(  # noqa: PLR0913 - the test's knobs
    tmp_path, prepared=False, kind="llama", trainer="grpo", share="auto", lora=False, balance="auto", **config
):
    """A GRPO/RLOO trainer on a tiny model; with beta > 0 the reference is another tiny model (seed 1).
    ``share`` / ``balance`` are ``prepare_grpo_trainer``'s ``share_prompt`` / ``balance_groups`` (the defaults,
    ``"auto"``: prompt-shared rows here; groups balanced across ranks under data parallelism)."""
    ref_dir = tmp_path / f"ref-{kind}"
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if (
        distributed
    ):  # once torch.distributed runs, save_pretrained writes on rank 0 only: the others wait for it
        if torch.distributed.get_rank() == 0 and not ref_dir.exists():
            tiny(kind, seed=1).save_pretrained(ref_dir)
        torch.distributed.barrier()
    elif not ref_dir.exists():  # written aside and renamed: two processes of a DDP test may both get here
        aside = ref_dir.with_name(f"{ref_dir.name}.{os.getpid()}")
        tiny(kind, seed=1).save_pretrained(aside)
        try:
            os.rename(aside, ref_dir)
        except OSError:  # the other process renamed its copy first: the same weights (seed 1)
            shutil.rmtree(aside)
    model = tiny(kind)
    model.config._name_or_path = str(ref_dir)  # TRL builds the reference from the policy's name
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=10,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        seed=0,
        max_steps=2,
    )
    kwargs.update(config)
    if trainer == "gmpo":  # TRL's experimental GRPO subclass with a loss of its own
        from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

        cls, config_cls = GMPOTrainer, GMPOConfig
    else:
        cls, config_cls = (
            (trl.GRPOTrainer, trl.GRPOConfig) if trainer == "grpo" else (trl.RLOOTrainer, trl.RLOOConfig)
        )
    extra = {}
    if lora:  # no reference model: TRL disables the adapter for the reference log-probabilities
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
    built = cls(
        model,
        reward_funcs=reward_len,
        args=config_cls(**kwargs),
        train_dataset=datasets.Dataset.from_list(prompts()),
        processing_class=word_tokenizer(VOCAB),
        **extra,
    )
    if not prepared:
        return built
    return prepare_grpo_trainer(built, share_prompt=share, balance_groups=balance)


def plan_summary(trainer):
    plan = vars(trainer).get("packtools_step")
    return None if plan is None else plan.summary()


def train(trainer):
    transformers.set_seed(0)  # generation samples from the global RNG: the same draws for both trainers
    trainer.train()
    return trainer


def assert_close(a, b, what, tol=TOL):
    # TRL logs a metric with no value in the logging window as None (clip_ratio/low_min when truncation masked
    # every completion of each micro-batch)
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a} against {b}"
        return
    scale = max(1.0, float(np.max(np.abs(a))))
    diff = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    assert diff <= tol * scale, f"{what}: {diff:.3g} apart (scale {scale:.3g})"


def assert_same_run(a, b, weight_tol=TOL):
    for (name, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert_close(p.detach().numpy(), q.detach().numpy(), name, weight_tol)
    assert len(a.state.log_history) == len(b.state.log_history)
    for la, lb in zip(a.state.log_history, b.state.log_history):
        assert sorted(la) == sorted(lb)
        for key, value in la.items():
            if key not in TIMING:
                assert_close(value, lb[key], key)


CASES = [
    dict(loss_type="grpo", beta=0.1, num_iterations=2, gradient_accumulation_steps=2),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1, num_iterations=2),
    dict(loss_type="dr_grpo", beta=0.0, num_iterations=2, gradient_accumulation_steps=2),
    dict(loss_type="dapo", beta=0.1, top_entropy_quantile=0.5, gradient_accumulation_steps=2),
    dict(loss_type="bnpo", beta=0.0, num_iterations=2),
    dict(loss_type="cispo", beta=0.1, num_iterations=2, gradient_accumulation_steps=2),
    dict(loss_type="sapo", beta=0.0, num_iterations=2),
    dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.1, num_iterations=2),
    dict(loss_type="vespo", beta=0.0, num_iterations=2, gradient_accumulation_steps=2),
]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_grpo_training_equals_trl(tmp_path, case, kind):
    """The default layout (share_prompt="auto": these models take the tree attention, so prompt-shared rows)."""
    theirs = train(build(tmp_path, kind=kind, **case))
    ours = build(tmp_path, True, kind=kind, **case)
    assert vars(ours)["packtools_step"].share_prompt  # the default shares wherever the models can serve it
    assert_same_run(theirs, train(ours))
    logs = theirs.state.log_history
    if case.get("num_iterations") == 2 and case["loss_type"] in ("grpo", "dr_grpo", "bnpo"):
        assert any(log.get("clip_ratio/region_mean", 0) > 0 for log in logs)  # the clip metrics are exercised
    if case.get("beta"):
        assert all(log["kl"] > 0 for log in logs if "kl" in log)


def test_auto_falls_back_to_plain_rows_when_the_tree_fails_its_probe(tmp_path, monkeypatch, caplog):
    """A tree attention that fails its isolation probe (a stand-in for a backend not run here, flash-attn on a
    GPU): "auto" trains on plain rows, probed on their own, and says why; share_prompt=True raises."""
    import logging

    from packtools.integrations.attention import tree

    def failing(model, seed=0):
        raise PackingError("the tree probe failed (stand-in)")

    monkeypatch.setattr(tree, "check_tree_isolation", failing)
    with caplog.at_level(logging.WARNING, logger="packtools"):
        trainer = build(tmp_path, True)
    plan = trainer.packtools_step
    assert not plan.share_prompt and "failed its probe (the tree probe failed (stand-in))" in plan.summary()
    assert plan.summary() in caplog.text
    assert trainer.model.config._attn_implementation != "packtools_tree"
    with pytest.raises(PackingError, match="stand-in"):
        build(tmp_path, True, share=True)


PLAIN_CASES = [
    CASES[0],
    CASES[3],
    CASES[7],
]  # grpo with accumulation; dapo with the entropy mask; luspo, sequence


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("case", PLAIN_CASES, ids=lambda c: c["loss_type"])
def test_grpo_plain_rows_training_equals_trl(tmp_path, kind, case):
    """share_prompt=False: every forward one plain padding-free row (each prompt once per completion)."""
    plain = build(tmp_path, True, kind=kind, share=False, **case)
    plan = vars(plain)["packtools_step"]
    assert type(plain).__name__ == "PackedGRPOTrainer" and not plan.share_prompt
    assert plan.summary() == (
        "plain padding-free rows (each prompt once per completion): share_prompt=False (asked); "
        "groups: one process: nothing to balance"
    )
    assert_same_run(train(build(tmp_path, kind=kind, **case)), train(plain))


# GRPOConfig options a user sets beside loss_type, each a whole run side by side with TRL's: generation out of step
# with the optimizer (old log-probabilities from their own forward), truncated completions masked (empty completions
# in the rows), gradient checkpointing, the reward scalings with asymmetric and two-sided clipping, sampling
# temperature and padded widths, the off-policy mask with the importance-corrected KL, the adaptive entropy bonus,
# and a generation batch of several steps.
OPTION_CASES = [
    dict(steps_per_generation=2, beta=0.1),
    dict(mask_truncated_completions=True, max_completion_length=4, gradient_accumulation_steps=2),
    dict(gradient_checkpointing=True, num_iterations=2, beta=0.1),
    dict(loss_type="dr_grpo", scale_rewards="batch", epsilon=0.1, epsilon_high=0.28, num_iterations=2),
    dict(loss_type="grpo", scale_rewards="none", delta=1.2, num_iterations=2),
    dict(temperature=0.7, pad_to_multiple_of=8, beta=0.1, num_iterations=2),
    dict(
        loss_type="grpo",
        off_policy_mask_threshold=0.0,
        use_bias_correction_kl=True,
        beta=0.1,
        num_iterations=3,
    ),
    dict(entropy_coef=0.05, use_adaptive_entropy=True, entropy_target=10.0, num_iterations=2),
    dict(generation_batch_size=16, num_iterations=2),
]


@pytest.mark.parametrize(
    "case, share",
    [(case, "auto") for case in OPTION_CASES] + [(OPTION_CASES[0], False), (OPTION_CASES[1], False)],
    ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else f"share={v}",
)
def test_grpo_config_options_train_as_trl(tmp_path, case, share):
    theirs, ours = train(build(tmp_path, **case)), train(build(tmp_path, True, share=share, **case))
    assert_same_run(theirs, ours)
    logs = theirs.state.log_history
    # some completions cut (rows holding no completion token of theirs), not all
    if case.get("mask_truncated_completions"):
        assert any(0 < log.get("completions/clipped_ratio", 0) < 1 for log in logs)
    if case.get("gradient_checkpointing"):
        assert ours.model.is_gradient_checkpointing
    if case.get("use_adaptive_entropy"):
        assert any("entropy_coef" in log for log in logs)


def random_trl_batch(rng, size):
    """A batch shaped as TRL builds it (prompts left-padded, completions right-padded), drawn to cover the rows'
    corner cases: several sequences per prompt, one-token prompts shared or not, empty completions (what
    ``mask_truncated_completions`` leaves)."""
    n_prompts = int(rng.integers(1, size + 1))
    lengths = np.where(rng.random(n_prompts) < 0.3, 1, rng.integers(1, 6, n_prompts))
    prompts_ = [rng.integers(2, VOCAB, n) for n in lengths]
    owner = rng.integers(0, n_prompts, size)
    completions = [rng.integers(2, VOCAB, int(n)) for n in rng.integers(0, 7, size)]
    width_p = max(len(prompts_[o]) for o in owner)
    width_c = max(1, max(len(c) for c in completions))
    ids = torch.zeros(size, width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b in range(size):
        prompt, completion = prompts_[owner[b]], completions[b]
        ids[b, width_p - len(prompt) : width_p + len(completion)] = torch.from_numpy(
            np.concatenate([prompt, completion])
        )
        mask[b, width_p - len(prompt) : width_p + len(completion)] = 1
    return ids, mask, width_c


@pytest.mark.parametrize("share", ["auto", False], ids=["default-shared", "plain"])
def test_random_trl_batches_equal_trls_padded_method(tmp_path, share):
    """Log-probabilities, entropies and their gradients of 25 random TRL-shaped batches, each cut into forwards of
    a random size (TRL's ``batch_size`` chunks, cutting groups) or one forward: the prepared method equals TRL's."""
    theirs = build(tmp_path, loss_type="grpo")
    ours = build(tmp_path, True, share=share, loss_type="grpo")
    rng = np.random.default_rng(0)
    for trial in range(25):
        size = int(rng.integers(1, 9))
        ids, mask, keep = random_trl_batch(rng, size)
        chunk = int(rng.integers(1, size + 1)) if trial % 2 else None
        got = []
        for trainer in (theirs, ours):
            trainer.model.zero_grad()
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, keep, batch_size=chunk, compute_entropy=True
            )
            real = mask[:, -keep:].float()
            ((logps * real).sum() + 0.1 * (entropies * real).sum()).backward()
            grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
            got.append((logps.detach(), entropies.detach(), grads))
        for what, a, b in zip(("log-probabilities", "entropies", "gradients"), *got):
            assert_close(a.numpy(), b.numpy(), f"batch {trial} {what}")


def test_layout_is_decided_once_with_its_reason(tmp_path, caplog):
    """share_prompt: "auto" shares where the models can serve it and says so; True shares; a bad value is refused."""
    import logging

    with caplog.at_level(logging.INFO, logger="packtools"):
        trainer = build(tmp_path, True)
    plan = vars(trainer)["packtools_step"]
    assert plan.share_prompt and "share_prompt='auto' and the models can serve" in plan.summary()
    assert f"prepare_grpo_trainer: {plan.summary()}" in caplog.text
    asked = vars(build(tmp_path, True, share=True))["packtools_step"]
    assert asked.share_prompt and asked.layout_reason == "share_prompt=True (asked)"
    with pytest.raises(PackingError, match="share_prompt='yes': expected True, False or 'auto'"):
        build(tmp_path, True, share="yes")


def test_moe_aux_loss_equals_trl(tmp_path):
    """The load-balancing loss over a padding-free row (every token real) equals TRL's over its padded batch (its
    attention mask): value and gradients.  On one TRL-shaped batch (TRL 1.16's generate fails on this MoE on CPU,
    with or without packtools, so no training run)."""
    trainer = build(tmp_path, kind="mixtral", beta=0.0)
    assert trainer.aux_loss_enabled
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(2, VOCAB, (6, 13)))
    mask = torch.ones_like(ids)
    mask[0, :3] = mask[1, :1] = 0  # prompts: 8 columns, left-padded
    mask[2, 9:] = mask[3, 8:] = mask[4, 11:] = 0  # completions: 5 columns, right-padded (sequence 3: empty)
    results = []
    for prepared in (False, True):
        if prepared:
            prepare_grpo_trainer(trainer)
        trainer.model.zero_grad()
        logps, entropies, aux = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, 5, compute_entropy=True, compute_aux_loss=True
        )
        (logps.sum() + entropies.sum() + aux).backward()
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]
        results.append((logps.detach(), entropies.detach(), aux.detach(), grads))
        if prepared:  # the default falls back to plain rows, and says why
            plan = vars(trainer)["packtools_step"]
            assert not plan.share_prompt and "cannot be shared: an MoE aux loss" in plan.summary()
    (la, ea, aa, ga), (lb, eb, ab, gb) = results
    assert float(aa) > 0 and len(ga) == len(gb)
    for what, a, b in [
        ("logps", la, lb),
        ("entropies", ea, eb),
        ("aux", aa, ab),
        *zip(["grad"] * len(ga), ga, gb),
    ]:
        assert_close(a.numpy(), b.numpy(), what)
    unprepare(trainer)
    with pytest.raises(PackingError, match="share_prompt=True: an MoE aux loss"):
        prepare_grpo_trainer(trainer, share_prompt=True)


def test_lora_reference_through_the_disabled_adapter_equals_trl(tmp_path):
    case = dict(loss_type="grpo", beta=0.1, num_iterations=2, lora=True, learning_rate=1.0)
    theirs, ours = train(build(tmp_path, **case)), train(build(tmp_path, True, **case))
    assert theirs.ref_model is None and any(log.get("kl", 0) > 0 for log in theirs.state.log_history)
    assert_same_run(theirs, ours)


@pytest.mark.parametrize(
    "case",
    [
        dict(beta=0.1, num_iterations=2, gradient_accumulation_steps=2, share=False),
        # Two steps at lr 0.1 (grad norm ~97): the first step's weights end ~9e-7 apart (summation order), which
        # the second step's gradients carry to 1.9e-5-3.9e-5 relative (AMD EPYC, torch 2.13 CPU; 1e-5 held on
        # another CPU): rounding carried, not a different step, so the weights get 1e-4 here, the logs TOL.
        dict(beta=0.0, share=False, weight_tol=1e-4),
        # The default (prompt-shared rows), one step: RLOO puts the KL into the reward; its normalized advantages
        # carry rounding (~3e-6 relative on one micro-batch, plain rows alike) into the next step, and
        # prompt-shared weights end 1.2e-5 relative apart (one q_proj entry) after two steps at lr 0.1.
        dict(beta=0.1, max_steps=1),
        dict(beta=0.0, share=True, max_steps=1),
    ],
)
def test_rloo_training_equals_trl(tmp_path, case):
    case = dict(case)
    weight_tol = case.pop("weight_tol", TOL)
    assert_same_run(
        train(build(tmp_path, trainer="rloo", **case)),
        train(build(tmp_path, True, trainer="rloo", **case)),
        weight_tol,
    )


@pytest.mark.parametrize("share", ["auto", False], ids=["default-shared", "plain"])
def test_gmpo_a_grpo_subclass_with_its_own_loss_equals_trl(tmp_path, monkeypatch, share):
    """TRL's GMPOTrainer overrides GRPO's _compute_loss (a geometric mean) and reads the log-probabilities through
    _get_per_token_logps_and_entropies, which packtools runs padding-free: the run equals TRL's padded one."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    case = dict(beta=0.1, num_iterations=2, gradient_accumulation_steps=2)
    theirs = train(build(tmp_path, trainer="gmpo", **case))
    ours = build(tmp_path, True, trainer="gmpo", share=share, **case)
    assert type(ours).__name__ == "PackedGMPOTrainer"
    assert_same_run(theirs, train(ours))


def scored_batch(trainer):
    """One generation batch of 2 prompts x 4 completions, scored by the trainer (old/ref log-probs its own)."""
    trainer.model.train()
    transformers.set_seed(0)
    inputs = [row for row in prompts()[:2] for _ in range(trainer.num_generations)]
    return trainer._generate_and_score_completions(inputs)


def loss_metrics_grads(trainer, batch):
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before a step
    for values in trainer._metrics["train"].values():
        values.clear()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items() if v}, grads


def differs(a, b):
    """The largest relative difference between two (loss, metrics, grads) results."""
    (la, ma, ga), (lb, mb, gb) = a, b
    worst = abs(la - lb) / max(1.0, abs(la))
    for k in ma:
        worst = max(worst, abs(ma[k] - mb[k]) / max(1.0, abs(ma[k])))
    for k in ga:
        worst = max(worst, float((ga[k] - gb[k]).abs().max()) / max(1e-3, float(ga[k].abs().max())))
    return worst


@pytest.mark.parametrize("share", ["auto", False], ids=["default-shared", "plain"])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_micro_batch_loss_metrics_gradients_and_scored_logps_equal_trl(tmp_path, kind, share):
    config = dict(beta=0.1, num_iterations=2, loss_type="grpo")
    ours, theirs = (
        build(tmp_path, True, kind=kind, share=share, **config),
        build(tmp_path, kind=kind, **config),
    )
    assert vars(ours)["packtools_step"].share_prompt == (share == "auto")
    batch_a, batch_b = scored_batch(theirs), scored_batch(ours)
    assert torch.equal(batch_a["completion_ids"], batch_b["completion_ids"])
    assert int(batch_a["completion_mask"].sum(1).min()) < batch_a["completion_ids"].shape[1]  # really padded
    for key in ("old_per_token_logps", "ref_per_token_logps", "advantages"):
        assert_close(batch_a[key].numpy(), batch_b[key].numpy(), key)
    assert differs(loss_metrics_grads(theirs, batch_a), loss_metrics_grads(ours, batch_a)) <= TOL


def test_tool_masks_and_evaluate_equal_trl(tmp_path):
    """Multi-turn tool results (``tool_mask`` 0 inside a completion: attended, not trained) and ``evaluate()``."""
    config = dict(beta=0.1, loss_type="dapo", per_device_eval_batch_size=4)
    ours, theirs = build(tmp_path, True, **config), build(tmp_path, **config)
    batch = scored_batch(theirs)
    tool = torch.ones_like(batch["completion_mask"])
    tool[:, 1:3] = 0  # tokens 1-2 of every completion came from a tool
    batch["tool_mask"] = tool
    assert differs(loss_metrics_grads(theirs, batch), loss_metrics_grads(ours, batch)) <= TOL
    eval_set = datasets.Dataset.from_list(prompts(4, seed=5))
    ours, theirs = build(tmp_path, True, **config), build(tmp_path, **config)
    transformers.set_seed(0)
    want = theirs.evaluate(eval_set)
    transformers.set_seed(0)
    got = ours.evaluate(eval_set)
    assert sorted(want) == sorted(got) and "eval_loss" in want
    for key, value in want.items():
        if "runtime" not in key and "per_second" not in key:
            assert_close(value, got[key], key)


def _leaky(input_ids, attention_mask, keep):
    """The negative control: every sequence of the row in one document (completions see the others)."""
    row = unpad_completions(input_ids, attention_mask, keep)
    n = row.ids.shape[0]
    whole = torch.tensor([0, n], dtype=torch.int32)
    return Row(row.ids, row.labels, torch.arange(n), row.dest, row.source, cu=whole, longest=n)


def _offset(input_ids, attention_mask, keep):
    """The negative control: every completion read one position early."""
    row = unpad_completions(input_ids, attention_mask, keep)
    return Row(row.ids, row.labels, row.positions, row.dest, row.source - 1, cu=row.cu, longest=row.longest)


def _siblings_see_each_other(input_ids, attention_mask, keep):
    """The negative control of prompt sharing: the shared row run as one plain document (no tree)."""
    row = share_prompts(input_ids, attention_mask, keep)
    n = row.ids.shape[0]
    whole = torch.tensor([0, n], dtype=torch.int32)
    return Row(row.ids, row.labels, torch.arange(n), row.dest, row.source, cu=whole, longest=n)


@pytest.mark.parametrize(
    "layout, broken, share",
    [
        ("unpad_completions", _leaky, False),
        ("unpad_completions", _offset, False),
        ("share_prompts", _siblings_see_each_other, True),
    ],
    ids=["attends-across", "offset-by-one", "siblings-see-each-other"],
)
def test_negative_controls_fail(tmp_path, monkeypatch, layout, broken, share):
    config = dict(beta=0.1, loss_type="grpo")
    theirs = build(tmp_path, **config)
    batch = scored_batch(theirs)
    reference = loss_metrics_grads(theirs, batch)
    monkeypatch.setattr(rl_grpo, layout, broken)
    with pytest.raises(PackingError, match="isolation probe|leak"):
        build(tmp_path, True, share=share, **config)  # the probe sees it
    ours = build(tmp_path, **config)
    prepare_grpo_trainer(ours, check_isolation=False, share_prompt=share)
    assert differs(reference, loss_metrics_grads(ours, batch)) > 1e-3  # and the comparison above would


def test_rows_forward_only_real_tokens_and_each_prompt_once():
    """The bench's token arithmetic is the rows' width: padding-free sum(p + c); shared sum(p) + (G - 1) + sum(c)."""
    bench = script("bench_grpo")
    args = bench.argparse.Namespace(prompt_min=3, prompt_max=9, completion_max=16)
    rng = np.random.default_rng(3)
    prompts_, completions = bench.draw(rng, 3, 4, args)
    ids, mask, keep = bench.trl_batch(rng, prompts_, completions, 4)
    padded, free, shared = bench.token_counts(prompts_, completions, 4)
    assert padded == ids.numel()
    assert unpad_completions(ids, mask, keep).ids.shape[0] == free == int(mask.sum())
    row = share_prompts(ids, mask, keep)
    assert row.ids.shape[0] == shared == int(prompts_.sum()) + 3 * 3 + int(completions.sum())
    assert int(row.dest.sum()) == int(completions.sum()) and (row.labels != -100).sum() == int(
        completions.sum()
    )


def test_absolute_positions_are_refused_by_the_probe(tmp_path):
    """TRL's padded forward numbers a left-padded prompt from the row's start; with learned absolute positions
    (GPT-2) that is not what a padding-free row (or generate) computes, so the probe refuses the model."""
    trainer = build(tmp_path, kind="gpt2", beta=0.0)
    with pytest.raises(
        PackingError, match="GPT2LMHeadModel: packtools' padding-free log-probabilities differ"
    ):
        prepare_grpo_trainer(trainer)
    assert type(trainer) is trl.GRPOTrainer


@pytest.mark.parametrize("share", ["auto", False], ids=["default-shared", "plain"])
def test_neftune_is_refused_by_name(tmp_path, share):
    """``neftune_noise_alpha`` (a TrainingArguments option GRPOTrainer runs): transformers' NEFTune hook draws the
    embeddings' noise within alpha / sqrt(width x hidden) of the batch it sees.  TRL's log-probability forward of
    this run sees [4, 7] (bound 0.334 at alpha 5, hidden 32), packtools' plain row [1, 25] (0.177) and its shared
    row [1, 13] (0.245): the run trained with other noise, silently (failed before: DID NOT RAISE).  Refused by
    name, the trainer left as TRL built it."""
    trainer = build(tmp_path, neftune_noise_alpha=5.0)
    with pytest.raises(
        PackingError, match=r"neftune_noise_alpha=5.0: transformers' NEFTune .* Set neftune_noise"
    ):
        prepare_grpo_trainer(trainer, share_prompt=share)
    assert type(trainer) is trl.GRPOTrainer and "packtools_step" not in vars(trainer)


def test_refusals_by_name_and_unprepare(tmp_path, monkeypatch):
    trainer = build(tmp_path)
    trainer.loss_type = "mystery"
    with pytest.raises(PackingError, match="loss_type='mystery'"):
        prepare_grpo_trainer(trainer)
    assert type(trainer) is trl.GRPOTrainer and "packtools_step" not in vars(trainer)  # left as TRL built it
    trainer.loss_type = "grpo"
    trainer.args.use_liger_kernel = True
    with pytest.raises(PackingError, match="use_liger_kernel"):
        prepare_grpo_trainer(trainer)
    trainer.args.use_liger_kernel = False
    monkeypatch.setattr("packtools.compat.trl.RL_CHECKED", "1.17.0 - 1.18.0")
    with pytest.raises(PackingError, match="1.17.0 - 1.18.0"):
        prepare_grpo_trainer(trainer)
    monkeypatch.undo()
    prepare_grpo_trainer(trainer)
    with pytest.raises(PackingError, match="already called"):
        prepare_grpo_trainer(trainer)
    from packtools import prepare_trainer

    with pytest.raises(PackingError, match="Use packtools.prepare_grpo_trainer"):
        prepare_trainer(trainer)  # a prepared GRPO trainer is refused by name, not read as an SFT plan
    ids = torch.tensor([[2, 3, 4]])
    with pytest.raises(PackingError, match="pixel_values"):
        trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, torch.ones_like(ids), 1, pixel_values=ids
        )
    with pytest.raises(PackingError, match="not left-padded"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.tensor([[1, 0, 1]]), 1)
    unprepare(trainer)
    assert type(trainer) is trl.GRPOTrainer and "packtools_step" not in vars(trainer)
    trainer.args._n_gpu = 2  # two GPUs visible to one process: Trainer's torch.nn.DataParallel
    with pytest.raises(PackingError, match=r"prepare_grpo_trainer: n_gpu=2.*DataParallel"):
        prepare_grpo_trainer(trainer)
    assert type(trainer) is trl.GRPOTrainer
    trainer.args._n_gpu = 1

    class Mine(trl.GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    trainer.__class__ = Mine
    with pytest.raises(PackingError, match="Mine overrides _get_per_token_logps_and_entropies"):
        prepare_grpo_trainer(trainer)
    with pytest.raises(PackingError, match="expects a trl.GRPOTrainer"):
        prepare_grpo_trainer(object())
    with pytest.raises(PackingError, match="Use packtools.prepare_grpo_trainer"):
        prepare_trainer(build(tmp_path, trainer="rloo"))


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_prepared_block_dispatches_grpo_and_rloo_trainers(tmp_path, kind):
    """``with prepared(trainer, **kwargs)``: prepare_grpo_trainer (its keywords passed on), unprepared after."""
    from packtools.integrations import prepared

    trainer = build(tmp_path, trainer=kind)
    cls = type(trainer)
    with prepared(trainer, share_prompt=False):
        assert type(trainer).__name__ == f"Packed{cls.__name__}"
        assert not vars(trainer)["packtools_step"].share_prompt
    assert type(trainer) is cls and "packtools_step" not in vars(trainer)


def test_group_balanced_sampler_keeps_groups_whole_and_balances_prompt_tokens():
    """TRL's RepeatSampler through packtools' balancing (2 ranks, G = 8, 4 groups per rank per generation batch):
    every block holds the same indices, every rank's slice is whole groups, and the busiest rank's prompt tokens
    drop; the negative control: TRL's own order puts more on the busiest rank."""
    from trl.trainer.utils import RepeatSampler

    from packtools.integrations.rl.groups import GroupBalancedSampler

    lengths = np.random.default_rng(0).integers(256, 2049, 64)

    def trl_sampler():  # TRL's, seeded: a second one yields the same order
        return RepeatSampler(range(64), mini_repeat_count=8, batch_size=8, repeat_count=2, seed=0)

    sampler = GroupBalancedSampler(
        trl_sampler(), group=8, block=64, ranks=2, prompt_tokens=lambda i: int(lengths[i])
    )
    got, want = list(sampler), list(trl_sampler())
    assert len(got) == len(want) == len(sampler) == 8 * 2 * 64  # 8 generation batches, each repeated twice
    blocks = [got[i : i + 64] for i in range(0, len(got), 64)]
    for k, block in enumerate(blocks):
        assert sorted(block) == sorted(want[64 * k : 64 * k + 64])  # the same prompts, G copies each
        for rank in (block[:32], block[32:]):  # no group split across ranks
            assert all(len(set(rank[i : i + 8])) == 1 for i in range(0, 32, 8))
    assert blocks[0::2] == blocks[1::2]  # TRL repeats each generation batch; the balanced order repeats too

    def loads(stream):  # prompt tokens per rank (rank 0's half of a block, rank 1's), per block
        return np.array(
            [[lengths[stream[i : i + 32]].sum() for i in (k, k + 32)] for k in range(0, len(stream), 64)]
        )

    before, after = loads(want), loads(got)
    assert (after.max(1) <= before.max(1)).all() and (after.max(1) < before.max(1)).any()
    assert (after.sum(1) == before.sum(1)).all()
    with pytest.raises(PackingError, match="groups of num_generations=16 equal indices"):
        list(GroupBalancedSampler(trl_sampler(), group=16, block=64, ranks=2, prompt_tokens=lambda i: 1))


def test_balance_is_decided_once_with_its_reason():
    from types import SimpleNamespace

    from packtools.integrations.rl.groups import choose_balance

    def fake(ranks, batch, data=(1, 2, 3)):
        return SimpleNamespace(
            accelerator=SimpleNamespace(num_processes=ranks),
            args=SimpleNamespace(generation_batch_size=batch),
            num_generations=4,
            train_dataset=list(data) if data is not None else iter(()),
        )

    assert choose_balance(fake(1, 8), "auto") == (False, "one process: nothing to balance")
    balance, reason = choose_balance(fake(2, 16), "auto")
    assert balance and reason.startswith("whole groups per rank")
    assert choose_balance(fake(2, 16), False)[0] is False
    balance, reason = choose_balance(fake(2, 4), "auto")  # 2 sequences per rank: a group spans the ranks
    assert not balance and "not a multiple of num_generations=4" in reason
    with pytest.raises(PackingError, match="balance_groups=True: a rank's share"):
        choose_balance(fake(2, 4), True)
    with pytest.raises(PackingError, match="balance_groups=True: the train dataset is iterable"):
        choose_balance(fake(2, 16, None), True)
    with pytest.raises(PackingError, match="balance_groups='on': expected"):
        choose_balance(fake(2, 16), "on")
    sized_stream = fake(2, 16)
    sized_stream.train_dataset = Sized()  # a torch IterableDataset with a length: Trainer gives it no sampler
    assert not choose_balance(sized_stream, "auto")[0]
    with pytest.raises(PackingError, match="balance_groups=True: the train dataset is iterable"):
        choose_balance(sized_stream, True)


class Sized(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))

    def __len__(self):
        return 3


def torchrun(worker, out):
    """Run ``tests/<worker> <out>`` on 2 CPU processes (torchrun, gloo); raise with its stderr unless it succeeds."""
    import _launch

    _launch.torchrun(2, worker, str(out), log=out / "torchrun.log")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Both 2-process checks below in one launch (``tests/_grpo_ddp_both_worker.py``; one xdist group: one worker
    launches it): ``OUT/trl`` holds ``_grpo_ddp_worker.py``'s files, ``OUT/two`` ``_grpo_ddp_global_worker.py``'s."""
    out = tmp_path_factory.mktemp("grpo-ddp")
    (out / "two").mkdir()
    (out / "trl").mkdir()
    torchrun("_grpo_ddp_both_worker.py", out)
    return out


@pytest.mark.slow
@pytest.mark.xdist_group("grpo_ddp")
def test_two_processes_equal_trl_on_two_processes(two_process_runs):
    """torchrun, 2 CPU processes (gloo), GRPO and RLOO: the prepared trainers (plain rows and prompt-shared) end each
    rank with TRL's weights and logs (TRL's gathers, its group advantages across ranks and its loss normalizations
    as they are); GRPO as dapo, as GSPO (sequence-level ratios) with the entropy quantile TRL gathers across the
    ranks, and with truncated completions masked while generation runs a step ahead of the optimizer."""
    for rank in (0, 1):
        got = torch.load(two_process_runs / "trl" / f"rank{rank}.pt", weights_only=False)
        for kind in sorted({kind for kind, _ in got}):  # GRPOTrainer's cases and RLOOTrainer
            theirs = got[kind, "trl"]
            assert theirs["world"] == 2
            for name in ("packtools", "shared"):
                for key, p in theirs["params"].items():
                    assert_close(
                        p.numpy(), got[kind, name]["params"][key].numpy(), f"rank {rank} {kind} {name} {key}"
                    )
                for la, lb in zip(theirs["logs"], got[kind, name]["logs"], strict=True):
                    for key, value in la.items():
                        if key not in TIMING:
                            assert_close(value, lb[key], f"rank {rank} {kind} {name} {key}")


def test_bench_grpo_runs_and_packtools_forwards_fewer_tokens_and_keeps_less(capsys):
    bench = script("bench_grpo")
    small = ["--groups", "2", "--group-size", "4", "--steps", "1", "--hidden", "32", "--in-process"]
    rows, projections, balance = bench.main(
        [*small, "--prompt-min", "8", "--prompt-max", "32", "--completion-max", "32"]
    )
    assert [r[0] for r in rows] == ["TRL padded", "packtools", "shared prompt"]
    tokens, memory = [r[2] for r in rows], [r[5] for r in rows]  # ratios to TRL padded (exact, deterministic)
    assert tokens[0] == memory[0] == 1.0 and tokens[2] < tokens[1] < 1.0 and memory[2] < memory[1] < 1.0
    assert sorted(projections) == [4, 16, 64] and projections[64][0][2] < projections[4][0][2]
    mean_before, worst_before, mean_after, worst_after = balance  # busiest rank's prompt tokens / mean
    assert 1.0 <= mean_after < mean_before and worst_after <= worst_before


def _update_gap(a, b):
    """The largest difference between two one-step weight updates, relative to the largest update entry."""
    scale = max(float(u.abs().max()) for u in a.values())
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


@pytest.mark.slow
@pytest.mark.xdist_group("grpo_ddp")
def test_two_processes_equal_one_process_on_the_same_global_batch(tmp_path, two_process_runs):
    """One optimizer step on 2 processes (torchrun, gloo; per-device batch B) against one process (batch 2B) on
    the same global batch: the generation is replaced by fixed completions per (prompt, copy) (the sampler's
    prompts, TRL's ``num_items_in_batch`` gather, the reference forward kept).  grpo and dapo (B = 2G): TRL's own
    2-process step equals its 1-process step, and packtools' (plain and prompt-shared, its sampler moving whole
    groups between the ranks to balance their prompt tokens) equals both; no group is split across ranks.  bnpo
    normalizes by each rank's own token count, so TRL's 2-process step is not its 1-process step; packtools
    (TRL's order, balance_groups=False) equals TRL's 2-process step there.  With B = G / 2 each group is cut
    across the ranks (TRL's order: "auto" says why) and prompt sharing (within one forward) is still exact."""
    import _grpo_ddp_global_worker as W

    two = [torch.load(two_process_runs / "two" / f"global-rank{r}.pt", weights_only=False) for r in (0, 1)]
    one = W.run(tmp_path / "one", 1)
    gaps, balance = {}, {}
    for case, _, per_device in W.CASES:
        single = one[case, "trl"]
        assert single["world"] == 1 and two[0][case, "trl"]["world"] == 2
        (whole,) = single["prompts"]
        ranks = [two[r][case, "trl"]["prompts"][0] for r in (0, 1)]
        assert ranks[0] + ranks[1] == whole  # the global batch is rank 0's prompts, then rank 1's
        for variant, prepared, _ in W.VARIANTS:  # where each variant's sampler put the groups
            got = [two[r][case, variant]["prompts"][0] for r in (0, 1)]
            plan = two[0][case, variant]["plan"]
            assert sorted(got[0] + got[1]) == sorted(whole)  # the same global batch
            if per_device == 2:  # half a group on each rank: TRL's order, and the plan says why
                assert got == ranks and all(len(set(g)) == 1 and len(g) == 2 for g in got)
                assert not prepared or "TRL's sampler order: a rank's share" in plan
                continue
            for g in got:  # G = 4 copies of each prompt, consecutive: whole groups on each rank
                assert all(len(set(g[i : i + 4])) == 1 for i in range(0, len(g), 4)) and len(g) == per_device
            if (
                prepared and case != "bnpo"
            ):  # balanced: prompt tokens (words) per rank no worse than TRL's order
                assert "whole groups per rank" in plan
                load = [sum(len(p.split()) for p in g) for g in got]
                trl_load = [sum(len(p.split()) for p in g) for g in ranks]
                balance[case, variant] = (trl_load, load)
                assert max(load) <= max(trl_load)
            else:
                assert got == ranks
        for variant, _, _ in W.VARIANTS:
            # DDP: both ranks hold the same weights after the step
            assert _update_gap(two[0][case, variant]["update"], two[1][case, variant]["update"]) == 0.0
            gaps[case, variant, "2proc vs TRL 2proc"] = _update_gap(
                two[0][case, "trl"]["update"], two[0][case, variant]["update"]
            )
            gaps[case, variant, "2proc vs TRL 1proc"] = _update_gap(
                single["update"], two[0][case, variant]["update"]
            )
            gaps[case, variant, "1proc vs TRL 1proc"] = _update_gap(
                single["update"], one[case, variant]["update"]
            )
    print("\n".join(f"{k}: {v:.3g}" for k, v in gaps.items()))
    print("prompt words per rank, TRL's order -> balanced:", balance)
    assert any(max(b) < max(a) for a, b in balance.values())  # the balancing moved something here
    for (case, variant, what), gap in gaps.items():
        if case == "bnpo" and what == "2proc vs TRL 1proc":
            assert gap > 1e-2, (case, variant, what, gap)  # TRL's own semantics: per-rank token means
        else:
            assert gap <= TOL, (case, variant, what, gap)


@pytest.mark.slow
def test_continuous_batching_generation_is_refused_on_packtools_attention_and_runs_on_the_models_own(
    tmp_path,
):
    """TRL's ``use_transformers_continuous_batching`` generates with the policy itself, and transformers'
    continuous batching runs only on sdpa, eager or FlashAttention: on the attention packtools installs
    (``packtools_tree``, ``packtools_sdpa``) the first step stopped inside ``generate_batch`` (failed before this
    refusal).  Refused by name, the trainer left as TRL built it; plain rows on the model's own sdpa train as TRL."""
    config = dict(
        loss_type="grpo",
        beta=0.1,
        use_transformers_continuous_batching=True,
        # The KV cache sized for these 16 short sequences: left to itself transformers sizes it from the
        # machine's memory (TRL asks for half of it: 12 GB and most of the test's time on a 24 GB CPU machine).
        transformers_continuous_batching_config=dict(num_blocks=4, max_batch_tokens=256),
        max_steps=1,
        max_completion_length=4,
    )
    for share in ("auto", False):
        trainer = build(tmp_path, **config)
        with pytest.raises(PackingError, match="use_transformers_continuous_batching=True .* on 'packtools_"):
            prepare_grpo_trainer(trainer, share_prompt=share)
        assert type(trainer) is trl.GRPOTrainer and trainer.model.config._attn_implementation == "sdpa"
    ours = build(tmp_path, **config)
    prepare_grpo_trainer(ours, share_prompt=False, segmented_sdpa=False)
    assert_same_run(train(build(tmp_path, **config)), train(ours))


def test_a_model_trls_fused_head_cannot_run_is_refused_by_name(tmp_path):
    """Llama 4's ``base_model`` is the model itself, so TRL's fused LM head (``model.base_model`` for the hidden
    states) fails inside TRL's own forward; ``prepare_grpo_trainer`` raised that ``AttributeError`` from its probe
    (failed before: 'MoeCausalLMOutputWithPast' object has no attribute 'last_hidden_state'), and with
    ``check_isolation=False`` at the first step.  Refused by name, the trainer left as TRL built it."""
    from _hf_models import word_tokenizer as words

    from packtools.testing import VOCAB as TINY_VOCAB
    from packtools.testing import tiny_model

    model = tiny_model("Llama 4")
    model.config.pad_token_id, model.config.eos_token_id = PAD, EOS
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
        report_to=[], use_cpu=True, save_strategy="no", bf16=False, disable_tqdm=True,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model,
        reward_funcs=reward_len,
        args=args,
        train_dataset=datasets.Dataset.from_list(prompts()),
        processing_class=words(TINY_VOCAB),
    )
    for check in (True, False):
        with pytest.raises(
            PackingError, match="TRL's fused LM head cannot run Llama4ForCausalLM.*GRPOTrainer"
        ):
            prepare_grpo_trainer(trainer, check_isolation=check)
        assert type(trainer) is trl.GRPOTrainer and vars(trainer).get("packtools_step") is None


@pytest.mark.parametrize("share", ["auto", False], ids=["default-shared", "plain"])
def test_bf16_mixed_precision_is_probed_at_its_precision_and_still_catches_a_leak(
    tmp_path, monkeypatch, share
):
    """``bf16=True`` on a float32 model: accelerate's autocast runs TRL's and packtools' log-probability forwards
    in bfloat16, and the probe allowed only float32 rounding, so it refused a plain Llama as "absolute position
    embeddings, or a leak" (failed before: differ from TRL's padded ones by 0.0381).  Probed at bfloat16's
    tolerance, the run prepares, a micro-batch equals TRL's within bfloat16 rounding, and a leak is refused."""
    config = dict(beta=0.1, loss_type="grpo", bf16=True)
    ours, theirs = build(tmp_path, True, share=share, **config), build(tmp_path, **config)
    assert theirs.accelerator.mixed_precision == "bf16"
    assert next(theirs.model.parameters()).dtype == torch.float32
    batch = scored_batch(theirs)
    exact = loss_metrics_grads(build(tmp_path, **{**config, "bf16": False}), batch)  # float32 throughout
    trl_error = differs(exact, loss_metrics_grads(theirs, batch))
    our_error = differs(exact, loss_metrics_grads(ours, batch))
    assert 0 < our_error <= 2 * trl_error  # bfloat16's rounding, as large as TRL's own
    layout, broken = ("share_prompts", _siblings_see_each_other) if share else ("unpad_completions", _leaky)
    monkeypatch.setattr(rl_grpo, layout, broken)
    with pytest.raises(
        PackingError, match="isolation probe|leak"
    ):  # True: "auto" would fall back to plain rows
        build(tmp_path, True, share=bool(share), **config)
