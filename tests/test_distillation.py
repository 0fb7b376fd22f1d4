"""TRL's DistillationTrainer with padding-free student and teacher forwards equals TRL's padded one.

Two trainers from the same seeds and weights: TRL as it is, and one prepared by ``prepare_distillation_trainer``.
Generation is TRL's (sampling from the global RNG seeded before each run), so both see the same completions while
their students agree. One micro-batch through ``compute_loss`` gives the same loss, entropy and gradients; two
optimizer steps end with the same weights and logs (1e-5 relative, fp32 CPU). A negative control (the sequences
of the row seeing each other) must fail the same comparison.
"""

import json
import sys

import pytest
from _hf_models import word_tokenizer
from _trl_setup import TOL, datasets, torch, transformers, trl
from test_grpo import TIMING, VOCAB, assert_close, differs, prompts, tiny

from packtools import prepare_trainer
from packtools.errors import PackingError
from packtools.integrations import unprepare
from packtools.integrations.rl import distillation as rl_distillation
from packtools.integrations.rl.distillation import prepare_distillation_trainer


def build(tmp_path, prepared=False, kind="llama", lora=False, teacher=None, **config):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
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
        beta=0.5,
    )
    kwargs.update(config)
    extra = {}
    if lora:  # TRL unwraps the PEFT model to its base model's backbone (the adapters inside it)
        peft = pytest.importorskip("peft")
        extra["peft_config"] = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
    trainer = trl.DistillationTrainer(
        tiny(kind),
        teacher_model=tiny(teacher or kind, seed=1),
        args=trl.DistillationConfig(**kwargs),
        train_dataset=datasets.Dataset.from_list(prompts()),
        processing_class=word_tokenizer(VOCAB),
        **extra,
    )
    return prepare_distillation_trainer(trainer) if prepared else trainer


def scored_batch(trainer):
    trainer.model.train()
    transformers.set_seed(0)
    return trainer._generate_and_score_completions(prompts()[:4])


def loss_metrics_grads(trainer, batch):
    trainer.model.zero_grad()
    for values in trainer._metrics["train"].values():
        values.clear()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    assert grads
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items() if v}, grads


@pytest.mark.parametrize(("kind", "lora"), [("llama", False), ("qwen3", False), ("llama", True)])
def test_micro_batch_loss_entropy_and_gradients_equal_trl(tmp_path, kind, lora):
    theirs, ours = build(tmp_path, kind=kind, lora=lora), build(tmp_path, True, kind=kind, lora=lora)
    assert type(ours).__name__ == "PackedDistillationTrainer"
    assert lora == any("lora" in name for name, _ in ours.model.named_parameters())
    batch = scored_batch(theirs)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    assert int(mask.sum(1).min()) < mask.shape[1]  # really padded
    assert differs(loss_metrics_grads(theirs, batch), loss_metrics_grads(ours, batch)) <= TOL


@pytest.mark.parametrize(
    ("kind", "teacher", "config"),
    [("qwen3", "llama", {"beta": 0.0, "temperature": 0.7}), ("llama", "qwen3", {"beta": 1.0})],
    ids=["forward-kl", "reverse-kl"],
)
def test_a_teacher_of_another_family_and_each_divergence_equal_trl(tmp_path, kind, teacher, config):
    """TRL takes a teacher of another family (only the vocabulary must match); forward KL (``beta=0``, with a
    temperature) and reverse KL (``beta=1``); completions of different lengths in the batch."""
    theirs = build(tmp_path, kind=kind, teacher=teacher, **config)
    ours = build(tmp_path, True, kind=kind, teacher=teacher, **config)
    assert type(ours.teacher_model) is not type(ours.model)
    batch = scored_batch(theirs)
    if (
        kind == "qwen3"
    ):  # its sampled completions end early (EOS) in some sequences: right padding inside the batch
        assert len(set(batch["completion_mask"].sum(1).tolist())) > 1
    assert differs(loss_metrics_grads(theirs, batch), loss_metrics_grads(ours, batch)) <= TOL


def test_the_negative_control_fails(tmp_path, monkeypatch):
    """The row's sequences attending to each other (no positions, no cu_seq_lens): the same comparison fails."""
    theirs, ours = build(tmp_path), build(tmp_path, True)
    batch = scored_batch(theirs)
    original = rl_distillation.padding_free_hidden

    def leaky(model, input_ids, attention_mask, keep):
        model, backbone = rl_distillation._backbone(model)
        row = rl_distillation.unpad_completions(input_ids, attention_mask, keep)
        hidden = backbone(input_ids=row.ids[None], use_cache=False).last_hidden_state
        dest = row.dest[..., None].expand(*row.dest.shape, hidden.shape[-1])
        return hidden.new_zeros(dest.shape).masked_scatter(dest, hidden[0, row.source])

    monkeypatch.setattr(rl_distillation, "padding_free_hidden", leaky)
    assert differs(loss_metrics_grads(theirs, batch), loss_metrics_grads(ours, batch)) > 1e-3
    monkeypatch.setattr(rl_distillation, "padding_free_hidden", original)


def test_two_training_steps_equal_trl(tmp_path):
    runs = []
    for prepared in (False, True):
        trainer = build(tmp_path, prepared, gradient_accumulation_steps=2)
        transformers.set_seed(0)
        trainer.train()
        runs.append(trainer)
    theirs, ours = runs
    start = tiny("llama")
    moved = max(
        float((p - s).detach().abs().max()) for p, s in zip(ours.model.parameters(), start.parameters())
    )
    assert moved > 1e-3  # the steps trained
    for (name, p), (_, q) in zip(theirs.model.named_parameters(), ours.model.named_parameters()):
        assert_close(p.detach().numpy(), q.detach().numpy(), name)
    assert len(theirs.state.log_history) == len(ours.state.log_history)
    for a, b in zip(theirs.state.log_history, ours.state.log_history):
        assert sorted(a) == sorted(b)
        for key, value in a.items():
            if key not in TIMING:
                assert_close(value, b[key], key)


def test_refusals_by_name_and_unprepare(tmp_path):
    trainer = build(tmp_path)
    with pytest.raises(
        PackingError, match=r"prepare_trainer got a DistillationTrainer.*prepare_distillation_trainer"
    ):
        prepare_trainer(trainer)

    class Mine(trl.DistillationTrainer):
        def _compute_loss(self, *args, **kwargs):
            return super()._compute_loss(*args, **kwargs)

    mine = object.__new__(Mine)
    with pytest.raises(PackingError, match=r"Mine overrides _compute_loss"):
        prepare_distillation_trainer(mine)
    with pytest.raises(PackingError, match="expects a trl.DistillationTrainer"):
        prepare_distillation_trainer(object())
    prepared = prepare_distillation_trainer(build(tmp_path))
    assert type(unprepare(prepared)) is trl.DistillationTrainer


@pytest.mark.parametrize(
    ("kind", "teacher", "role"), [("gpt2", "llama", "student"), ("llama", "gpt2", "teacher")]
)
def test_absolute_positions_are_refused_by_the_probe(tmp_path, kind, teacher, role):
    """TRL's padded forward numbers a left-padded prompt from the row's start; with learned absolute positions
    (GPT-2) the padding-free row (positions from 0, as generate) computes another step: here a GPT-2 student's loss
    0.355 against TRL's 0.377 and entropy 1.51 against 1.41, a GPT-2 teacher's loss 0.385 against 0.384, with no
    error, before the probe refused them."""
    theirs = build(tmp_path, kind=kind, teacher=teacher)
    with pytest.raises(
        PackingError, match=rf"the {role} GPT2LMHeadModel: packtools' padding-free hidden states differ"
    ):
        prepare_distillation_trainer(theirs)
    assert type(theirs) is trl.DistillationTrainer and "packtools_step" not in vars(theirs)
    # what the probe guards: the same micro-batch, padding-free without it, is not TRL's step
    ours = build(tmp_path, kind=kind, teacher=teacher)
    prepare_distillation_trainer(ours, check_isolation=False)
    batch = scored_batch(theirs)
    assert differs(loss_metrics_grads(theirs, batch), loss_metrics_grads(ours, batch)) > 1e-2


def tiny_gpt_oss(seed=0):
    from packtools.testing import tiny_config

    config = tiny_config("GPT-OSS", "eager")
    config.vocab_size, config.pad_token_id, config.eos_token_id = VOCAB, 0, 1
    torch.manual_seed(seed)
    return transformers.GptOssForCausalLM(config).float()


@pytest.mark.parametrize("role", ["student", "teacher"])
def test_masks_without_position_ids_are_refused_by_name(tmp_path, monkeypatch, role):
    """GPT-OSS builds its masks without position_ids, and TRL's distillation forward calls the backbone directly:
    the row's sequences attend to each other (a GPT-OSS student with a Llama teacher and check_isolation=False: the
    loss 0.310 against TRL's 0.304, the entropy 1.657 against 1.672, no error). Refused by name, probes or not."""
    import test_distillation as this

    monkeypatch.setattr(
        this,
        "tiny",
        lambda kind, seed=0, plain=tiny: tiny_gpt_oss(seed) if kind == "gpt_oss" else plain(kind, seed),
    )
    kinds = ("gpt_oss", "llama") if role == "student" else ("llama", "gpt_oss")
    trainer = build(tmp_path, kind=kinds[0], teacher=kinds[1])
    with pytest.raises(
        PackingError, match=rf"the {role} GptOssForCausalLM builds its attention masks without"
    ):
        prepare_distillation_trainer(trainer, check_isolation=False)
    assert type(trainer) is trl.DistillationTrainer


def test_prepared_block_dispatches_the_distillation_trainer(tmp_path):
    from packtools.integrations import prepared

    trainer = build(tmp_path)
    with prepared(trainer):
        assert type(trainer).__name__ == "PackedDistillationTrainer"
    assert type(trainer) is trl.DistillationTrainer


@pytest.mark.slow
def test_two_processes_equal_trl(tmp_path):
    """DDP over two processes (gloo): two optimizer steps with accumulation end with TRL's padded weights and logs
    on every rank (a Qwen3 teacher for a Llama student)."""
    import _launch

    _launch.torchrun(2, "_distillation_worker.py", str(tmp_path), log=tmp_path / "torchrun.log")
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["world"] == 2 and record["type"] == "PackedDistillationTrainer"
        assert record["diff"] <= TOL
        pairs = [pair for step in record["logs"] for pair in step]
        assert len(pairs) >= 4
        for theirs, ours in pairs:
            assert_close(theirs, ours, "log")


def test_a_multimodal_teacher_is_refused_by_name(tmp_path, monkeypatch):
    """A Qwen2-VL teacher (TRL's _is_vlm looks at the student only) passed prepare_distillation_trainer with
    check_isolation=False: its padding-free text rows have no 3-D text positions, so the sequences of a row saw
    each other (the isolation probe measures 0.28 on its logits) with no error. Refused by name now, as GRPO does."""
    from packtools.testing import tiny_vl_model

    vocab = tiny_vl_model("qwen2_vl").config.get_text_config().vocab_size

    def models(kind, seed=0):
        if seed == 1:
            return tiny_vl_model("qwen2_vl")
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=vocab, eos_token_id=2,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)

    monkeypatch.setattr(sys.modules[__name__], "tiny", models)
    for check in (False, True):
        trainer = build(tmp_path)
        with pytest.raises(PackingError, match="Qwen2VLForConditionalGeneration is a multimodal model"):
            prepare_distillation_trainer(trainer, check_isolation=check)
        assert type(trainer) is trl.DistillationTrainer


def test_several_gpus_in_one_process_are_refused_before_anything_changes(tmp_path):
    """``args.n_gpu > 1``: Trainer wraps the student in torch.nn.DataParallel, which chunks the packed row's tensors
    apart from their cu_seq_lens and runs the replicas in threads where the forward check is off.  prepare_trainer,
    prepare_grpo_trainer and the preference prepare_* refused it; prepare_distillation_trainer prepared the trainer
    with no error.  Refused by name now, the trainer left as TRL built it."""
    trainer = build(tmp_path)
    trainer.args._n_gpu = 2  # what TrainingArguments counts on a machine with two visible GPUs
    with pytest.raises(PackingError, match=r"prepare_distillation_trainer: n_gpu=2.*DataParallel.*torchrun"):
        prepare_distillation_trainer(trainer)
    assert type(trainer) is trl.DistillationTrainer
    trainer.args._n_gpu = 1
    assert prepare_distillation_trainer(trainer) is trainer
