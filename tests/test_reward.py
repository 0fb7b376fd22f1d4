"""TRL's RewardTrainer without padding equals TRL's padded step: loss, logged metrics and every gradient.

Each case builds two trainers from the same seeds, TRL's as it is (padded batches, the score read at each
sequence's last non-pad token) and one prepared by ``prepare_reward_trainer`` (one padding-free row, the score
read at each document's own last token), on tiny Llama and Qwen3 sequence-classification models in fp32 on
CPU.  Both compute the loss of the same pairs; loss, metrics and gradients must agree within 1e-5.  Negative
controls: reading the score at the row's last token, and a chosen sequence attending its rejected one, must
differ from TRL (and the second is what the isolation probe refuses).
"""

import re

import numpy as np
import pytest
from _hf_models import (
    EOS,
    PAD,
    VOCAB,
    exact_step_args,
    loss_metrics_grads,
    text_pairs,
    tiny_preference_model,
    word_tokenizer,
)
from _trl_setup import TOL, datasets, torch, transformers, trl

from packtools import prepare_trainer
from packtools.errors import PackingError
from packtools.integrations import unprepare
from packtools.integrations.preference import reward, reward_scores
from packtools.integrations.preference.data import pack_reward_pairs
from packtools.integrations.preference.reward import prepare_reward_trainer

METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens")


def tiny_model(family="llama", impl="sdpa", seed=0):
    return tiny_preference_model(family, impl, seed, num_labels=1)


def build(tmp_path, family="llama", impl="sdpa", n=12, margin=False, lora=False, **config):
    peft_config = None
    if lora:
        peft = pytest.importorskip("peft")
        peft_config = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            modules_to_save=["score"],
            task_type="SEQ_CLS",
        )
    kwargs = exact_step_args(tmp_path, **config)
    return trl.RewardTrainer(
        tiny_model(family, impl),
        args=trl.RewardConfig(**kwargs),
        train_dataset=datasets.Dataset.from_list(text_pairs(n, margin=margin)),
        processing_class=word_tokenizer(),
        peft_config=peft_config,
    )


def assert_same(a, b, tol=TOL):
    (la, ma, ga), (lb, mb, gb) = a, b
    assert abs(la - lb) <= tol * max(1.0, abs(la)), (la, lb)
    assert set(METRICS) <= ma.keys() == mb.keys()
    bad = {k: (ma[k], mb[k]) for k in ma if abs(ma[k] - mb[k]) > tol * max(1.0, abs(ma[k]))}
    assert not bad, bad
    assert ga.keys() == gb.keys() and len(ga) > 0
    worst = max(float((ga[k] - gb[k]).abs().max()) / max(1.0, float(ga[k].abs().max())) for k in ga)
    assert worst < tol, worst
    head = [k for k in ga if "score" in k and k.endswith("weight")]
    assert head and max(float(ga[k].abs().max()) for k in head) > 1e-3  # gradients that could differ


def rel(a, b):
    """Relative difference of two sets of tensors: ||a - b|| / ||b|| over all of them."""
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    return (num / sum(float(b[k].pow(2).sum()) for k in b)) ** 0.5


class ShapeRecorder:
    """The input_ids shape and attention_mask presence of every backbone call."""

    def __init__(self, model):
        self.calls = []
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        model.model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        self.calls.append((tuple(ids.shape), kwargs.get("attention_mask") is not None))


CASES = {
    "llama": dict(),
    "qwen3": dict(family="qwen3"),
    "llama-margin": dict(margin=True),
    "qwen3-margin-center": dict(family="qwen3", margin=True, center_rewards_coefficient=0.1),
    "llama-center-eager": dict(impl="eager", center_rewards_coefficient=0.5),
    "llama-block-mask": dict(segmented_sdpa=False),
    "qwen3-checkpointing": dict(family="qwen3", gradient_checkpointing=True),
    "llama-lora-margin": dict(lora=True, margin=True),
    "llama-no-checkpointing": dict(
        margin=True, gradient_checkpointing=False
    ),  # RewardConfig's default is True
    "qwen3-no-checkpointing": dict(family="qwen3", gradient_checkpointing=False),
}


def engage_checkpointing(trainer):
    if trainer.args.gradient_checkpointing:  # Trainer does it in train(); these tests call compute_loss
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
        )


@pytest.mark.parametrize("case", list(CASES))
def test_micro_batch_equals_trl_padded(tmp_path, case):
    config = dict(CASES[case])
    segmented = config.pop("segmented_sdpa", True)
    padded = build(tmp_path, **config)
    prepared = prepare_reward_trainer(build(tmp_path, **config), segmented_sdpa=segmented)
    for trainer in (padded, prepared):
        engage_checkpointing(trainer)
    assert type(prepared).__name__ == "PackedRewardTrainer"
    recorder = ShapeRecorder(prepared.model)
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    assert ("margin" in batch) == bool(config.get("margin"))
    want = loss_metrics_grads(padded, batch)
    assert_same(want, loss_metrics_grads(prepared, batch))
    real = int(batch["attention_mask"].sum())
    assert real < batch["attention_mask"].numel()  # TRL padded this batch
    assert recorder.calls == [((1, real), False)]  # one padding-free row, real tokens only
    assert 0.0 < want[1]["accuracy"] < 1.0 or want[1]["accuracy"] in (0.0, 1.0)


@pytest.mark.parametrize("case", ["llama-margin", "qwen3-margin-center"])
def test_packed_rows_equal_trl_padded_on_their_pairs(tmp_path, case):
    trainer = build(tmp_path, n=16, **CASES[case])
    reference = build(tmp_path, n=16, **CASES[case])
    packed = pack_reward_pairs(trainer.train_dataset, 80)
    assert max(sum(r) for r in packed["seq_lengths"]) <= 96 and len(packed) < len(trainer.train_dataset)
    prepare_reward_trainer(trainer, packed)
    rows = [packed[0], packed[1]]
    batch = trainer.data_collator(rows)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    # the pairs of these rows, found by their tokens in TRL's dataset
    index = {
        (tuple(r["chosen_ids"]), tuple(r["rejected_ids"])): i for i, r in enumerate(reference.train_dataset)
    }
    pairs = []
    for row in rows:
        ids, cut = row["input_ids"], np.cumsum([0, *row["seq_lengths"]])
        seqs = [tuple(ids[a:b]) for a, b in zip(cut[:-1], cut[1:])]
        pairs += [index[(seqs[k], seqs[k + 1])] for k in range(0, len(seqs), 2)]
    assert len(pairs) >= 4
    margins = [reference.train_dataset[i]["margin"] for i in pairs]
    assert np.allclose(batch["margin"].numpy(), margins)
    want = loss_metrics_grads(reference, reference.data_collator([reference.train_dataset[i] for i in pairs]))
    assert_same(want, loss_metrics_grads(trainer, batch))


def test_training_with_accumulation_equals_trl(tmp_path):
    """trainer.train(), two optimizer steps of two micro-batches: the parameters TRL's padded run reaches."""
    config = dict(gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=2, margin=True)
    padded = build(tmp_path, **config)
    prepared = prepare_reward_trainer(build(tmp_path, **config))
    start = {k: p.detach().clone() for k, p in padded.model.named_parameters()}
    padded.train()
    prepared.train()
    pa_, pb = dict(padded.model.named_parameters()), dict(prepared.model.named_parameters())
    moved = {k: (pa_[k] - start[k]).detach() for k in pa_}
    assert rel({k: pb[k].detach() - start[k] for k in pa_}, moved) < TOL  # two SGD steps of lr 1
    assert max(float(m.abs().max()) for m in moved.values()) > 1e-3


def test_packed_accumulation_is_the_mean_over_all_pairs_of_the_step(tmp_path):
    """Packed micro-batches of unequal pair counts: the step's gradient is that of all its pairs at once, and so
    are the logged mean_reward, accuracy and margin (on main: means of the micro-batches' means)."""
    trainer = build(
        tmp_path,
        n=16,
        margin=True,
        gradient_accumulation_steps=3,
        per_device_train_batch_size=1,
        max_steps=1,
        logging_strategy="steps",
        logging_steps=1,
    )
    reference = build(tmp_path, n=16, margin=True)
    packed = pack_reward_pairs(trainer.train_dataset, 80)
    prepare_reward_trainer(trainer, packed)
    seen = []
    inner = trainer.data_collator

    def record(features):
        seen.append([(tuple(f["input_ids"]), tuple(f["seq_lengths"])) for f in features])
        return inner(features)

    trainer.data_collator = record
    before = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    trainer.train()
    step = {k: before[k] - p.detach() for k, p in trainer.model.named_parameters()}
    index = {
        (tuple(r["chosen_ids"]), tuple(r["rejected_ids"])): i for i, r in enumerate(reference.train_dataset)
    }
    micro = []
    for batch in seen[:3]:
        pairs = []
        for ids, lengths in batch:
            cut = np.cumsum([0, *lengths])
            seqs = [ids[a:b] for a, b in zip(cut[:-1], cut[1:])]
            pairs += [index[(seqs[k], seqs[k + 1])] for k in range(0, len(seqs), 2)]
        micro.append(pairs)
    assert len({len(m) for m in micro}) > 1, micro  # unequal micro-batches
    collate = reference.data_collator
    whole = loss_metrics_grads(reference, collate([reference.train_dataset[i] for m in micro for i in m]))
    worst = max(
        float((step[k] - whole[2][k]).abs().max()) / max(1.0, float(whole[2][k].abs().max())) for k in step
    )
    assert worst < TOL, worst
    logged = trainer.state.log_history[0]
    bad = {
        k: (logged[k], whole[1][k])
        for k in ("mean_reward", "accuracy", "margin")
        if abs(logged[k] - whole[1][k]) > TOL
    }
    assert not bad, bad
    per_micro = [
        loss_metrics_grads(reference, collate([reference.train_dataset[i] for i in m]))[2] for m in micro
    ]
    mean_of_means = {k: sum(g[k] for g in per_micro) / 3 for k in step}
    assert max(float((mean_of_means[k] - whole[2][k]).abs().max()) for k in step) > 1e-4  # what TRL would do


# -- negative controls -----------------------------------------------------------------------------------
def row_last_token(batch):
    """The wrong rule: every score read at the row's last token (transformers' pooling on a packed row)."""
    n = batch.flat["input_ids"].shape[1]
    return reward_scores.RewardBatch(batch.flat, torch.full_like(batch.ends, n - 1), batch.view)


def chosen_sees_rejected(batch):
    """The wrong layout: sequences 2k and 2k + 1 of the row as one sequence.  On packed pair rows (chosen,
    rejected, chosen, ...) that is each pair's chosen and rejected together: the rejected attends its chosen."""
    flat = dict(batch.flat)
    merged = torch.cat([flat["cu_seq_lens_q"][:1], flat["cu_seq_lens_q"][2::2]])
    starts = merged[:-1].long()
    lengths = (merged[1:] - merged[:-1]).long()
    flat["position_ids"] = (torch.arange(int(merged[-1])) - torch.repeat_interleave(starts, lengths))[None]
    flat["cu_seq_lens_q"] = flat["cu_seq_lens_k"] = merged
    flat["max_length_q"] = flat["max_length_k"] = int(lengths.max())
    return reward_scores.RewardBatch(flat, batch.ends, batch.view)


@pytest.mark.parametrize("wrong", [row_last_token, chosen_sees_rejected])
def test_negative_controls_differ_from_trl(tmp_path, monkeypatch, wrong):
    """On packed pair rows: the right rule equals TRL on the rows' pairs, each wrong one does not."""
    trainer = build(tmp_path, n=16, margin=True)
    reference = build(tmp_path, n=16, margin=True)
    packed = pack_reward_pairs(trainer.train_dataset, 96)
    prepare_reward_trainer(trainer, packed)
    index = {
        (tuple(r["chosen_ids"]), tuple(r["rejected_ids"])): i for i, r in enumerate(reference.train_dataset)
    }
    ids, cut = packed[0]["input_ids"], np.cumsum([0, *packed[0]["seq_lengths"]])
    seqs = [tuple(ids[a:b]) for a, b in zip(cut[:-1], cut[1:])]
    pairs = [index[(seqs[k], seqs[k + 1])] for k in range(0, len(seqs), 2)]
    assert len(pairs) >= 2
    want = loss_metrics_grads(reference, reference.data_collator([reference.train_dataset[i] for i in pairs]))
    batch = trainer.data_collator([packed[0]])
    assert_same(want, loss_metrics_grads(trainer, batch))  # the right rule first
    real = reward_scores.reward_batch
    for module in (reward, reward_scores):  # the step and the probe
        monkeypatch.setattr(module, "reward_batch", lambda inputs, send=False: wrong(real(inputs, send)))
    with pytest.raises(AssertionError):
        assert_same(want, loss_metrics_grads(trainer, batch))
    if wrong is chosen_sees_rejected:  # the probe catches the leak before training
        with pytest.raises(PackingError, match="scores packed sequences differently"):
            reward_scores.check_reward_isolation(trainer.model)


def step_losses(trainer):
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_bf16_mixed_precision_scores_in_float32_like_trl_and_a_leak_is_still_refused(tmp_path, monkeypatch):
    """``bf16=True`` on a float32 model: accelerate runs the forward under bfloat16 autocast and hands the model's
    outputs back in float32, so TRL's loss reads float32 scores.  The prepared step read the head's own bfloat16
    output and computed the loss in bfloat16 (failed before: its loss was a bfloat16 tensor, 0.65625 against
    TRL's 0.65393 on the first step, over five times TRL's own distance from the float32 run's 0.65344).  Now the
    loss is float32 like TRL's, the first step is within twice TRL's own distance from the float32 run, the second
    within bfloat16's drift, and a leak is still refused at bf16."""
    config = dict(
        bf16=True, per_device_train_batch_size=2, max_steps=2, logging_strategy="steps", logging_steps=1
    )
    padded = build(tmp_path, **config)
    prepared = prepare_reward_trainer(build(tmp_path, **config))
    assert prepared.accelerator.mixed_precision == "bf16"
    assert next(prepared.model.parameters()).dtype == torch.float32
    batch = padded.data_collator([padded.train_dataset[i] for i in range(2)])
    got = {}
    for name in ("padded", "prepared"):
        trainer = build(tmp_path, **config)
        if name == "prepared":
            prepare_reward_trainer(trainer)
        model = trainer.accelerator.prepare_model(
            trainer.model
        )  # what train() runs: autocast, float32 outputs
        loss, outputs = trainer.compute_loss(model, dict(batch), return_outputs=True)
        got[name] = (loss, outputs.logits)
    assert got["padded"][0].dtype == got["padded"][1].dtype == torch.float32
    assert got["prepared"][0].dtype == got["prepared"][1].dtype == torch.float32
    exact = step_losses(build(tmp_path, **{**config, "bf16": False}))  # float32 throughout
    theirs, ours = step_losses(padded), step_losses(prepared)
    assert len(exact) == len(theirs) == len(ours) == 2
    # the first step: the same bfloat16 forward read in float32, as close to the float32 run as TRL's (before: a
    # bfloat16 loss, over five times TRL's distance)
    assert 0 < abs(theirs[0] - exact[0]) and abs(ours[0] - exact[0]) <= 2 * abs(theirs[0] - exact[0])
    # the second follows an optimizer step on bfloat16 gradients, whose rounding depends on the layout (packed
    # against padded matmuls): both drift by bfloat16's rounding (0.0016 and 0.0047 of 0.52 on an AMD EPYC CPU),
    # which a float32-against-bfloat16 loss would exceed from the first step
    assert max(abs(theirs[1] - exact[1]), abs(ours[1] - exact[1])) <= 0.01
    real = reward_scores.reward_batch
    monkeypatch.setattr(
        reward_scores, "reward_batch", lambda inputs, send=False: chosen_sees_rejected(real(inputs, send))
    )
    with pytest.raises(PackingError, match="scores packed sequences differently"):
        prepare_reward_trainer(build(tmp_path, **config))


# -- the step owner, refusals, undo ----------------------------------------------------------------------
def test_unprepare_gives_the_trainer_back(tmp_path):
    from packtools.integrations.trainers.step import plan_of

    trainer = build(tmp_path)
    cls, collator = type(trainer), trainer.data_collator
    prepare_reward_trainer(trainer, pack_reward_pairs(trainer.train_dataset, 64))
    assert type(trainer).__name__ == "PackedRewardTrainer" and isinstance(trainer, cls)
    assert trainer.model.config._attn_implementation == "packtools_sdpa"
    assert isinstance(plan_of(trainer), reward.RewardPlan)
    with pytest.raises(PackingError, match="prepared twice"):
        prepare_reward_trainer(trainer)
    unprepare(trainer)
    assert type(trainer) is cls and trainer.data_collator is collator
    assert trainer.model.config._attn_implementation == "sdpa"
    assert plan_of(trainer) is None


def test_prepared_block_dispatches_reward_trainers(tmp_path):
    from packtools.integrations import prepared

    trainer = build(tmp_path)
    with prepared(trainer):
        assert type(trainer).__name__ == "PackedRewardTrainer"
    assert type(trainer) is trl.RewardTrainer


def test_refusals_name_the_reason(tmp_path):
    trainer = build(tmp_path)
    with pytest.raises(PackingError, match="prepare_reward_trainer"):
        prepare_trainer(trainer)

    class Mine(trl.RewardTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer.__class__ = Mine
    with pytest.raises(PackingError, match="overrides compute_loss"):
        prepare_reward_trainer(trainer)
    assert type(trainer) is Mine
    trainer.__class__ = trl.RewardTrainer
    with pytest.raises(PackingError, match="max_tokens batches packed rows"):
        prepare_reward_trainer(trainer, max_tokens=64)
    with pytest.raises(PackingError, match="margin"):  # margins would be dropped from the loss
        marg = build(tmp_path, margin=True)
        prepare_reward_trainer(marg, pack_reward_pairs(marg.train_dataset.remove_columns("margin"), 64))
    assert type(marg) is trl.RewardTrainer  # a refused trainer is left as it came
    with pytest.raises(PackingError, match="expects a trl.RewardTrainer"):
        prepare_reward_trainer(object())


def test_pack_reward_pairs_drops_overlong_pairs_with_a_warning():
    import pyarrow as pa

    t = pa.table({"chosen_ids": [[1, 2, 3], [4] * 9], "rejected_ids": [[5], [6]]})
    with pytest.warns(UserWarning, match="1 of 2 pairs are longer than max_length=8"):
        rows, report = pack_reward_pairs(t, 8, return_report=True)
    assert rows.to_pydict()["input_ids"] == [[1, 2, 3, 5]] and report.pairs_dropped == 1
    with pytest.raises(PackingError, match="prompt_ids"):
        pack_reward_pairs(t.append_column("prompt_ids", t.column("rejected_ids")), 8)


def test_evaluate_equals_trl(tmp_path):
    """Evaluation (Trainer.prediction_step -> compute_loss with return_outputs) on TRL's padded eval batches."""
    held_out = datasets.Dataset.from_list(text_pairs(10, seed=5, margin=True))
    results = []
    for trainer in (build(tmp_path, margin=True), prepare_reward_trainer(build(tmp_path, margin=True))):
        results.append(trainer.evaluate(held_out))
    want, got = results
    timing = (
        "eval_runtime",
        "eval_samples_per_second",
        "eval_steps_per_second",
        "eval_model_preparation_time",
    )
    assert want.keys() == got.keys() and "eval_accuracy" in want
    bad = {
        k: (want[k], got[k])
        for k in want
        if k not in timing and abs(want[k] - got[k]) > TOL * max(1, abs(want[k]))
    }
    assert not bad, bad


def stated_figures_exceed(message):
    stated = re.findall(r"(\d\.\d\de[-+]\d\d) > tolerance (\d\.\d\de[-+]\d\d)", message)
    return bool(stated) and all(float(value) > float(limit) for value, limit in stated)


def test_probe_refusal_suggests_a_fix_that_works_for_its_cause(monkeypatch):
    """The reward probe's refusal names a fix for what leaks: a model on 'eager' (which keeps packed sequences
    apart) is not told to use 'eager' or another backend; a hybrid probed before its token-mixing layers run per
    document is told to prepare them, and doing so makes the probe pass.  Every figure stated is outside its
    tolerance."""
    real = reward_scores.reward_batch
    with monkeypatch.context() as patch:  # the wrong layout: each chosen and rejected as one sequence
        patch.setattr(
            reward_scores, "reward_batch", lambda inputs, send=False: chosen_sees_rejected(real(inputs, send))
        )
        with pytest.raises(PackingError) as err:
            reward_scores.check_reward_isolation(tiny_model(impl="eager"))
    message = str(err.value)
    assert "'eager' attention keeps packed sequences apart" in message and "train it padded" in message
    assert "attn_implementation='eager'" not in message and "instead of 'eager'" not in message
    assert stated_figures_exceed(message)

    from _hf_models import tiny_arch

    from packtools.integrations.attention.mixers import run_mixers_per_document

    for arch, impl, head in (
        ("Qwen3-Next", "sdpa", "Qwen3NextForSequenceClassification"),  # transformers refuses the row
        ("GPT-OSS", "eager", "GptOssForSequenceClassification"),  # masks without position_ids: measured
    ):
        config = tiny_arch(arch, impl).config
        config.num_labels, config.pad_token_id = 1, PAD
        torch.manual_seed(0)
        model = getattr(transformers, head)(config).float()
        with pytest.raises(PackingError) as err:
            reward_scores.check_reward_isolation(model)
        message = str(err.value)
        assert "run_mixers_per_document" in message and "attn_implementation=" not in message
        if arch == "GPT-OSS":
            assert "attention masks" in message and stated_figures_exceed(message)
        else:
            assert "can't keep packed sequences apart" in message and "model.layers.0.linear_attn" in message
        run_mixers_per_document(model)  # the fix it names
        assert reward_scores.check_reward_isolation(model) < TOL


# -- families: the score read through each model's own forward and head -----------------------------------
def family_model(name):
    """A tiny reward model of a family whose sequence-classification class is not TRL's test pair."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, num_labels=1,
        attn_implementation="sdpa",
    )  # fmt: skip
    if name == "gpt2":  # its own ForSequenceClassification class; the backbone is `transformer`
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, pad_token_id=PAD, num_labels=1,
            attn_implementation="sdpa", bos_token_id=EOS, eos_token_id=EOS,
        )  # fmt: skip
        return transformers.GPT2ForSequenceClassification(config)
    classes = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
        "mistral": (transformers.MistralConfig, transformers.MistralForSequenceClassification),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForSequenceClassification),
    }
    config_cls, model_cls = classes[name]
    extra = {"head_dim": 16} if name == "gemma" else {}
    return model_cls(config_cls(**common, **extra))


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma", "gpt2"])
def test_other_families_score_each_document_as_alone(name):
    """Packed and alone (the model's own pooling on one unpadded sequence) within 1e-5, through the path
    training takes; the probe also changes one sequence and checks that the others' scores do not move."""
    model = family_model(name)
    assert reward_scores.check_reward_isolation(model, lengths=(6, 11, 2, 9, 4, 7)) < TOL


def test_a_model_that_pools_before_its_head_is_refused_by_name():
    class PooledFirst(transformers.LlamaForSequenceClassification):
        def forward(self, input_ids=None, **kwargs):
            hidden = self.model(input_ids, **{k: v for k, v in kwargs.items() if k != "use_cache"})
            return transformers.modeling_outputs.SequenceClassifierOutput(
                logits=self.score(hidden.last_hidden_state[:, -1])
            )

    torch.manual_seed(0)
    model = PooledFirst(tiny_model().config)
    with pytest.raises(PackingError, match="pools before its head"):
        reward_scores.check_reward_isolation(model)
    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, num_labels=1)
    )  # fmt: skip
    with pytest.raises(PackingError, match="has no 'score' head"):
        reward_scores.score_head(bert)


def test_neftune_is_refused_by_name(tmp_path):
    """NEFTune's noise shrinks with the width of the batch the embeddings see, which padding-free rows change."""
    trainer = build(tmp_path, neftune_noise_alpha=5.0)
    with pytest.raises(
        PackingError, match=r"neftune_noise_alpha=5.0: .*do not call prepare_reward_trainer"
    ) as err:
        prepare_reward_trainer(trainer)
    assert err.value.param == "neftune_noise_alpha"


def test_several_gpus_in_one_process_are_refused_by_name(tmp_path):
    """``args.n_gpu > 1`` (torch.nn.DataParallel) is refused as by prepare_trainer, the message naming the
    prepare_* that refused it (it named none)."""
    trainer = build(tmp_path)
    trainer.args._n_gpu = 2
    with pytest.raises(PackingError, match=r"prepare_reward_trainer: n_gpu=2.*DataParallel.*torchrun"):
        prepare_reward_trainer(trainer)
    assert type(trainer) is trl.RewardTrainer
