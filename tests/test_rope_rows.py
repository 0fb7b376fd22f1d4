"""Length-dependent RoPE (longrope, dynamic NTK) refused before training: the guard refuses a packed forward whose
sequences such an embedding would rotate otherwise than alone only at the batch that holds them, which can come
late in training (a whole run's steps before it).  ``prepare_trainer`` and the DPO / reward prepare functions now
read the training dataset's row lengths up front and refuse, naming the row; the per-batch check stays."""

from __future__ import annotations

import numpy as np
import pytest
from test_family_sweep import rope_model

from packtools import PackingError, PaddingFreeCollator, prepare_trainer
from packtools.integrations.trainers.rope_rows import check_rope_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def trainer_on(model, rows, tmp_path, batch_size=1, steps=1):
    """A Trainer on packed rows of the given document lengths (threshold of the tiny models: 10 tokens)."""
    rng = np.random.default_rng(0)
    data = {
        "input_ids": [rng.integers(3, 90, sum(r)).tolist() for r in rows],
        "seq_lengths": [list(r) for r in rows],
    }
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=batch_size, report_to="none", use_cpu=True, max_steps=steps
    )
    return transformers.Trainer(
        model, args, train_dataset=datasets.Dataset.from_dict(data), data_collator=PaddingFreeCollator(0)
    )


FINE = [[4, 5], [3, 3, 3], [6], [2, 7]]  # every document under the threshold


@pytest.mark.parametrize("name", ["phi3-longrope", "llama-dynamic"])
def test_a_late_row_is_refused_before_training_by_its_index(name, tmp_path):
    model = rope_model(name)
    trainer = trainer_on(model, [*FINE, *FINE, [12, 4], *FINE], tmp_path)
    with pytest.raises(
        PackingError, match=r"prepare_trainer: .*row 8 of the training dataset.*\[12, 4\]"
    ) as err:
        prepare_trainer(trainer)
    assert err.value.param == "train_dataset"
    assert model.config._attn_implementation == "sdpa"  # the refused trainer is left as it came


def test_rows_that_share_a_forward_are_refused_only_when_they_do(tmp_path):
    rows = [[12], *FINE]  # one long document alone in its row; the others under the threshold
    for name in ("phi3-longrope", "llama-dynamic"):
        with pytest.raises(
            PackingError, match=r"rows 0 and 1 .* would share a forward \(2 rows per micro-batch"
        ):
            prepare_trainer(trainer_on(rope_model(name), rows, tmp_path, batch_size=2))
    # one row per forward: the long document trains alone, as it would unpacked (the guard agrees at every step)
    trainer = trainer_on(rope_model("phi3-longrope"), rows, tmp_path, batch_size=1, steps=len(rows))
    prepare_trainer(trainer).train()
    # longrope: rows all over the threshold may share a forward (every token gets the long factors, as alone)
    prepare_trainer(trainer_on(rope_model("phi3-longrope"), [[12], [11, 13]], tmp_path, batch_size=2))


def test_datasets_without_lengths_up_front_are_left_to_the_batch_check():
    model = rope_model("phi3-longrope")
    stream = datasets.Dataset.from_dict({"input_ids": [[1] * 12]}).to_iterable_dataset()
    check_rope_rows(model, stream, rows_per_forward=2)  # a stream: nothing read up front
    check_rope_rows(model, datasets.Dataset.from_dict({"input_ids": [[1] * 12, [1] * 3]}), rows_per_forward=1)
    with pytest.raises(PackingError, match="rows 0 and 1"):  # unpacked rows: their input_ids are the lengths
        check_rope_rows(
            model, datasets.Dataset.from_dict({"input_ids": [[1] * 12, [1] * 3]}), rows_per_forward=2
        )
    check_rope_rows(rope_model("phi3-longrope").model.layers[0], None)  # no config, no dataset: nothing to do


def test_prepare_dpo_trainer_refuses_pairs_across_the_threshold_before_training(tmp_path, monkeypatch):
    """A DPO micro-batch runs as one padding-free row: a pair whose prompt + chosen and prompt + rejected lie on
    both sides of longrope's threshold is refused up front, by its row."""
    from _hf_models import exact_step_args, text_pairs, word_tokenizer
    from _trl_setup import trl

    from packtools import prepare_dpo_trainer
    from packtools.integrations.preference import dpo
    from packtools.integrations.trainers.rope_rows import rows_and_sequences

    def build():
        return trl.DPOTrainer(
            rope_model("phi3-longrope"),
            ref_model=rope_model("phi3-longrope"),
            args=trl.DPOConfig(**exact_step_args(tmp_path)),
            train_dataset=datasets.Dataset.from_list(text_pairs(12)),
            processing_class=word_tokenizer(),
        )

    trainer = build()
    offsets, lengths = rows_and_sequences(trainer.train_dataset)
    pairs = np.diff(offsets)
    assert (pairs == 2).all() and (lengths > 10).any() and (lengths <= 10).any()  # the data crosses it
    with pytest.raises(PackingError, match=r"prepare_dpo_trainer: Phi3ForCausalLM's .*(row|rows) \d+"):
        prepare_dpo_trainer(trainer)
    # prompt-shared pairs (the tree) are refused up front too, by their row: their seq_lengths are each branch's
    # prompt + completion (before: left to the batch check, which refused only once training reached them)
    from packtools.dpo import pack_preference

    trainer = build()
    shared = pack_preference(trainer.train_dataset, 64, share_prompt=True)
    with pytest.raises(PackingError, match=r"prepare_dpo_trainer: Phi3ForCausalLM's .*(row|rows) \d+"):
        prepare_dpo_trainer(trainer, train_dataset=shared)
    # ... and the batch check stays behind it (the up-front rule off: the first batch refuses)
    monkeypatch.setattr(dpo, "check_rope_rows", lambda *a, **k: None)
    trainer = build()
    prepare_dpo_trainer(trainer, train_dataset=shared)
    with pytest.raises(
        PackingError, match="Phi3ForCausalLM: packed sequences would train with wrong positions"
    ):
        trainer.train()
    # the per-batch check stays, in DPO's own padding-free forward (the guard's hook sees TRL's padded call, so
    # on main these pairs trained 3 epochs with no error): with the dataset's rule off, the first batch refuses
    trainer = build()
    prepare_dpo_trainer(trainer)
    with pytest.raises(
        PackingError, match="Phi3ForCausalLM: packed sequences would train with wrong positions"
    ):
        trainer.train()


def test_prepare_kto_trainer_refuses_rows_across_the_threshold_before_training(tmp_path, monkeypatch):
    """KTO runs every micro-batch's prompt + completion sequences (and its KL sequences) as one padding-free row:
    rows on both sides of longrope's threshold are refused up front, by row (before: prepare_kto_trainer read no
    lengths, and the refusal came only at the batch holding them, in training).  Cut by KTOConfig.max_length to
    the threshold, as TRL's collator cuts them, the same rows train."""
    from _hf_models import exact_step_args, word_tokenizer
    from _trl_setup import trl
    from test_kto import examples

    from packtools.integrations.preference import kto
    from packtools.integrations.preference.kto import prepare_kto_trainer

    def build(**config):
        return trl.KTOTrainer(
            rope_model("phi3-longrope"),
            ref_model=rope_model("phi3-longrope"),
            args=trl.KTOConfig(**exact_step_args(tmp_path, max_steps=1, **config)),
            train_dataset=datasets.Dataset.from_list(examples(12)),
            processing_class=word_tokenizer(),
        )

    trainer = build()
    data = trainer.train_dataset
    lengths = np.array([len(p) + len(c) for p, c in zip(data["prompt_ids"], data["completion_ids"])])
    assert (lengths > 10).any() and (lengths <= 10).any()  # the data crosses the threshold
    with pytest.raises(PackingError, match=r"prepare_kto_trainer: Phi3ForCausalLM's .*rows \d+ and \d+"):
        prepare_kto_trainer(trainer)
    prepare_kto_trainer(build(max_length=10)).train()  # cut to the threshold: no forward crosses it
    # the per-batch check stays behind it (the up-front rule off: the first batch refuses)
    monkeypatch.setattr(kto, "check_rope_sequences", lambda *a, **k: None)
    trainer = prepare_kto_trainer(build())
    with pytest.raises(
        PackingError, match="Phi3ForCausalLM: packed sequences would train with wrong positions"
    ):
        trainer.train()


@pytest.mark.parametrize("share", [False, True])
def test_grpo_rows_across_the_threshold_are_refused_at_their_step(tmp_path, share):
    """GRPO's rows are generated, so no lengths exist up front, and the model is not guarded: its padding-free
    rows (plain, or prompt-shared trees) went to the model unchecked and a longrope model trained them with the
    long factors for the short sequences, silently.  Each row is now checked as the guard checks a batch."""
    from _hf_models import word_tokenizer
    from _trl_setup import trl
    from test_family_sweep import LLAMA_SIZES, ROPES, build
    from test_grpo import prompts, reward_len

    from packtools.integrations.rl import prepare_grpo_trainer

    cls, config_cls, extra = ROPES["phi3-longrope"]
    sizes = {
        **LLAMA_SIZES,
        **extra,
        "vocab_size": 12,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 1,
    }
    model = build(cls, config_cls, sizes, "sdpa")
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=10,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, max_steps=1, seed=0,
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model, reward_funcs=reward_len, args=args, train_dataset=datasets.Dataset.from_list(prompts()),
        processing_class=word_tokenizer(12),
    )  # fmt: skip
    prepare_grpo_trainer(trainer, share_prompt=share)  # the probe's sequences stay under the threshold
    with pytest.raises(
        PackingError, match="Phi3ForCausalLM: packed sequences would train with wrong positions"
    ):
        trainer.train()


def _pad_rows(rows):
    """A plain padding collator (transformers' DataCollatorWithPadding's layout): each row its own, right-padded."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.parametrize("name", ["phi3-longrope", "llama-dynamic"])
def test_unpacked_rows_padded_by_a_plain_collator_are_not_refused(name, tmp_path):
    """Unpacked rows of 12 and 4 tokens in one padded [2, T] batch are no packed row (each row its own sequence,
    as transformers trains them without packtools): the up-front rule for rows sharing a padding-free row does not
    apply to a collator that does not flatten them (before: any collator without a padding_free attribute was
    taken for a flattening one, and prepare_trainer refused, calling the batch 'one padding-free row')."""
    rng = np.random.default_rng(0)
    data = {"input_ids": [rng.integers(3, 90, n).tolist() for n in (12, 4, 5, 3)]}
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, report_to="none", use_cpu=True, max_steps=2
    )
    trainer = transformers.Trainer(
        rope_model(name), args, train_dataset=datasets.Dataset.from_dict(data), data_collator=_pad_rows
    )
    prepare_trainer(trainer).train()
    flat = transformers.DataCollatorWithFlattening()  # transformers' padding-free collator flattens: refused
    trainer = transformers.Trainer(
        rope_model(name), args, train_dataset=datasets.Dataset.from_dict(data), data_collator=flat
    )
    with pytest.raises(PackingError, match="rows 0 and 1 .* would share a forward"):
        prepare_trainer(trainer)


def test_prepare_dpo_trainer_judges_pairs_at_the_collators_truncated_lengths(tmp_path, monkeypatch):
    """TRL's DataCollatorForPreference cuts each prompt + chosen / prompt + rejected sequence to
    DPOConfig.max_length before the forward: with max_length=10 (the tiny longrope threshold) no forward holds a
    sequence over it, the per-batch check agrees at every step, and the up-front rule must judge the cut lengths
    (before: pairs of [19, 9] dataset tokens were refused though the model sees [10, 9]).  Cut to 16, the same
    data still crosses the threshold and is refused."""
    from _hf_models import exact_step_args, text_pairs, word_tokenizer
    from _trl_setup import trl

    from packtools import prepare_dpo_trainer

    def build(max_length):
        return trl.DPOTrainer(
            rope_model("phi3-longrope"),
            ref_model=rope_model("phi3-longrope"),
            args=trl.DPOConfig(**exact_step_args(tmp_path, max_length=max_length, max_steps=3)),
            train_dataset=datasets.Dataset.from_list(text_pairs(12)),
            processing_class=word_tokenizer(),
        )

    prepare_dpo_trainer(build(10)).train()  # every step passes the guard's per-batch rule
    with pytest.raises(PackingError, match=r"prepare_dpo_trainer: Phi3ForCausalLM's .*row"):
        prepare_dpo_trainer(build(16))
