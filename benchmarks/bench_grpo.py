"""GRPO log-probability forwards without padding: TRL's padded GRPOTrainer and packtools side by side, in one run.

Usage:
    python benchmarks/bench_grpo.py [--groups 2] [--group-size 8] [--steps 3] [--hidden 64]
                                    [--prompt-min 256] [--prompt-max 2048] [--completion-max 1024] [--rounds 2] [--in-process]

Generation is not timed: each micro-batch is built synthetically in the layout TRL's
``_generate_and_score_completions`` hands to ``_compute_loss`` (prompts left-padded, completions right-padded,
``--groups`` prompts of ``--group-size`` completions each).  Prompt lengths are uniform in
``[--prompt-min, --prompt-max]``; completion lengths long-tailed (lognormal, median ``--completion-max / 8``,
capped at ``--completion-max``).  A tiny random Llama (fp32, CPU) runs the policy's forward and backward (what
``_compute_loss`` asks for: log-probabilities and entropies) and a no-grad forward (the old policy's or the
reference's log-probabilities), through the same ``GRPOTrainer``'s method:

* ``TRL padded``: TRL's own ``_get_per_token_logps_and_entropies`` (the trainer as TRL builds it);
* ``packtools``: after ``prepare_grpo_trainer(trainer, share_prompt=False)`` (one plain padding-free row,
  per-sequence ``sdpa``);
* ``shared prompt``: after ``prepare_grpo_trainer(trainer, share_prompt=True)`` (each prompt once, tree
  attention; what the default ``share_prompt="auto"`` chooses for this Llama).

Each variant runs in fresh processes of its own (the same seed, batches and weights), ``--rounds`` of them
interleaved with the other variants' (a load spike on a shared machine then hits one run, not one variant), the
smallest time and memory kept; ``--in-process`` runs them here, once, without the memory figure below.  Reported per micro-batch: tokens forwarded (exact: the rows' widths),
the median time of the forward+backward and of the no-grad forward, the activation memory autograd keeps for
the backward (sum of the saved tensors' sizes: deterministic), and the process's peak RSS
(``getrusage(RUSAGE_SELF).ru_maxrss`` of the child at its end) with what the forwards added to it (the peak
minus the RSS measured right before them: the model, the batches and the imports are already resident).
Ratios are variant / TRL padded.  The token counts
for ``G = 16`` and ``64`` are exact arithmetic on the same prompts with more completions drawn from the same
distribution; their time ratios are projected from this run's measured seconds per forwarded token of each
variant (an estimate: attention's quadratic part grows faster than the token count).  Last, the data-parallel
balance (arithmetic, no model): 2 ranks, the busiest rank's prompt tokens over the mean, in TRL's sampler order
and in packtools' balanced one (``balance_groups``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path in the tests too

from _common import saved_bytes, small_llama_config, word_tokenizer  # noqa: E402

VOCAB = 1024
VARIANTS = {"TRL padded": None, "packtools": False, "shared prompt": True}  # share_prompt per variant


def draw(rng, groups, group_size, args):
    prompts = rng.integers(args.prompt_min, args.prompt_max + 1, groups)
    median = max(1, args.completion_max // 8)
    completions = np.clip(rng.lognormal(np.log(median), 1.0, groups * group_size), 1, args.completion_max)
    return prompts, completions.astype(np.int64)


def trl_batch(rng, prompts, completions, group_size):
    """``(input_ids, attention_mask, logits_to_keep)`` as TRL concatenates them in ``_compute_loss``."""
    import torch

    n = completions.shape[0]
    width_p, width_c = int(prompts.max()), int(completions.max())
    ids = torch.zeros(n, width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for g, p in enumerate(prompts):
        prompt = torch.from_numpy(rng.integers(2, VOCAB, int(p)))
        for k in range(group_size):
            b, c = g * group_size + k, int(completions[g * group_size + k])
            ids[b, width_p - p : width_p] = prompt
            ids[b, width_p : width_p + c] = torch.from_numpy(rng.integers(2, VOCAB, c))
            mask[b, width_p - p : width_p + c] = 1
    order = torch.from_numpy(rng.permutation(n))  # TRL shuffles the generation batch before splitting it
    return ids[order], mask[order], width_c


def token_counts(prompts, completions, group_size):
    """Tokens each layout forwards for one micro-batch: padded, padding-free, prompt-shared (exact)."""
    n = completions.shape[0]
    padded = n * (int(prompts.max()) + int(completions.max()))
    free = int(np.repeat(prompts, group_size).sum() + completions.sum())
    shared = int(
        prompts.sum() + (group_size - 1) * prompts.shape[0] + completions.sum()
    )  # heads repeat once each
    return padded, free, shared


def build_trainer(args, tmp):
    import datasets
    import torch
    import transformers
    import trl

    torch.manual_seed(0)
    max_positions = args.prompt_max + args.completion_max + 8
    config = small_llama_config(
        VOCAB, 2, max_positions, hidden_size=args.hidden, pad_token_id=0, eos_token_id=1
    )
    model = transformers.LlamaForCausalLM(config).float()
    cfg = trl.GRPOConfig(
        output_dir=tmp,
        per_device_train_batch_size=args.group_size,
        num_generations=args.group_size,
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        beta=0.0,
    )
    return trl.GRPOTrainer(
        model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=cfg,
        train_dataset=datasets.Dataset.from_list([{"prompt": "w2 w3"}] * 4),
        processing_class=word_tokenizer(VOCAB),
    )


def measure(trainer, batches, steps):
    import torch

    ids, mask, keep = batches[0]

    def train_step(batch=batches[0]):
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, *batch, compute_entropy=True
        )
        (logps.sum() + entropies.sum()).backward()

    def scoring(batch=batches[0]):
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(trainer.model, *batch)

    memory = saved_bytes(
        lambda: trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, keep, compute_entropy=True
        )
    )
    train_step()  # warm-up
    scoring()
    step_times, score_times = [], []
    for i in range(steps):
        batch = batches[i % len(batches)]
        start = time.perf_counter()
        train_step(batch)
        step_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        scoring(batch)
        score_times.append(time.perf_counter() - start)
    trainer.model.zero_grad()
    return statistics.median(step_times), statistics.median(score_times), memory


def variant_run(args, name, batches):
    """One variant's measurement: a fresh trainer (same seed, same weights), prepared as ``name`` asks."""
    import tempfile

    from packtools.integrations.rl import prepare_grpo_trainer

    share = VARIANTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(args, tmp)
        trainer.model.train()
        if share is not None:
            prepare_grpo_trainer(trainer, share_prompt=share)
        before = current_rss()
        step, score, saved = measure(trainer, batches, args.steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"step": step, "score": score, "saved": saved, "rss_peak": peak, "rss_before": before}


def current_rss():
    """This process's resident bytes now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def in_fresh_process(argv, name):
    """``variant_run`` in a child process of its own (its peak RSS not mixed with another variant's)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--variant", name], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"variant {name!r} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    import json
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=2, help="prompts per micro-batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--prompt-min", type=int, default=256)
    parser.add_argument("--prompt-max", type=int, default=2048)
    parser.add_argument("--completion-max", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="fresh processes per variant, interleaved; the smallest figures kept",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="run the variants in this process (no peak RSS per variant)"
    )
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # a child's one variant
    args = parser.parse_args(argv)
    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore")
    import torch

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    draws = [draw(rng, args.groups, args.group_size, args) for _ in range(max(1, args.steps))]
    batches = [trl_batch(rng, p, c, args.group_size) for p, c in draws]
    if args.variant is not None:  # a child: one variant, its figures as one JSON line
        print(json.dumps(variant_run(args, args.variant, batches)))
        return None
    counts = np.array([token_counts(p, c, args.group_size) for p, c in draws]).sum(0)
    runs = {name: [] for name in VARIANTS}
    for _ in range(
        1 if args.in_process else args.rounds
    ):  # interleaved: a load spike hits one run, not one variant
        for name in VARIANTS:
            runs[name].append(
                variant_run(args, name, batches) if args.in_process else in_fresh_process(argv, name)
            )
    results = {name: {key: min(r[key] for r in got) for key in got[0]} for name, got in runs.items()}
    rows = []
    base = results["TRL padded"]
    print(
        f"G={args.group_size}, {args.groups} prompts per micro-batch, {args.steps} micro-batches, hidden {args.hidden}"
        + (
            ""
            if args.in_process
            else f"; each variant in {args.rounds} fresh processes, interleaved, the smallest kept"
        )
    )
    print(
        f"{'variant':<14} {'tokens':>9} {'ratio':>6} {'fwd+bwd s':>10} {'ratio':>6} {'no-grad s':>10} {'ratio':>6} "
        f"{'saved MiB':>10} {'ratio':>6} {'RSS MiB':>8} {'+fwd MiB':>9} {'ratio':>6}"
    )
    for (name, r), tokens in zip(results.items(), counts):
        grown, base_grown = r["rss_peak"] - r["rss_before"], base["rss_peak"] - base["rss_before"]
        rss_ratio = None if args.in_process else grown / base_grown
        rows.append(
            (
                name,
                int(tokens),
                tokens / counts[0],
                r["step"] / base["step"],
                r["score"] / base["score"],
                r["saved"] / base["saved"],
                rss_ratio,
            )
        )
        rss = (
            "-"
            if args.in_process
            else f"{r['rss_peak'] / 2**20:>8.0f} {grown / 2**20:>9.0f} {rss_ratio:>6.2f}"
        )
        print(
            f"{name:<14} {int(tokens):>9} {tokens / counts[0]:>6.2f} {r['step']:>10.3f} {r['step'] / base['step']:>6.2f} "
            f"{r['score']:>10.3f} {r['score'] / base['score']:>6.2f} {r['saved'] / 2**20:>10.1f} "
            f"{r['saved'] / base['saved']:>6.2f} {rss}"
        )
    # Larger groups: the same prompts, more completions from the same distribution; tokens exact, time projected.
    per_token = {name: results[name]["step"] / tokens for name, tokens in zip(results, counts)}
    projections = {}
    for group in (args.group_size, 16, 64):
        more = draws  # the measured micro-batches; larger groups draw more completions for the same prompts
        if group != args.group_size:
            more = [
                (p, draw(np.random.default_rng(args.seed + i), args.groups, group, args)[1])
                for i, (p, _) in enumerate(draws)
            ]
        tokens = np.array([token_counts(p, c, group) for p, c in more]).sum(0)
        time_ratio = [
            per_token[name] * t / (per_token["TRL padded"] * tokens[0]) for name, t in zip(results, tokens)
        ]
        projections[group] = (tokens / tokens[0], time_ratio)
        print(
            f"G={group:<3} tokens vs padded: packtools {tokens[1] / tokens[0]:.2f}, shared {tokens[2] / tokens[0]:.2f}; "
            f"projected fwd+bwd time: packtools {time_ratio[1]:.2f}, shared {time_ratio[2]:.2f}"
        )
    balance = rank_balance(args)
    print(
        f"2 ranks, {BALANCE_GROUPS_PER_RANK} groups of G={args.group_size} per rank per generation batch, prompts "
        f"{args.prompt_min}-{args.prompt_max} tokens, {BALANCE_BATCHES} generation batches: busiest rank's prompt "
        f"tokens / mean, TRL's order {balance[0]:.3f} (worst {balance[1]:.3f}), balanced {balance[2]:.3f} "
        f"(worst {balance[3]:.3f})"
    )
    return rows, projections, balance


BALANCE_GROUPS_PER_RANK, BALANCE_BATCHES = 4, 200


def rank_balance(args, ranks=2):
    """Prompt tokens per rank under data parallelism, TRL's ``RepeatSampler`` order and packtools' balanced one
    (:class:`~packtools.integrations.rl.groups.GroupBalancedSampler`): the mean and worst of the busiest rank's
    prompt tokens over the mean rank's, over ``BALANCE_BATCHES`` generation batches.  Arithmetic on lengths."""
    from trl.trainer.utils import RepeatSampler

    from packtools.integrations.rl.groups import GroupBalancedSampler

    per_batch = BALANCE_GROUPS_PER_RANK * ranks
    lengths = np.random.default_rng(args.seed).integers(
        args.prompt_min, args.prompt_max + 1, per_batch * BALANCE_BATCHES
    )

    def trl_sampler():  # seeded: two of them yield the same order
        return RepeatSampler(range(lengths.size), args.group_size, batch_size=per_batch, seed=args.seed)

    block = per_batch * args.group_size
    sampler = GroupBalancedSampler(
        trl_sampler(),
        group=args.group_size,
        block=block,
        ranks=ranks,
        prompt_tokens=lambda i: int(lengths[i]),
    )

    def loads(stream):  # prompt tokens per rank and generation batch (each group's G copies counted once)
        return lengths[np.asarray(list(stream))].reshape(-1, ranks, block // ranks).sum(2) / args.group_size

    before, after = loads(trl_sampler()), loads(sampler)
    ratio_before, ratio_after = before.max(1) / before.mean(1), after.max(1) / after.mean(1)
    return ratio_before.mean(), ratio_before.max(), ratio_after.mean(), ratio_after.max()


if __name__ == "__main__":
    main()
