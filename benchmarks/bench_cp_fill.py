"""Fill lost to context-parallel padding when packing offline for CP size N (``pack_files(...,
context_parallel=N)``): rows planned at CP-padded lengths, compared with the plan on real lengths.

    PYTHONPATH=. python benchmarks/bench_cp_fill.py [--rows 200000] [--max-length 4096] [--mu 5.5] [--sigma 1.0]

For lognormal document lengths (``mu``, ``sigma``), one table: per N, the rows, the real fill, the CP padding
(tokens and share of the rows' capacity), the rows over ``max_length`` once padded (0 by construction) and, for
the plan on real lengths (what packing without ``--context-parallel`` gives), the rows that would overflow.
The driver's own planner (:func:`packtools.pipeline.planning.plan_parts`), no tokens moved.
"""

from __future__ import annotations

import argparse

import numpy as np

from packtools._format import text_table
from packtools.core.cp_budget import cp_padded_lengths, cp_stats
from packtools.pipeline.config import PipelineConfig
from packtools.pipeline.planning import apply_overlong, plan_parts


def padded_rows(p, n):
    padded = cp_padded_lengths(p.seg_length, n)
    return np.add.reduceat(padded, p.row_offsets[:-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--mu", type=float, default=5.5)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--strategy", default="bfd_split")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(args.mu, args.sigma, args.rows).astype(np.int64), 1)
    m = args.max_length
    plain_cfg = PipelineConfig(max_length=m, strategy=args.strategy)
    eff, _ = apply_overlong(lengths, m, plain_cfg.overlong_policy)
    plain = plan_parts(eff, [0, eff.size], plain_cfg)
    table = [
        ("N", "rows", "fill", "CP padding", "fill lost", "rows over (CP plan)", "rows over (plain plan)")
    ]
    for n in (1, 2, 4, 8):
        cfg = PipelineConfig(max_length=m, strategy=args.strategy, context_parallel=n)
        p = plan_parts(eff, [0, eff.size], cfg)
        s = cp_stats(p, n) if n > 1 else {"cp_padding_tokens": 0, "cp_fill_lost": 0.0}
        over = int((padded_rows(p, n) > m).sum()) if n > 1 else 0
        over_plain = int((padded_rows(plain, n) > m).sum()) if n > 1 else 0
        table.append(
            (
                str(n),
                f"{p.num_rows:,}",
                f"{100 * p.fill:.2f}%",
                f"{s['cp_padding_tokens']:,}",
                f"{100 * s['cp_fill_lost']:.2f}%",
                str(over),
                f"{over_plain:,} of {plain.num_rows:,}",
            )
        )
    print(
        f"{args.rows:,} lognormal documents (mu={args.mu}, sigma={args.sigma}, mean {lengths.mean():.0f} tokens, "
        f"{int((lengths < 16).sum()):,} under 16), max_length {m}, {args.strategy}"
    )
    print(text_table(table))


if __name__ == "__main__":
    main()
