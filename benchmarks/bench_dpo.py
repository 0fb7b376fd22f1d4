"""DPO without padding: TRL's padded DPOTrainer and packtools side by side, in one run.

Usage:
    python benchmarks/bench_dpo.py [--pairs 256] [--pairs-per-step 8] [--steps 12] [--hidden 256]
                                   [--pack-pairs 1000000] [--skip-training] [--peak-rss]

Part 1 (training step): synthetic preference pairs with lognormal prompt and completion lengths (completions
up to 8x their median), a tiny random Llama on the CPU, TRL's ``DPOTrainer`` (fp32, separate reference model)
as it is, the same trainer after ``packtools.prepare_dpo_trainer`` ("packtools": its per-sequence ``sdpa``),
and after ``prepare_dpo_trainer(..., segmented_sdpa=False)`` ("block mask": transformers' ``sdpa`` with the
block-diagonal mask over the whole row).  All run ``training_step`` (forward and backward of policy and
reference) on the *same* micro-batches of pairs, interleaved, after a warm-up.
Reported per step: tokens run through the model vs real tokens (a hook on the backbone counts them), the
median step time, and the activation memory autograd keeps for the backward (sum of the saved tensors'
sizes, a deterministic stand-in for the peak memory of a step).  Ratios are packtools / TRL.  ``--peak-rss``
also runs each variant alone in a fresh process and reports the peak resident memory its steps add (the
kernel's high-water mark, reset before the first step; Linux).

``--share-prompt`` adds a fourth variant, "shared prompt": ``prepare_dpo_trainer(trainer, share_prompt=True)``
(each pair's prompt forwarded once, packtools' tree attention), and times ``pack_preference(...,
share_prompt=True)`` beside ``pack_preference`` in part 2.  ``--long-prompts`` draws the skewed long-prompt set
(prompt median 800, completions median 150, narrow spread) where prompt sharing matters::

    python benchmarks/bench_dpo.py --long-prompts --share-prompt --pairs 32 --pairs-per-step 4 --steps 4 \
        --hidden 128 --pack-pairs 1000000

Part 2 (packing): ``pack_preference`` on ``--pack-pairs`` pairs (same length distribution, max_length 4096):
seconds (after a warm-up call that compiles the kernels) and rows vs the lower bound ceil(tokens / max_length).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path in the tests too

from _common import saved_bytes, small_llama_config, word_tokenizer  # noqa: E402

VOCAB = 1024


def lognormal_lengths(rng, n, median, cap):
    return np.clip(rng.lognormal(np.log(median), 0.8, n).astype(np.int64), 1, cap)


def pair_lengths(rng, n, prompt_median=32, completion_median=48, long_prompts=False):
    if long_prompts:  # the skewed long-prompt set: P ~ 800, C, R ~ 150
        return (
            np.clip(rng.lognormal(np.log(800), 0.2, n).astype(np.int64), 1, 1600),
            np.clip(rng.lognormal(np.log(150), 0.3, n).astype(np.int64), 1, 600),
            np.clip(rng.lognormal(np.log(150), 0.3, n).astype(np.int64), 1, 600),
        )
    return (
        lognormal_lengths(rng, n, prompt_median, 8 * prompt_median),
        lognormal_lengths(rng, n, completion_median, 8 * completion_median),
        lognormal_lengths(rng, n, completion_median, 8 * completion_median),
    )


def text_pairs(n, seed=0, long_prompts=False):
    rng = np.random.default_rng(seed)
    lp, lc, lr = pair_lengths(rng, n, long_prompts=long_prompts)

    def words(k):
        return " ".join(f"w{t}" for t in rng.integers(2, VOCAB, k))

    return [
        {"prompt": words(p), "chosen": " " + words(c), "rejected": " " + words(r)}
        for p, c, r in zip(lp, lc, lr)
    ]


def build_trainer(pairs, batch, out, args_hidden=256):
    import datasets
    import torch
    import transformers
    import trl

    def llama(seed):
        torch.manual_seed(seed)
        config = small_llama_config(
            VOCAB, 2, 4096, hidden_size=args_hidden, mlp_factor=4, pad_token_id=0, eos_token_id=1
        )
        return transformers.LlamaForCausalLM(config)

    args = trl.DPOConfig(
        output_dir=out,
        per_device_train_batch_size=batch,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        bf16=False,
        max_length=None,
    )
    return trl.DPOTrainer(
        llama(0),
        ref_model=llama(1),
        args=args,
        train_dataset=datasets.Dataset.from_list(pairs),
        processing_class=word_tokenizer(VOCAB),
    )


class TokenCounter:
    def __init__(self, model):
        self.tokens = 0
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.tokens += int(kwargs["input_ids"].numel())


#: The trainers compared: TRL as it is, prepared (per-sequence sdpa), prepared with sdpa's block-diagonal mask.
VARIANTS = {"TRL padded": None, "packtools": True, "block mask": False}
SHARED = "shared prompt"


def variants(args):
    """The variants of this run: those above, and the prompt-shared trainer with ``--share-prompt``."""
    chosen = {
        k: v
        for k, v in VARIANTS.items()
        if not (k == "block mask" and getattr(args, "skip_block_mask", False))
    }
    return {**chosen, **({SHARED: "shared"} if getattr(args, "share_prompt", False) else {})}


def make_trainer(name, pairs, args, out):
    from packtools import prepare_dpo_trainer

    trainer = build_trainer(pairs, args.pairs_per_step, out, args.hidden)
    segmented = variants(args)[name]
    if segmented == "shared":
        return prepare_dpo_trainer(trainer, share_prompt=True)
    return trainer if segmented is None else prepare_dpo_trainer(trainer, segmented_sdpa=segmented)


def step_batches(trainer, args):
    """The micro-batches of the timed steps: ``--pairs-per-step`` consecutive pairs each, TRL's collator."""
    data, n = trainer.train_dataset, args.pairs_per_step
    return [
        trainer.data_collator([data[i] for i in range(s * n, (s + 1) * n)])
        for s in range(min(args.steps, len(data) // n))
    ]


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def step_peak_rss(args):
    """In this (fresh) process: the peak resident memory the training steps of one variant add, in MiB.

    The trainer is built and the batches collated first; then the kernel's high-water mark is reset
    (``/proc/self/clear_refs``, Linux) and the steps run; the result is ``VmHWM`` after minus ``VmRSS`` before.
    """
    import tempfile

    pairs = text_pairs(args.pairs, long_prompts=args.long_prompts)
    with tempfile.TemporaryDirectory() as out:
        t = make_trainer(args.peak_of, pairs, args, out)
        batches = step_batches(t, args)
        t.current_gradient_accumulation_steps = 1
        t.model.train()
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        for batch in batches:
            t.training_step(t.model, dict(batch))
            t.model.zero_grad()
        return (_status_kib("VmHWM") - before) / 1024


def bench_peak_rss(args):
    """Each variant in a fresh process (the allocator keeps freed memory, so variants must not share one)."""
    import subprocess
    import sys

    peaks = {}
    for name in variants(args):
        command = [sys.executable, __file__, "--peak-of", name, "--pack-pairs", "0"]
        command += [
            f
            for f, on in (("--long-prompts", args.long_prompts), ("--share-prompt", args.share_prompt))
            if on
        ]
        for flag in ("pairs", "pairs_per_step", "steps", "hidden"):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        peaks[name] = float(done.stdout.strip().splitlines()[-1].split()[-1])
    print(f"peak resident memory added by {args.steps} training steps (fresh process each, MiB):")
    for name, mib in peaks.items():
        print(
            f"{name:12s} {mib:9.1f}"
            + ("" if name == "TRL padded" else f"  {mib / peaks['TRL padded']:.3f}x TRL")
        )
    return peaks


def bench_training(args):
    import tempfile

    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    pairs = text_pairs(args.pairs, long_prompts=args.long_prompts)
    with tempfile.TemporaryDirectory() as out:
        trainers = {name: make_trainer(name, pairs, args, out) for name in variants(args)}
        padded = trainers["TRL padded"]
        counters = {name: TokenCounter(t.model) for name, t in trainers.items()}
        batches = step_batches(padded, args)
        real = [int(b["attention_mask"].sum()) for b in batches]
        # sum(P + C + R): each pair's prompt once (its prompt tokens appear in both of its sequences).
        unique = [
            r - int((b["attention_mask"].sum() - b["completion_mask"].sum()) // 2)
            for r, b in zip(real, batches)
        ]
        for t in trainers.values():  # warm-up
            t.current_gradient_accumulation_steps = 1  # what Trainer sets before each optimizer step
            t.model.train()
            t.training_step(t.model, dict(batches[0]))
            t.model.zero_grad()
        times = {name: [] for name in trainers}
        memory = {name: [] for name in trainers}
        for c in counters.values():
            c.tokens = 0
        for batch in batches:
            for name, t in trainers.items():
                t0 = time.perf_counter()
                t.training_step(t.model, dict(batch))
                times[name].append(time.perf_counter() - t0)
                t.model.zero_grad()
        through = {name: c.tokens / len(batches) for name, c in counters.items()}  # one policy forward a step
        for batch in batches[: min(3, len(batches))]:
            for name, t in trainers.items():
                memory[name].append(saved_bytes(lambda t=t, b=batch: t.training_step(t.model, dict(b))))
                t.model.zero_grad()
        n = len(batches)
        rows = []
        for name in trainers:
            rows.append(
                (
                    name,
                    through[name],
                    through[name] / (sum(real) / n),
                    statistics.median(times[name]),
                    statistics.median(memory[name]) / 2**20,
                )
            )
    print(f"training step: {n} steps of {args.pairs_per_step} pairs, real tokens/step {sum(real) / n:.0f}")
    print(f"{'':12s} {'tokens/step':>12s} {'x real':>7s} {'step s':>8s} {'saved MB':>9s}")
    for name, tokens, ratio, sec, mb in rows:
        print(f"{name:12s} {tokens:12.0f} {ratio:7.3f} {sec:8.3f} {mb:9.1f}")
    if SHARED in through:
        print(
            f"{SHARED}: {through[SHARED] / (sum(unique) / n):.4f}x sum(P + C + R) through the model per step "
            f"(sum(P + C + R) = {sum(unique) / n:.0f}, sum(2P + C + R) = {sum(real) / n:.0f})"
        )
    (_, _, r_trl, t_trl, m_trl), *ours = rows
    for name, _, r_ours, t_ours, m_ours in ours:
        print(
            f"{name} / TRL: tokens {r_ours / r_trl:.3f}x, step time {t_ours / t_trl:.3f}x, saved memory "
            f"{m_ours / m_trl:.3f}x"
        )
    return rows


def bench_packing(args):
    import pyarrow as pa

    from packtools.dpo import pack_preference

    rng = np.random.default_rng(1)
    n = args.pack_pairs
    lengths = pair_lengths(rng, n, long_prompts=args.long_prompts)
    columns = {}
    for name, lens in zip(("prompt_ids", "chosen_ids", "rejected_ids"), lengths):
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        values = rng.integers(2, VOCAB, int(offsets[-1]), dtype=np.int32)
        columns[name] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    table = pa.table(columns)
    small = table.slice(0, 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pack_preference(small, args.max_length)  # compile the kernels
        t0 = time.perf_counter()
        packed, report = pack_preference(table, args.max_length, return_report=True)
        seconds = time.perf_counter() - t0
    print(
        f"pack_preference: {n:,} pairs, {report.tokens_kept:,} tokens, max_length {args.max_length}: "
        f"{seconds:.2f} s, {report.rows:,} rows, lower bound {report.lower_bound:,} "
        f"({report.rows / report.lower_bound:.5f}x), fill {report.fill:.4f}, truncated {report.pairs_truncated}"
    )
    if args.share_prompt:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pack_preference(small, args.max_length, share_prompt=True)  # compile
            t0 = time.perf_counter()
            _, shared = pack_preference(table, args.max_length, return_report=True, share_prompt=True)
            shared_seconds = time.perf_counter() - t0
        print(
            f"pack_preference(share_prompt=True): {shared_seconds:.2f} s ({shared_seconds / seconds:.3f}x the "
            f"unshared), {shared.tokens_kept:,} tokens ({shared.saved:.1%} of the unshared layout saved), "
            f"{shared.rows:,} rows, truncated {shared.units_truncated}"
        )
    return seconds, report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--pairs-per-step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pack-pairs", type=int, default=1_000_000)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny Llama (MLP 4x)")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument(
        "--peak-rss", action="store_true", help="also measure each variant's peak resident memory (Linux)"
    )
    parser.add_argument("--share-prompt", action="store_true", help="add the prompt-shared variant")
    parser.add_argument("--skip-block-mask", action="store_true", help="leave the block-mask variant out")
    parser.add_argument("--long-prompts", action="store_true", help="the skewed long-prompt set (P ~ 800)")
    parser.add_argument("--peak-of", choices=[*VARIANTS, SHARED], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import logging

    logging.disable(logging.WARNING)
    if args.peak_of:
        print(f"peak_rss_mib {step_peak_rss(args):.1f}")
        return None, None, None
    rows = None if args.skip_training else bench_training(args)
    peaks = bench_peak_rss(args) if args.peak_rss else None
    packing = bench_packing(args) if args.pack_pairs else None
    return rows, packing, peaks


if __name__ == "__main__":
    main()
