"""The trainer adapter: transformers.Trainer and TRL SFTTrainer on packed rows train like one-by-one sequences.

Each trainer run records the rows of every batch it drew (in its own shuffled order); the reference replays
the same accumulation windows with each sequence run alone, SGD, token-weighted per window.  Parameters after
training must agree within 1e-5 (they move by ~5e-2).
"""

import copy
import dataclasses

import numpy as np
import pytest
from _hf_models import (
    PAD,
    Recorder,
    max_diff,
    one_by_one_gap,
    params,
    reference_training,
    sequences,
    sgd_train_args,
    tiny_llama,
    torch,
    transformers,
    word_tokenizer,
)

from packtools import pack_dataset
from packtools.batches.collate import PaddingFreeCollator
from packtools.errors import PackingError
from packtools.integrations import packed_sft_config, prepare_trainer
from packtools.integrations.attention.backends import check_attention_implementation
from packtools.integrations.trainers.guard import check_forward_inputs, guard_model, refuse_prompt_learning
from packtools.integrations.trainers.sft import causal_lm_loss
from packtools.integrations.trainers.step import plan_of

datasets = pytest.importorskip("datasets")

TOL = 1e-5
LR = 0.5
FIELDS = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
CHECKPOINTING = (
    "activation_checkpointing" if "activation_checkpointing" in FIELDS else "gradient_checkpointing"
)


def packed_dataset(n=40, seed=5, max_length=32):
    return pack_dataset(datasets.Dataset.from_list(sequences(n, seed=seed)), max_length)


def train_args(tmp_path, cls=None, **overrides):
    return sgd_train_args(str(tmp_path), LR, cls, **overrides)


def run_trainer(
    tmp_path, model, *, prepare=True, loss_kwargs=None, collator=None, segmented_sdpa=True, **overrides
):
    """Train with transformers.Trainer; return the trained and the reference parameters."""
    reference = copy.deepcopy(model)
    recorder = Recorder(collator or PaddingFreeCollator(PAD))
    args = train_args(tmp_path, **overrides)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=packed_dataset(), data_collator=recorder
    )
    if loss_kwargs is not None:
        trainer.model_accepts_loss_kwargs = loss_kwargs
    if prepare:
        prepare_trainer(trainer, segmented_sdpa=segmented_sdpa)
    trainer.train()
    reference_training(reference, recorder.batches, args.gradient_accumulation_steps, LR)
    return trainer, recorder, params(model), params(reference)


@pytest.mark.parametrize("segmented", [True, False])
def test_trainer_with_accumulation_matches_one_by_one(tmp_path, segmented):
    trainer, recorder, trained, reference = run_trainer(
        tmp_path, tiny_llama("sdpa"), segmented_sdpa=segmented
    )
    # prepare_trainer switches sdpa to packtools' per-sequence sdpa unless told not to.
    assert trainer.model.config._attn_implementation == ("packtools_sdpa" if segmented else "sdpa")
    assert len(recorder.batches) >= 4 and all("seq_lengths" in row for b in recorder.batches for row in b)
    assert max_diff(trained, reference) < TOL
    assert max_diff(trained, params(tiny_llama("sdpa"))) > 1e-2  # training moved the weights


def test_trainer_without_prepare_fails_with_the_clear_error(tmp_path):
    """The README's Trainer example without prepare_trainer: Trainer drops seq_lengths, the collator refuses."""
    trainer = transformers.Trainer(
        model=tiny_llama("sdpa"),
        args=train_args(tmp_path),
        train_dataset=packed_dataset(),
        data_collator=PaddingFreeCollator(PAD),
    )
    with pytest.raises(PackingError, match=r"no 'seq_lengths'.*remove_unused_columns.*prepare_trainer"):
        trainer.train()


def test_trainer_told_rows_are_unpacked_trains_wrong(tmp_path):
    """Negative control: told (wrongly) that rows are unpacked, a plain Trainer mixes packed sequences."""
    collator = PaddingFreeCollator(PAD, unpacked=True)
    trainer, recorder, trained, _ = run_trainer(
        tmp_path, tiny_llama("sdpa"), prepare=False, collator=collator
    )
    assert not any("seq_lengths" in row for b in recorder.batches for row in b)
    packed = packed_dataset()
    ids = {tuple(r["input_ids"]): r for r in packed}
    recorder.batches = [[ids[tuple(row["input_ids"])] for row in b] for b in recorder.batches]
    reference = tiny_llama("sdpa")
    reference_training(reference, recorder.batches, 2, LR)
    assert max_diff(trained, params(reference)) > 10 * TOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["eager", "checkpointing", "no_loss_kwargs", "lora", "lora_checkpointing"],
)
def test_trainer_variants_match_one_by_one(tmp_path, case):
    model = tiny_llama("eager" if case == "eager" else "sdpa")
    overrides = {}
    if "checkpointing" in case:
        overrides[CHECKPOINTING] = True  # with the trainer's default checkpointing kwargs
    if "lora" in case:
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]
        )
        model = peft.get_peft_model(model, config)
    loss_kwargs = False if case == "no_loss_kwargs" else None
    trainer, _, trained, reference = run_trainer(tmp_path, model, loss_kwargs=loss_kwargs, **overrides)
    if "checkpointing" in case:
        assert checkpointing_on(trainer.model)
    if case == "no_loss_kwargs":
        assert trainer.compute_loss_func is causal_lm_loss
    if "lora" in case:
        assert all("lora_" in k for k in trained)
    assert max_diff(trained, reference) < TOL


def checkpointing_on(model):
    on = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.24
    return model.is_gradient_checkpointing if on is None else on


@pytest.mark.slow
def test_sft_trainer_matches_one_by_one(tmp_path):
    trl = pytest.importorskip("trl")
    model = tiny_llama("sdpa")
    start = copy.deepcopy(model)
    recorder = Recorder(PaddingFreeCollator(PAD))
    args = train_args(tmp_path, cls=packed_sft_config, bf16=False, padding_free=False)
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=packed_dataset(),
        processing_class=word_tokenizer(),
        data_collator=recorder,
    )
    prepare_trainer(trainer).train()
    assert checkpointing_on(trainer.model)  # TRL's default, so this also covers checkpointing under TRL
    assert all("seq_lengths" in row and "completion_mask" in row for b in recorder.batches for row in b)
    to_reference, to_start = one_by_one_gap(model, start, recorder.batches, 2, LR)
    assert to_reference < TOL and to_start > 1e-2


def test_sft_trainer_that_prepared_the_dataset_is_refused(tmp_path):
    trl = pytest.importorskip("trl")
    args = train_args(tmp_path, cls=trl.SFTConfig, bf16=False, max_length=None)
    trainer = trl.SFTTrainer(
        model=tiny_llama("sdpa"),
        args=args,
        train_dataset=packed_dataset(n=6),
        processing_class=word_tokenizer(),
        data_collator=PaddingFreeCollator(PAD),
    )
    with pytest.raises(PackingError, match="skip_prepare_dataset"):
        prepare_trainer(trainer)


def test_packed_sft_config_settings_and_refusals(tmp_path):
    pytest.importorskip("trl")
    args = packed_sft_config(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, dataset_kwargs={"x": 1}
    )
    assert (args.packing, args.padding_free) == (False, True)
    assert args.dataset_kwargs == {"x": 1, "skip_prepare_dataset": True}
    with pytest.raises(PackingError, match="packing=True"):
        packed_sft_config(output_dir=str(tmp_path), packing=True)
    with pytest.raises(PackingError, match="skip_prepare_dataset"):
        packed_sft_config(output_dir=str(tmp_path), dataset_kwargs={"skip_prepare_dataset": False})


def test_neftune_is_refused_where_packed_rows_would_shrink_its_noise(tmp_path):
    """transformers' NEFTune bounds each embedding's noise by alpha / sqrt(width x hidden) of the batch it sees: a
    packed row as wide as all its sequences would train with smaller noise than the user's batches, silently."""
    try:  # transformers >= 5.2x keeps it in integrations; before, in trainer_utils
        from transformers.integrations.neftune import neftune_post_forward_hook
    except ImportError:
        from transformers.trainer_utils import neftune_post_forward_hook

    embed = torch.nn.Embedding(50, 16).train()
    embed.neftune_noise_alpha = 5.0
    torch.manual_seed(0)
    bounds = [
        (neftune_post_forward_hook(embed, None, embed(ids)) - embed(ids)).abs().max().item()
        for ids in (torch.zeros(4, 7, dtype=torch.long), torch.zeros(1, 28, dtype=torch.long))
    ]
    assert bounds[1] < 0.6 * bounds[0]  # the same 28 tokens, packed in one row: half the noise (sqrt(7/28))
    trainer = transformers.Trainer(
        model=tiny_llama(),
        args=train_args(tmp_path, neftune_noise_alpha=5.0),
        train_dataset=packed_dataset(),
        data_collator=PaddingFreeCollator(PAD),
    )
    with pytest.raises(
        PackingError, match=r"neftune_noise_alpha=5.0: .* Set neftune_noise_alpha=None"
    ) as err:
        prepare_trainer(trainer)
    assert err.value.param == "neftune_noise_alpha" and plan_of(trainer) is None  # left as it was built
    # Trainer copies the value when built and train() reads its copy: one set on the trainer itself was let through
    trainer = transformers.Trainer(
        model=tiny_llama(),
        args=train_args(tmp_path),
        train_dataset=packed_dataset(),
        data_collator=PaddingFreeCollator(PAD),
    )
    trainer.neftune_noise_alpha = 5.0
    with pytest.raises(PackingError, match=r"neftune_noise_alpha=5.0: "):
        prepare_trainer(trainer)
    pytest.importorskip("trl")
    with pytest.raises(PackingError, match="neftune_noise_alpha=5.0") as err:
        packed_sft_config(output_dir=str(tmp_path), neftune_noise_alpha=5.0)
    assert err.value.param == "neftune_noise_alpha"
    cpu = {"output_dir": str(tmp_path), "report_to": [], "use_cpu": True, "bf16": False}
    assert packed_sft_config(**cpu, neftune_noise_alpha=None).neftune_noise_alpha is None


def test_prepare_trainer_keeps_packing_columns(tmp_path):
    trainer = transformers.Trainer(
        model=tiny_llama(),
        args=train_args(tmp_path),
        train_dataset=packed_dataset(),
        data_collator=PaddingFreeCollator(PAD),
    )
    prepare_trainer(trainer)
    assert trainer.args.remove_unused_columns  # still on: other unused columns are still dropped
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch
    assert batch["cu_seq_lens_q"].shape[0] > 3  # two rows of several sequences, not two sequences
    assert prepare_trainer(trainer) is trainer  # idempotent


def test_collator_that_adds_attention_mask_fails_loudly(tmp_path):
    inner = PaddingFreeCollator(PAD)

    def with_mask(features):
        batch = inner(features)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch

    trainer = transformers.Trainer(
        model=tiny_llama(), args=train_args(tmp_path), train_dataset=packed_dataset(), data_collator=with_mask
    )
    with pytest.raises(PackingError, match="attention_mask"):
        prepare_trainer(trainer).train()


def test_guard_sets_use_cache_false_and_keeps_generation_working():
    model = tiny_llama("sdpa")
    seen = {}
    model.model.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    guard_model(model)
    model.train()
    model(input_ids=torch.tensor([[5, 6, 7, 8]]), position_ids=torch.tensor([[0, 1, 0, 1]]))
    assert seen["use_cache"] is False
    model.eval()
    prompt = torch.tensor([[5, 6, 7]])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    plain = tiny_llama("sdpa").eval().generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
    assert out.tolist() == plain.tolist()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_guard_refuses_use_cache_true_on_a_packed_batch(impl):
    """With a cache transformers builds no block-diagonal mask from position_ids: an explicit use_cache=True in
    eval let packed sequences see each other (2.2e-1 in the logits of the tiny Llama) before the guard refused it."""
    model = tiny_llama(impl).eval()
    guard_model(model)
    cache_refused_and_left_out_exact(
        model, PaddingFreeCollator(PAD)([{"input_ids": [5, 6, 7, 8, 9, 10, 11], "seq_lengths": [3, 4]}])
    )
    prompt = torch.tensor([[5, 6, 7]])  # generation (one sequence) keeps its cache
    assert model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=PAD).shape == (1, 5)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_guard_refuses_use_cache_true_on_a_packed_vision_language_batch(name):
    """A packed vision-language row has 3-D (multimodal rotary) position_ids, and the use_cache=True refusal came
    after the guard's early return for them: an explicit use_cache=True let the packed sequences see each other
    (1.5e-1 in Qwen2-VL's logits, no error). Its cu_seq_lens tell it is packed."""
    from packtools.batches.vision import MultimodalCollator
    from packtools.testing import tiny_vl_model

    model = tiny_vl_model(name).eval()
    guard_model(model)
    batch = MultimodalCollator(model, 0)([{"input_ids": [5, 6, 7, 8, 9, 10, 11], "seq_lengths": [3, 4]}])
    batch.pop("labels")
    assert batch["position_ids"].ndim == 3
    cache_refused_and_left_out_exact(model, batch)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_guard_refuses_use_cache_true_on_a_vision_language_batch_without_cu_seq_lens(name):
    """MultimodalCollator(return_flash_attn_kwargs=False): only the (4, 1, T) positions tell the row is packed.
    is_packed read 2-D position_ids only, so an explicit use_cache=True passed the guard and the packed sequences
    saw each other (no error); now the text row is read.  The batch as collated (use_cache=False in it) is exact
    without the guard; (3, 1, T) rotary positions without the text row are refused (the model builds no
    per-sequence mask from them, cache or not)."""
    from packtools.batches.vision import MultimodalCollator
    from packtools.integrations.trainers.guard import is_packed
    from packtools.testing import tiny_vl_model

    model = tiny_vl_model(name).eval()
    batch = MultimodalCollator(model, 0, return_flash_attn_kwargs=False)(
        [{"input_ids": [5, 6, 7, 8, 9, 10, 11], "seq_lengths": [3, 4]}]
    )
    batch.pop("labels")
    assert "cu_seq_lens_q" not in batch and batch["position_ids"].shape == (4, 1, 7) and is_packed(batch)
    with torch.no_grad():
        alone = model(input_ids=batch["input_ids"][:, 3:]).logits[0]
        as_collated = model(**batch).logits[0, 3:]
        leaked = model(**{**batch, "use_cache": True}).logits[0, 3:]  # negative control: unguarded, a cache
        rotary = {**batch, "position_ids": batch["position_ids"][1:]}
        rotary_leaked = model(**rotary).logits[0, 3:]
    assert (as_collated - alone).abs().max() < 1e-5
    assert (leaked - alone).abs().max() > 1e-3 and (rotary_leaked - alone).abs().max() > 1e-3
    guard_model(model)
    with pytest.raises(PackingError, match="use_cache=True.*Pass use_cache=False"):
        model(**{**batch, "use_cache": True})
    with pytest.raises(PackingError, match=r"\(3, B, T\) rotary position_ids.*MultimodalCollator"):
        model(**rotary)
    one = MultimodalCollator(model, 0, return_flash_attn_kwargs=False)(
        [{"input_ids": [5, 6, 7], "seq_lengths": [3]}]
    )
    one.pop("labels")
    with torch.no_grad():  # one sequence: its cache is kept, in either layout
        assert model(**{**one, "use_cache": True}).past_key_values is not None
        model(**{**one, "position_ids": one["position_ids"][1:], "use_cache": True})


def test_guard_refuses_rotary_positions_counted_on_across_a_row_cut_by_cu_seq_lens():
    """(3, 1, T) rotary positions without a text row that count on across the documents (no restart) in a row
    that cu_seq_lens_q cuts in two: on sdpa the model builds no per-sequence mask, so the documents see each
    other (0.15 in Qwen2-VL's logits) with use_cache=False, and with use_cache=True, which the guard refused
    before it judged (3, B, T) positions itself, too; both are refused now."""
    from packtools.testing import tiny_vl_model

    model = tiny_vl_model("qwen2_vl").eval()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11]]),
        "position_ids": torch.arange(7)[None, None].expand(3, 1, 7).clone(),
        **{"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 4, "max_length_k": 4},
    }
    later = torch.arange(3, 7)[None, None].expand(3, 1, 4)  # the second document alone, at its positions
    with torch.no_grad():  # negative control, unguarded: the second document sees the first
        alone = model(input_ids=batch["input_ids"][:, 3:], position_ids=later, use_cache=False).logits[0]
        assert (model(**batch, use_cache=False).logits[0, 3:] - alone).abs().max() > 1e-3
    guard_model(model)
    for cache in (False, True):
        with pytest.raises(
            PackingError, match=r"\(3, B, T\) rotary position_ids sit in a row that cu_seq_lens_q"
        ):
            model(**batch, use_cache=cache)


def test_guard_refuses_rotary_restart_after_padding_gap():
    """guard.rotary_restarts and mixers.rotary_starts differ on purpose: (3, 1, T) positions without a text row
    that return to zero after a padded gap ([A][pad][B], attention_mask 0 on the pad) are one sequence to the
    model's attention (B sees A: the negative control), so the per-document mixers leave them whole
    (rotary_starts), while the guard refuses them as packed. Read with rotary_starts' rule the guard would pass
    this row and B would train on A with no error."""
    from packtools.integrations.attention.mixers import rotary_starts
    from packtools.testing import tiny_vl_model

    model = tiny_vl_model("qwen2_vl").eval()
    ids = torch.tensor([[5, 6, 7, 0, 9, 10, 11]])
    mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1]])
    pos = torch.tensor([0, 1, 2, 0, 0, 1, 2])[None, None].expand(3, 1, 7).clone()
    later = torch.arange(3)[None, None].expand(3, 1, 3)
    with torch.no_grad():  # negative control, unguarded: B sees A across the gap
        alone = model(input_ids=ids[:, 4:], position_ids=later, use_cache=False).logits[0]
        row = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[0, 4:]
        assert (row - alone).abs().max() > 1e-3
    assert not bool(rotary_starts(pos, mask).any())  # the model's attention: one sequence
    guard_model(model)
    with pytest.raises(PackingError, match=r"\(3, B, T\) rotary position_ids start again at 0 inside a row"):
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_guard_refuses_2d_positions_where_a_vision_language_model_drops_the_text_row(name):
    """PaddingFreeCollator's 2-D positions on a vision-language model in a loop of one's own (text-only rows):
    Qwen2-VL and Qwen2.5-VL expand them to 3 rotary rows with no text row and build no per-sequence mask, so the
    guarded model attended across documents with no error (0.15 and 0.17 in the logits on sdpa); refused now.
    Qwen3-VL expands them to 4 rows, the text row first: exact, and let through."""
    from packtools.testing import tiny_vl_model

    model = tiny_vl_model(name).eval()
    batch = PaddingFreeCollator(PAD)([{"input_ids": [5, 6, 7, 8, 9, 10, 11], "seq_lengths": [3, 4]}])
    batch.pop("labels")
    one = PaddingFreeCollator(PAD)([{"input_ids": [8, 9, 10, 11], "seq_lengths": [4]}])
    one.pop("labels")
    with torch.no_grad():
        alone = model(**one).logits[0]
        gap = float((model(**batch).logits[0, 3:] - alone).abs().max())  # unguarded
    guard_model(model)
    with torch.no_grad():
        model(**one)  # one sequence: nothing to separate
    if name == "qwen3_vl":
        assert gap < 1e-5
        with torch.no_grad():
            assert (model(**batch).logits[0, 3:] - alone).abs().max() < 1e-5
        return
    assert gap > 1e-2  # negative control: the documents see each other
    with pytest.raises(PackingError, match=rf"\({name}\) turns 2-D position_ids .*MultimodalCollator"):
        model(**batch)


def test_guard_reads_every_packed_batch_shape():
    """Shapes a user might feed: positions (1, T) for a (B, T) batch, cu_seq_lens cut by accelerate's
    dispatch_batches (every tensor sliced to the batch size: cu_seq_lens_q == [0], no error before), and
    seq_lengths passed through to the model with nothing that separates its sequences."""
    from packtools.integrations.trainers.guard import is_packed

    packed = np.array([[0, 1, 2, 0, 1]])
    assert is_packed({"position_ids": packed, "input_ids": np.zeros((3, 5), int)})
    assert is_packed({"position_ids": np.repeat(packed, 3, 0)})
    assert not is_packed({"position_ids": np.array([[0, 1, 2, 3, 4]])})
    with pytest.raises(PackingError, match="use_cache=True"):
        check_forward_inputs({"position_ids": np.repeat(packed, 3, 0), "use_cache": True}, "eager")
    with pytest.raises(PackingError, match="cu_seq_lens_q has shape \\(1,\\).*dispatch_batches"):
        check_forward_inputs({"position_ids": packed, "cu_seq_lens_q": np.array([0])}, "flash_attention_2")
    with pytest.raises(PackingError, match="carries seq_lengths.*PaddingFreeCollator"):
        check_forward_inputs({"input_ids": np.zeros((1, 5), int), "seq_lengths": [[3, 2]]}, "sdpa")
    check_forward_inputs({"input_ids": np.zeros((2, 5), int), "seq_lengths": [[5], [5]]}, "sdpa")
    check_forward_inputs({"position_ids": packed, "seq_lengths": [[3, 2]]}, "sdpa")  # separated: fine


def cache_refused_and_left_out_exact(model, batch):
    """``batch`` packs [5, 6, 7] and [8, 9, 10, 11]: use_cache=True is refused, and left out the guard passes
    use_cache=False, the second sequence computed as if alone."""
    batch = {k: v for k, v in batch.items() if k != "use_cache"}  # as if return_use_cache=False: the guard's
    with pytest.raises(PackingError, match="use_cache=True.*Pass use_cache=False"):
        model(**batch, use_cache=True)
    with torch.no_grad():
        packed = model(**batch).logits[0, 3:]
        alone = model(input_ids=batch["input_ids"][:, 3:]).logits[0]
    assert (packed - alone).abs().max() < 1e-5


def test_forward_input_check_of_use_cache():
    packed = np.array([[0, 1, 2, 0, 1]])
    with pytest.raises(PackingError, match="use_cache=True"):
        check_forward_inputs({"position_ids": packed, "use_cache": True}, "sdpa")
    check_forward_inputs(
        {"position_ids": np.array([[0, 1, 2, 3]]), "use_cache": True}, "sdpa"
    )  # one sequence
    check_forward_inputs({"position_ids": packed, "use_cache": False}, "sdpa")
    cu = {"cu_seq_lens_q": 1, "cu_seq_lens_k": 1, "max_length_q": 3, "max_length_k": 3}
    check_forward_inputs({"position_ids": packed, **cu, "use_cache": True}, "flash_attention_2")
    # a vision-language row's (4, 1, T) positions of one sequence: its cu_seq_lens say it is packed
    rope = np.broadcast_to(np.arange(5), (4, 1, 5))
    with pytest.raises(PackingError, match="use_cache=True"):
        check_forward_inputs(
            {"position_ids": rope, "cu_seq_lens_q": np.array([0, 3, 5]), "use_cache": True}, "sdpa"
        )
    check_forward_inputs({"position_ids": rope, "cu_seq_lens_q": np.array([0, 5]), "use_cache": True}, "sdpa")


def test_unhandled_mixers_check_reads_no_positions_while_generating():
    """A decode step (a cache passed in) is not checked, and its positions are not read (a host sync per token)."""
    from packtools.integrations.trainers.guard import check_unhandled_mixers

    class Unreadable:
        ndim = 2

        def __getitem__(self, key):
            raise AssertionError("the positions of a decode step were read")

    for cache in ({"past_key_values": object()}, {"cache": object()}):
        check_unhandled_mixers(object(), {"position_ids": Unreadable(), **cache}, ("layers.0.linear_attn",))


class _Config:
    def __init__(self, impl):
        self._attn_implementation = impl


class _Model:
    def __init__(self, impl, positions=True):
        self.config = _Config(impl)
        if not positions:
            self.forward = lambda input_ids=None, attention_mask=None: None

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        return None


@pytest.mark.parametrize(
    "impl",
    [
        "sdpa",
        "eager",
        "flex_attention",
        "flash_attention_2",
        "flash_attention_3",
        "kernels-community/flash-attn3",
    ],
)
def test_attention_implementations_that_isolate_sequences(impl):
    assert check_attention_implementation(_Model(impl)) == impl


@pytest.mark.parametrize(
    "impl", ["paged|eager", "paged|flash_attention_2", "kernels-staging/msa", "my_attention"]
)
def test_attention_implementations_that_cannot_isolate_sequences(impl):
    with pytest.raises(PackingError, match=repr(impl).replace("|", r"\|")):
        check_attention_implementation(_Model(impl))


def test_model_without_position_ids_needs_flash():
    with pytest.raises(PackingError, match="position_ids"):
        check_attention_implementation(_Model("sdpa", positions=False))
    assert check_attention_implementation(_Model("flash_attention_2", positions=False)) == "flash_attention_2"


def test_forward_input_checks():
    packed = np.array([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    cu = {"cu_seq_lens_q": 1, "cu_seq_lens_k": 1, "max_length_q": 3, "max_length_k": 3}
    # Right or left padding next to an attention mask is not packing.
    check_forward_inputs(
        {"position_ids": np.array([[0, 1, 2, 0, 1]]), "attention_mask": np.array([[1, 1, 1, 0, 0]])}, "sdpa"
    )
    check_forward_inputs(
        {"position_ids": np.array([[1, 1, 0, 1, 2]]), "attention_mask": np.array([[0, 0, 1, 1, 1]])}, "sdpa"
    )
    for impl in ("sdpa", "flash_attention_2"):
        with pytest.raises(PackingError, match="attention_mask"):
            check_forward_inputs({"position_ids": packed, "attention_mask": np.ones_like(packed)}, impl)
    with pytest.raises(PackingError, match="no position_ids"):
        check_forward_inputs(dict(cu), "eager")
    check_forward_inputs(dict(cu), "flash_attention_2")
    with pytest.raises(PackingError, match="2 packed rows"):
        check_forward_inputs({"position_ids": packed}, "flash_attention_2")
    check_forward_inputs({"position_ids": packed, **cu}, "flash_attention_2")
    check_forward_inputs({"position_ids": packed}, "sdpa")  # sdpa builds the block mask from position_ids
    # Generation (a cache passed in) is left alone.
    check_forward_inputs(
        {"position_ids": packed, "attention_mask": np.ones_like(packed), "cache": object()}, "sdpa"
    )


def test_causal_lm_loss_matches_model_loss():
    model = tiny_llama()
    batch = PaddingFreeCollator(PAD)([{"input_ids": [3, 4, 5, 6, 7], "seq_lengths": [2, 3]}])
    with torch.no_grad():
        out = model(**batch)
    assert batch["labels"].ne(-100).sum() == 3
    assert abs(causal_lm_loss(out, batch["labels"]).item() - out.loss.item()) < 1e-6
    assert abs(causal_lm_loss(out, batch["labels"], num_items_in_batch=6).item() * 2 - out.loss.item()) < 1e-6


def test_guard_goes_on_the_peft_wrapper_too():
    """PEFT calls its base model's .forward directly, skipping hooks there: the wrapper needs its own."""
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    base_handle = guard_model(base)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert guard_model(wrapped) is not base_handle
    packed = torch.tensor([[0, 1, 0, 1]])
    with pytest.raises(PackingError, match="attention_mask"):
        wrapped(
            input_ids=torch.tensor([[5, 6, 7, 8]]),
            position_ids=packed,
            attention_mask=torch.ones_like(packed),
        )


def test_old_transformers_without_position_masks_needs_flash(monkeypatch):
    import packtools.integrations.attention.backends

    monkeypatch.setattr(packtools.integrations.attention.backends, "builds_packed_masks", lambda: False)
    with pytest.raises(PackingError, match="Upgrade transformers"):
        check_attention_implementation(_Model("sdpa"))
    assert check_attention_implementation(_Model("flash_attention_2")) == "flash_attention_2"


def test_prepare_trainer_runs_the_isolation_probe(tmp_path, monkeypatch):
    """A model whose packed sequences leak is refused before training starts: a hybrid with its token-mixing
    layers left over the whole row (packtools' per-document layers switched off here); with them it is exact."""
    from _hf_models import tiny_arch

    import packtools.integrations.trainers.transformers as prepare_module

    def trainer_for(model):
        return transformers.Trainer(
            model=model,
            args=train_args(tmp_path),
            train_dataset=packed_dataset(),
            data_collator=PaddingFreeCollator(0),
        )

    assert prepare_trainer(trainer_for(tiny_arch("Falcon-H1", "sdpa")))  # per-document layers: exact, probed
    monkeypatch.setattr(prepare_module, "run_mixers_per_document", lambda model, owner=None: None)
    model = tiny_arch("Falcon-H1", "sdpa")
    # the guard refuses the probe's packed batch first (layers neither per document nor with kernels here)
    with pytest.raises(
        PackingError, match="FalconH1ForCausalLM's layers .* no varlen kernels on this machine"
    ):
        prepare_trainer(trainer_for(model))
    assert model.config._attn_implementation == "sdpa"  # a refused model is left on its own backend
    trainer = prepare_trainer(trainer_for(tiny_arch("Falcon-H1", "sdpa")), check_isolation=False)
    assert trainer.args.remove_unused_columns  # prepared (columns kept) without the probe


class FixedSignatureLlama(transformers.LlamaForCausalLM):
    """A model whose forward names its inputs (no **kwargs): it takes no seq_idx or cu_seq_lens."""

    def forward(
        self, input_ids=None, labels=None, position_ids=None, use_cache=None, num_items_in_batch=None
    ):
        return super().forward(
            input_ids=input_ids,
            labels=labels,
            position_ids=position_ids,
            use_cache=use_cache,
            num_items_in_batch=num_items_in_batch,
        )


def test_prepare_trainer_fits_the_collator_to_the_forward(tmp_path):
    model = FixedSignatureLlama(tiny_llama("sdpa").config)
    collator = PaddingFreeCollator(PAD)
    trainer = transformers.Trainer(
        model=model, args=train_args(tmp_path), train_dataset=packed_dataset(), data_collator=collator
    )
    prepare_trainer(trainer)
    adapted = trainer.data_collator
    assert adapted is not collator and not adapted.return_seq_idx and not adapted.return_flash_attn_kwargs
    assert adapted.return_position_ids and collator.return_seq_idx  # the user's object is not changed
    trainer.train()  # no TypeError for seq_idx / cu_seq_lens


def test_prompt_learning_adapters_are_refused_by_name():
    """The one check of prepare_dpo/kto/reward/grpo_trainer: virtual tokens cannot go into a padding-free row."""
    from types import SimpleNamespace

    def model(prompt_learning):
        return SimpleNamespace(peft_config={"default": SimpleNamespace(is_prompt_learning=prompt_learning)})

    with pytest.raises(PackingError, match="prompt-learning PEFT adapters") as err:
        refuse_prompt_learning(model(True))
    assert err.value.param == "model"
    with pytest.raises(PackingError) as err:
        refuse_prompt_learning(model(True), param=None)
    assert err.value.param is None
    refuse_prompt_learning(model(False))  # LoRA-style: accepted
    refuse_prompt_learning(SimpleNamespace())  # no PEFT at all


def test_guard_lets_one_padding_free_sequence_keep_its_cache():
    """use_cache=True is refused only where a row holds several sequences: one sequence with cu_seq_lens is exact."""
    model = tiny_llama("sdpa").eval()
    guard_model(model)
    batch = PaddingFreeCollator(PAD)([{"input_ids": [5, 6, 7, 8], "seq_lengths": [4]}])
    with torch.no_grad():
        cached = model(**{**batch, "use_cache": True})
        plain = model(input_ids=batch["input_ids"], use_cache=False)
    assert cached.past_key_values is not None
    assert (cached.logits - plain.logits).abs().max() < 1e-5
