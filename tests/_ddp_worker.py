"""One process of the data-parallel harness of ``tests/test_distributed.py`` (run by ``torchrun``, gloo, CPU).

Usage: ``torchrun --nproc_per_node 2 tests/_ddp_worker.py OUT_DIR``.  Every check trains on a tiny Llama
(``check_moe`` on a tiny Qwen3-MoE; fp32, SGD, lr 1, no clipping) and records, per rank: the rows of every micro-batch in the order the
trainer drew them, the parameter change of the first optimizer step (``-lr * gradient``) and the number of
optimizer steps.  The results of rank ``r`` go to ``OUT_DIR/rank{r}.pt``; the test compares them with one
process on the same global batches.  Launching once and running every check in it keeps the cost to one
process start.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import datasets
import torch
import transformers
from _hf_models import PAD, FirstStep, sequences, sgd_train_args, tiny_llama
from _workers import quiet_hf_rank

from packtools import PaddingFreeCollator, pack_dataset, packed_view, prepare_trainer
from packtools.errors import PackingError

LR = 1.0


class Recorder:
    def __init__(self, inner, key):
        self.inner, self.key, self.batches = inner, key, []

    def __call__(self, features):
        from packtools.integrations.trainers.collator_check import in_check

        if not in_check():  # prepare_trainer's collator check and probe are not training batches
            self.batches.append([self.key(f) for f in features])
        return self.inner(features)


def train_recorded(trainer, recorder, model) -> dict:
    """Train; the rows ``recorder`` saw, ``model``'s first parameter change, the steps and the attention."""
    first = FirstStep(model)
    trainer.add_callback(first)
    trainer.train()
    return {
        "batches": recorder.batches,
        "delta": first.delta,
        "steps": trainer.state.global_step,
        "attention": trainer.model.config._attn_implementation,
    }


def ids_key(f):
    return tuple(int(t) for t in f["input_ids"])


def args(out, **overrides):
    return sgd_train_args(out, LR, **overrides)


def packed_rows():
    return pack_dataset(datasets.Dataset.from_list(sequences(40, seed=5, masks=False)), 32)


def run_sft(out, dataset, prepare=True, unpacked=False, **overrides):
    model = tiny_llama("sdpa")
    recorder = Recorder(PaddingFreeCollator(PAD, unpacked=unpacked), ids_key)
    trainer = transformers.Trainer(
        model=model, args=args(out, **overrides), train_dataset=dataset, data_collator=recorder
    )
    if prepare is not None:
        prepare_trainer(trainer, **(prepare or {}))
    return train_recorded(trainer, recorder, model)


def check_sft(out):
    rows = packed_rows()
    unpacked = datasets.Dataset.from_list(sequences(41, seed=3, masks=False))
    view = packed_view(datasets.Dataset.from_list(sequences(40, seed=5, masks=False)), 32)
    return {
        "sft_packed": run_sft(out, rows, prepare={}),
        "sft_budget": run_sft(out, rows, prepare={"max_tokens": 64}),
        "sft_unpacked": run_sft(out, unpacked, prepare={}, unpacked=True),
        "sft_view": run_sft(out, view, prepare={"max_tokens": 64}, remove_unused_columns=False),
        "sft_plain_trainer": run_sft(out, rows, prepare=None, remove_unused_columns=False),
    }


#: The MoE router loss's weight in ``check_moe`` (large: a router loss left out or miscounted shows in every
#: parameter); ``tests/test_moe_router_loss.py`` uses the same.
MOE_COEF = 0.5


def moe_model():
    """The tiny Qwen3-MoE of ``check_moe`` (seed 0), its router loss on with :data:`MOE_COEF`."""
    from packtools.testing import tiny_model

    model = tiny_model("Qwen3-MoE")
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = MOE_COEF
    return model


def check_moe(out):
    """One optimizer step of Trainer + PaddingFreeCollator + prepare_trainer on the MoE model (2 accumulation
    steps): the test compares it with the padded micro-batches of both ranks, each with its router loss."""
    model = moe_model()
    recorder = Recorder(
        PaddingFreeCollator(PAD),
        lambda f: {"input_ids": list(f["input_ids"]), "seq_lengths": list(f["seq_lengths"])},
    )
    trainer = transformers.Trainer(
        model=model, args=args(out, max_steps=1), train_dataset=packed_rows(), data_collator=recorder
    )
    prepare_trainer(trainer)
    return train_recorded(trainer, recorder, model)


def check_resume(out):
    """Token-budget batches, two epochs; a second trainer resumes from the checkpoint in the middle of epoch 1."""
    rows = packed_rows()
    ckpt = os.path.join(out, "resume")
    from packtools.batches import TokenBudgetBatchSampler

    lengths = [len(r) for r in rows["input_ids"]]
    world = int(os.environ["WORLD_SIZE"])
    per_epoch = -(-len(TokenBudgetBatchSampler(lengths, 64, num_replicas=world)) // 2)
    resume_at = per_epoch + 1  # one optimizer step into epoch 1
    full = run_sft(
        ckpt,
        rows,
        prepare={"max_tokens": 64},
        num_train_epochs=2,
        save_strategy="steps",
        save_steps=resume_at,
    )
    model = tiny_llama("sdpa")
    recorder = Recorder(PaddingFreeCollator(PAD), ids_key)
    trainer = transformers.Trainer(
        model=model, args=args(ckpt, num_train_epochs=2), train_dataset=rows, data_collator=recorder
    )
    prepare_trainer(trainer, max_tokens=64)
    trainer.train(resume_from_checkpoint=os.path.join(ckpt, f"checkpoint-{resume_at}"))
    return {"full": full["batches"], "resumed": recorder.batches, "resume_at": resume_at, "ga": 2}


def pair_key(f):
    return (
        tuple(int(p) for p in f["pair"]) if "pair" in f else (tuple(f["prompt_ids"]), tuple(f["chosen_ids"]))
    )


def run_dpo(out, packed, share_prompt=False, **prepare):
    import test_dpo
    from trl import DPOTrainer  # noqa: F401  (imported by test_dpo too)

    from packtools import prepare_dpo_trainer
    from packtools.dpo import pack_preference

    trainer = test_dpo.build(
        Path(out), n=24, per_device_train_batch_size=1, gradient_accumulation_steps=2, num_train_epochs=1,
        logging_strategy="steps", logging_steps=1,
    )  # fmt: skip
    dataset = None
    if packed:
        indexed = trainer.train_dataset.add_column("pair", list(range(len(trainer.train_dataset))))
        dataset = pack_preference(indexed, 64, columns=["pair"], share_prompt=share_prompt)
        trainer.args.remove_unused_columns = False
    prepare_dpo_trainer(trainer, train_dataset=dataset, **prepare)
    recorder = Recorder(trainer.data_collator, pair_key)
    trainer.data_collator = recorder
    return {**train_recorded(trainer, recorder, trainer.model), "logged": trainer.state.log_history[0]}


def check_dpo(out):
    return {
        "dpo_packed": run_dpo(out, True),
        "dpo_packed_budget": run_dpo(out, True, max_tokens=128),
        "dpo_packed_shared": run_dpo(out, True, share_prompt=True),  # the prompt once (tree attention)
        "dpo_unpacked": run_dpo(out, False),
        "dpo_unpacked_budget": run_dpo(out, False, max_tokens=60),
    }


def loop_data():
    """Packed rows and packed pairs for the README loops (the test rebuilds the same)."""
    from _scripts import script

    dpo_loop = script("dpo_loop")  # the documented loop under test

    from packtools.dpo import pack_preference

    pairs = pack_preference(dpo_loop.synthetic_pairs(40, 64, vocab_size=97), max_length=64)
    return packed_rows(), pairs


def check_loops(out):
    """benchmarks/train_loop.py and dpo_loop.py under DDP, TokenBudgetBatchSampler(num_replicas=2) per rank."""
    import copy

    from _scripts import script
    from torch.nn.parallel import DistributedDataParallel

    from packtools.batches import TokenBudgetBatchSampler
    from packtools.dpo import PreferenceCollator

    dpo_loop, train_loop = script("dpo_loop"), script("train_loop")  # the documented loops under test

    if not torch.distributed.is_initialized():  # the Trainer checks before have set it up already
        torch.distributed.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rows, pairs = loop_data()
    results = {}
    for name, data, collator, budget in (
        ("loop_sft", rows, PaddingFreeCollator(PAD), 64),
        ("loop_dpo", pairs, PreferenceCollator(PAD), 96),
    ):
        lengths = [len(r) for r in data["input_ids"]]
        sampler = TokenBudgetBatchSampler(lengths, budget, num_replicas=world, rank=rank)
        recorder = Recorder(collator, ids_key)
        loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, collate_fn=recorder)
        model = tiny_llama("sdpa")
        frozen = copy.deepcopy(model).eval().requires_grad_(False)
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if name == "loop_sft":
            steps = train_loop.train(ddp, loader, opt, accumulation_steps=2)
        else:
            steps = dpo_loop.train_dpo(ddp, frozen, loader, opt, accumulation_steps=2)
        results[name] = {"batches": list(recorder.batches), "steps": len(steps), "losses": steps}
        # the first step's change is recomputed from a second run stopped after one step
        model = tiny_llama("sdpa")
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if name == "loop_sft":
            train_loop.train(ddp, loader, opt, accumulation_steps=2, max_steps=1)
        else:
            dpo_loop.train_dpo(ddp, frozen, loader, opt, accumulation_steps=2, max_steps=1)
        delta = {k: before[k] - p.detach() for k, p in model.named_parameters()}
        results[name]["delta"] = delta
    return results


def check_refusal(out):
    """A TokenBudgetBatchSampler(num_replicas=2) handed to accelerate's sharding is refused."""
    import accelerate

    from packtools.batches import TokenBudgetBatchSampler

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sampler = TokenBudgetBatchSampler([5, 7, 3, 9, 4, 6], 12, num_replicas=world, rank=rank)
    loader = torch.utils.data.DataLoader(list(range(6)), batch_sampler=sampler)
    try:
        accelerate.Accelerator(cpu=True).prepare(loader)
    except PackingError as e:
        return str(e)
    return None


def _outcome(dataset, out, **overrides):
    """What prepare_trainer + train() say on ``dataset`` under this launch: "trained", a PackingError's message,
    or another exception (the crash the refusal replaces) as "Type: message"."""
    trainer = transformers.Trainer(
        model=tiny_llama("sdpa"),
        args=args(out, **overrides),
        train_dataset=dataset,
        data_collator=PaddingFreeCollator(PAD),
    )
    try:
        prepare_trainer(trainer)
        trainer.train()
    except PackingError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - recorded for the test to show
        return f"{type(e).__name__}: {e}"
    return "trained"


def check_stream(out):
    """A packed IterableDataset, and a dataset of one packed row, under 2 processes (U10, newcomer 2)."""
    rows = datasets.Dataset.from_list(sequences(40, seed=5, masks=False))
    stream = pack_dataset(rows.to_iterable_dataset(), 32)
    one_row = pack_dataset(datasets.Dataset.from_list(sequences(3, seed=1, masks=False)), 512)
    assert one_row.num_rows == 1
    return {
        "stream": _outcome(stream, out, max_steps=2),
        "one_row": _outcome(one_row, out),
    }


EVAL_CASES = {"flat, batch 1": (True, 1), "flat, batch 2": (True, 2), "padded, batch 2": (False, 2)}


def eval_rows():
    """5 packed rows: 2 processes cannot share them evenly, so accelerate repeats rows in the last batches."""
    rows = pack_dataset(datasets.Dataset.from_list(sequences(n=40, seed=7, max_len=30)), 48, "bfd")
    return rows.select(range(5))


def eval_trainer(out, rows, padding_free, batch):
    """An evaluating Trainer on ``rows`` (tiny Llama, seed 0), prepared by packtools."""
    trainer = transformers.Trainer(
        model=tiny_llama("sdpa"),
        args=transformers.TrainingArguments(
            out, per_device_eval_batch_size=batch, report_to=[], use_cpu=True, disable_tqdm=True
        ),
        train_dataset=rows,
        eval_dataset=rows,
        data_collator=PaddingFreeCollator(PAD, padding_free=padding_free),
    )
    return prepare_trainer(trainer)


def check_eval(out):
    """token_mean_loss and evaluate()'s eval_loss of every EVAL_CASES case on 5 rows under 2 processes."""
    from packtools.integrations.trainers.evaluation import token_mean_loss

    rows, got = eval_rows(), {}
    for name, (padding_free, batch) in EVAL_CASES.items():
        trainer = eval_trainer(out, rows, padding_free, batch)
        got[name] = (token_mean_loss(trainer), trainer.evaluate()["eval_loss"])
    return got


class Reshuffled(torch.utils.data.Sampler):
    """Another order each time it is iterated (a sampler token_mean_loss refuses)."""

    def __init__(self, n):
        self.n, self.calls = n, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        self.calls += 1
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.calls)).tolist())


def check_eval_order(out):
    """token_mean_loss with an evaluation order that changes between iterations, 5 rows of batch 2 on 2
    processes: only rank 0's last batch mixes a row with a repeat (the rows counted again), so only rank 0 can
    see the change; each rank says what token_mean_loss did ("Type: message")."""
    from packtools.integrations.trainers.evaluation import token_mean_loss

    class Trainer(transformers.Trainer):
        def _get_eval_sampler(self, eval_dataset):
            return Reshuffled(len(eval_dataset))

    trainer = Trainer(
        model=tiny_llama("sdpa"),
        args=transformers.TrainingArguments(
            out,
            per_device_eval_batch_size=2,
            remove_unused_columns=False,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        ),
        eval_dataset=eval_rows(),
        data_collator=PaddingFreeCollator(PAD),
    )
    try:
        return f"counted: {token_mean_loss(trainer)}"
    except Exception as e:  # noqa: BLE001 - recorded for the test to show
        return f"{type(e).__name__}: {e}"


def check_guard_probe(out):
    """guard_model on the DistributedDataParallel wrapper (the outermost module a loop calls) in a loop of one's
    own, rank 1's first batch one document (no packed batch, so no probe there yet): the probe of rank 0's first
    packed batch ran DDP forwards, each broadcasting the buffers, and met rank 1's real forward (gloo aborted the
    process: 'Received data size doesn't match expected size').  Each rank's two losses."""
    import torch.distributed as dist

    from packtools.integrations.trainers.guard import guard_model

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(tiny_llama("sdpa").train())
    guard_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    collate = PaddingFreeCollator(PAD)
    losses = []
    for step in range(2):
        lengths = [13] if rank == 1 and step == 0 else [5, 7, 3]
        ids = [3 + (7 * i + rank) % 90 for i in range(sum(lengths))]
        loss = model(**collate([{"input_ids": ids, "seq_lengths": lengths}])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def check_fsdp(out):
    """An own loop over FSDP2 (``fully_shard`` on each decoder layer and the model), rank 0 one packed row of 3
    documents, rank 1 two rows (rank 1's first batch of one document would have probed a step later): the guard's
    probe is refused by name on both ranks (it hung before), and with ``check_isolation=False`` the global token
    mean's loss and full gradients, and the change of one SGD step, for the reference to compare."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from packtools.errors import PackingError
    from packtools.integrations import check_isolation
    from packtools.integrations.trainers.guard import guard_model

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = fsdp_rows()
    mine = rows[:1] if rank == 0 else rows[1:]
    model = tiny_llama("sdpa").train()
    check_isolation(model)  # the fix the refusal names: probe the unsharded model
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        guard_model(model)
        refused = None
    except PackingError as err:
        refused = str(err)
    guard_model(model, check_isolation=False)
    batch = PaddingFreeCollator(PAD)(mine)
    count = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))
    dist.all_reduce(count)
    loss = model(**batch, num_items_in_batch=int(count)).loss * world  # FSDP averages the gradients
    loss.backward()
    summed = torch.tensor(loss.item() / world)
    dist.all_reduce(summed)
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    return {"refused": refused, "loss": summed.item(), "grads": grads, "count": int(count)}


def fsdp_rows():
    """Three packed rows of 8 documents (token ids from a fixed seed)."""
    g = torch.Generator().manual_seed(1)
    lengths = [[5, 7, 3], [11, 4], [9, 6, 2]]
    rows = []
    for row in lengths:
        ids = torch.randint(3, 90, (sum(row),), generator=g).tolist()
        rows.append({"input_ids": ids, "seq_lengths": row})
    return rows


ON_REQUEST = (
    "stream",
    "eval",
    "eval_order",
    "guard_probe",
    "fsdp",
)  # refusals, the guard's probe, FSDP2: run only when named (tests/test_distributed.py launches them together,
#   apart from the default checks)


def main(out: str) -> None:
    rank = quiet_hf_rank()
    results = {}
    tmp = os.path.join(out, "work")  # shared by the ranks (rank 0 writes the checkpoints)
    checks = (
        ("sft", check_sft),
        ("moe", check_moe),
        ("dpo", check_dpo),
        ("resume", check_resume),
        ("refusal", check_refusal),
        ("loops", check_loops),
        ("stream", check_stream),
        ("eval", check_eval),
        ("eval_order", check_eval_order),
        ("guard_probe", check_guard_probe),
        ("fsdp", check_fsdp),
    )
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None  # e.g. "loops": run some checks only
    for name, check in checks:
        if (only and name not in only) or (not only and name in ON_REQUEST):
            continue
        start = time.time()
        try:
            value = check(tmp)
        except Exception:
            value = {"error": traceback.format_exc()}
        results.setdefault("seconds", {})[name] = time.time() - start
        if name in ("sft", "dpo", "loops") and "error" not in value:
            results.update(value)
        else:
            results[name] = value
    torch.save(results, Path(out) / f"rank{rank}.pt")
    # The group torn down before the interpreter exits: left to the exit, gloo's threads once aborted a rank
    # ('terminate called without an active exception', -6, in CI on 72f8b5c). No barrier: a rank whose check
    # failed may have left the other in a collective, which must end in gloo's error, not a mismatched barrier.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
