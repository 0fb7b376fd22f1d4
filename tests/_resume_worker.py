"""One run of the resume oracle of ``tests/test_resume.py``: a straight run, or a run resumed from its checkpoint.

Usage: ``python tests/_resume_worker.py OUT CASE PHASE`` (or under ``torchrun --nproc_per_node 2``).  ``CASE`` is
a JSON object of options (or a JSON list of ``[name, case]`` pairs, run one after the other in ``OUT/name``): ``data`` (``rows``: ``pack_dataset`` output, ``plain``: unpacked sequences),
``prepare`` (``prepare_trainer``'s options, ``null``: not prepared), ``trainer`` (``sft``: TRL's ``SFTTrainer``
with ``packed_sft_config``), ``collator`` (``flat``: transformers' ``DataCollatorWithFlattening``), ``stream``
(an ``IterableDataset``), ``k``, ``save_every``, ``bs``, ``ga``, ``epochs``, ``max_steps``, ``dropout``,
``ignore_data_skip``, ``sampling``, ``workers``, ``resume_prepare`` (``prepare`` of the resumed run),
``pack_context_parallel`` (rows packed for a CP split whether or not the run trains under CP),
``pieces`` (a piece that is no whole document, a CP shard's or a DPO sequence's, gets a number of its own),
``tokens_seen``, ``trainer`` ``dpo`` / ``reward`` / ``kto`` (TRL's, on text pairs, ``packed_pairs``), ``data`` ``view``
(a ``packed_view``); ``PHASE`` is ``full`` (train ``epochs`` epochs, saving a checkpoint
every ``k`` optimizer steps) or ``resume`` (a new model and trainer, resumed from ``OUT/checkpoint-K``).  Each rank
records, per optimizer step, the documents every micro-batch trained on (read from the ``input_ids`` and
``position_ids`` the model's forward received, so skipped batches and the collator check are not counted), and
the run's logged losses and ``num_input_tokens_seen``; rank 0 adds the final weights.  The records of every rank
go to ``OUT/PHASE.pt``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import datasets
import torch
import transformers
from _hf_models import PAD, sequences, tiny_config, tiny_llama, word_tokenizer

from packtools import PaddingFreeCollator, pack_dataset, packed_view, prepare_trainer
from packtools.batches import ArrowCollator


class Trace(transformers.TrainerCallback):
    """The documents of every micro-batch the model ran forward on, grouped by optimizer step."""

    def __init__(self, model, docs, pieces=False):
        self.docs, self.pieces, self.current, self.steps = docs, pieces, [], []
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        if not module.training:
            return
        ids, pos = kwargs["input_ids"], kwargs.get("position_ids")
        batch = []
        for r in range(ids.shape[0]):
            row, p = ids[r].tolist(), (pos[r].tolist() if pos is not None else [0] + [1] * (ids.shape[1] - 1))
            starts = [i for i, x in enumerate(p) if x == 0] + [len(row)]
            for a, b in zip(starts, starts[1:]):
                piece = tuple(row[a:b])
                # -1: padding or an unknown piece; with pieces (a CP shard, a DPO sequence): a number of its own
                known = self.docs.get(piece, -1)
                batch.append(known if known >= 0 or not self.pieces else 10**6 + hash(piece) % 10**9)
        self.current.append(batch)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((state.global_step, self.current))
        self.current = []


class KillAtSave(transformers.TrainerCallback):
    """SIGKILL this process as soon as ``Trainer`` has saved its first checkpoint, before any callback
    registered after this one runs its ``on_save`` (where packtools once wrote its layout record)."""

    def on_save(self, args, state, control, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)


def build(case: dict):
    seqs = sequences(case.get("n", 48), seed=7, max_len=case.get("max_len", 20), masks=False)
    docs = {}
    for i, s in enumerate(seqs):
        docs.setdefault(tuple(s["input_ids"]), i)
    plain = datasets.Dataset.from_list(seqs)
    if case.get("stream"):  # a datasets.IterableDataset, packed lazily window by window
        plain = plain.to_iterable_dataset(num_shards=4)
        if case.get("stream_shuffle"):
            plain = plain.shuffle(seed=5, buffer_size=8)
    if case["data"] == "plain":
        data = plain
    elif case["data"] == "view":  # packed rows gathered on demand from the dataset's Arrow buffers
        data = packed_view(plain, case.get("max_length", 32))
    else:
        extra = {"window": 16} if case.get("stream") else {}
        cp = case.get("pack_context_parallel") or (case.get("prepare") or {}).get("context_parallel")
        if cp:  # rows padded for the CP split (pack_context_parallel: so padded without CP in training)
            extra["context_parallel"] = cp
        data = pack_dataset(plain, case.get("max_length", 32), **extra)
    if case.get("collator", "pf") == "flat":
        collator = transformers.DataCollatorWithFlattening(return_position_ids=True)
    else:
        collator = PaddingFreeCollator(PAD, unpacked=case["data"] == "plain")
    if case["data"] == "view":
        collator = ArrowCollator(data, collator)
    return docs, data, collator


def train_args(out: str, case: dict, **extra):
    make = transformers.TrainingArguments
    if case.get("trainer") in ("dpo", "reward", "kto"):
        import trl

        make = {"dpo": trl.DPOConfig, "reward": trl.RewardConfig, "kto": trl.KTOConfig}[case["trainer"]]
    if case.get("trainer") == "sft":
        from packtools.integrations import packed_sft_config

        make = packed_sft_config
    return make(
        output_dir=out,
        per_device_train_batch_size=case.get("bs", 2),
        gradient_accumulation_steps=case.get("ga", 2),
        num_train_epochs=case.get("epochs", 2),
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        optim="adamw_torch",
        seed=case.get("seed", 3),
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        disable_tqdm=True,
        include_num_input_tokens_seen=case.get("tokens_seen", "all"),
        ignore_data_skip=case.get("ignore_data_skip", False),
        train_sampling_strategy=case.get("sampling", "random"),
        remove_unused_columns=case.get("prepare") is not None
        and case.get("trainer") not in ("dpo", "reward", "kto"),
        max_steps=case.get("max_steps", -1),
        dataloader_num_workers=case.get("workers", 0),
        dataloader_persistent_workers=bool(case.get("workers")),
        accelerator_config={"dispatch_batches": False} if case.get("stream") else None,
        **extra,
    )


def run(out: str, case: dict, phase: str) -> dict:
    docs, data, collator = build(case)
    model = tiny_llama("sdpa", seed=1)
    if case.get("dropout"):  # dropout draws from the RNG the checkpoint saves and resuming restores
        torch.manual_seed(1)
        config = transformers.LlamaConfig(**tiny_config("sdpa", attention_dropout=case["dropout"]))
        model = transformers.LlamaForCausalLM(config).float()
    if phase == "full":
        args = train_args(
            out,
            case,
            save_strategy="steps",
            save_steps=case.get("save_every", case["k"]),
            save_only_model=False,
        )
    else:
        args = train_args(out, case, save_strategy="no")
    if case.get("trainer") == "sft":
        from trl import SFTTrainer

        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=word_tokenizer())
    elif case.get("trainer") == "dpo":  # TRL's DPOTrainer on text pairs, a reference model of other weights
        import trl
        from _hf_models import text_pairs, tiny_preference_model

        from packtools import prepare_dpo_trainer

        model = tiny_preference_model("llama", "sdpa", seed=0)
        trainer = trl.DPOTrainer(
            model,
            ref_model=tiny_preference_model("llama", "sdpa", seed=1),
            args=args,
            train_dataset=datasets.Dataset.from_list(text_pairs(case.get("n", 24))),
            processing_class=word_tokenizer(),
        )
        packed = None
        if case.get("packed_pairs"):
            from packtools.dpo import pack_preference

            packed = pack_preference(trainer.train_dataset, case.get("max_length", 64))
        prepare_dpo_trainer(trainer, train_dataset=packed, **case["prepare"])
    elif case.get("trainer") == "kto":
        # TRL's KTOTrainer on prompt/completion/label rows, a reference model of other weights
        import trl
        from _hf_models import tiny_preference_model
        from test_kto import examples

        from packtools.integrations import prepare_kto_trainer

        model = tiny_preference_model("llama", "sdpa", seed=0)
        trainer = trl.KTOTrainer(
            model,
            ref_model=tiny_preference_model("llama", "sdpa", seed=1),
            args=args,
            train_dataset=datasets.Dataset.from_list(examples(case.get("n", 24))),
            processing_class=word_tokenizer(),
        )
        prepare_kto_trainer(trainer, **case["prepare"])
    elif case.get("trainer") == "reward":
        # TRL's RewardTrainer (a sequence classifier) on text pairs, margins
        import trl
        from _hf_models import text_pairs, tiny_preference_model

        from packtools.integrations.preference.reward import prepare_reward_trainer

        model = tiny_preference_model("llama", "sdpa", seed=0, num_labels=1)
        pairs = datasets.Dataset.from_list(text_pairs(case.get("n", 24), margin=True))
        trainer = trl.RewardTrainer(model, args=args, train_dataset=pairs, processing_class=word_tokenizer())
        packed = None
        if case.get("packed_pairs"):
            from packtools.integrations.preference.data import pack_reward_pairs

            packed = pack_reward_pairs(trainer.train_dataset, case.get("max_length", 80))
        prepare_reward_trainer(trainer, packed, **case["prepare"])
    else:
        assert case.get("trainer") is None, case["trainer"]  # a name the worker does not build
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    if case.get("prepare") is not None and case.get("trainer") not in ("dpo", "reward", "kto"):
        prepare_trainer(trainer, **case.get(f"{phase}_prepare", case["prepare"]))
    trace = Trace(model, docs, pieces=case.get("pieces", False))
    trainer.add_callback(trace)
    if phase == "full" and case.get("kill_at_save"):
        trainer.add_callback(KillAtSave())
    resume = os.path.join(out, f"checkpoint-{case['k']}") if phase == "resume" else None
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "steps": trace.steps,
        "loss": {h["step"]: h["loss"] for h in logs},
        "seen": {h["step"]: (h.get("num_input_tokens_seen"), h.get("num_tokens")) for h in logs},
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "global_step": trainer.state.global_step,
    }


def main() -> None:
    out, case, phase = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    # A list of [name, case] pairs: the cases one after the other in this launch (torchrun's start and the
    # imports paid once), each in OUT/name with a new model and trainer.
    cases = [(os.path.join(out, name), c) for name, c in case] if isinstance(case, list) else [(out, case)]
    for folder, one in cases:
        os.makedirs(folder, exist_ok=True)
        result = run(folder, one, phase)
        if "RANK" in os.environ:
            from _workers import save_gathered

            save_gathered(result, os.path.join(folder, f"{phase}.pt"))
        else:
            torch.save([result], os.path.join(folder, f"{phase}.pt"))
    if "RANK" in os.environ:
        from _workers import end_process_group

        end_process_group()


if __name__ == "__main__":
    main()
