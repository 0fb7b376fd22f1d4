"""The figures of a :class:`~packtools.profiling.LengthProfile`: the length histogram and the tradeoff plot.

The drawing itself (matplotlib, imported inside the functions); :mod:`packtools.profiling.plot` is where users
import them from, with saving and the HTML report.  With ``ax=None`` the plot functions open a new pyplot
figure (shown inline in notebooks); pass ``ax`` to draw into your own figure.  :func:`profile_figure` builds
its figure without pyplot, so it works on any backend and in threads.

>>> from packtools import profile_lengths
>>> fig = profile_figure(profile_lengths([10, 200, 3000, 45]), [256, 4096], max_length=1024)
>>> [ax.get_xlabel() for ax in fig.axes][0]
'sequence length (tokens, log scale)'
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from .._optional import require
from .profile import LengthProfile
from .tradeoffs import TradeoffTable

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FEATURE = "plotting length profiles"
PERCENTILE_COLORS = ("#4d4d4d", "#1b9e77", "#7570b3", "#e7298a", "#66a61e")
MAX_LENGTH_COLOR = "#d62728"


def _new_axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    require("matplotlib", FEATURE)
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _tokens(x: float, _pos: object = None) -> str:
    """1, 10, 100, 1k, 10k, 1.5M ..."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:g}{unit}"
    return f"{x:g}"


def _stagger(xs: list[float], decades: float, widths: list[float]) -> list[int]:
    """A text row for each label at ``xs`` (log axis spanning ``decades``) so that no two in a row overlap:
    ``widths`` are the labels' widths as shares of the axis; labels whose centres are closer than half their
    widths added go to the next row up."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    rows: list[list[tuple[float, float]]] = []
    levels = [0] * len(xs)
    for i in order:
        pos = math.log10(max(xs[i], 1)) / max(decades, 1e-9)
        for r, taken in enumerate(rows):
            if all(abs(pos - q) >= (widths[i] + w) / 2 for q, w in taken):
                taken.append((pos, widths[i]))
                levels[i] = r
                break
        else:
            rows.append([(pos, widths[i])])
            levels[i] = len(rows) - 1
    return levels


#: a marker label's width per character, as a share of the histogram's axis (7.5 pt text on a 9-inch figure)
LABEL_CHAR_WIDTH = 0.0105


def plot_lengths(profile: LengthProfile, max_length: int | None = None, ax: Axes | None = None) -> Axes:
    """Histogram of sequence lengths on a log length axis, with percentile markers and ``max_length``.

    The title names the dataset and its counts; empty sequences (which a log axis cannot show) are counted
    in the title.  A chosen ``max_length`` is drawn as a red line with what it truncates, the region it cuts
    shaded.  Returns the axes.
    """
    ticker = require("matplotlib.ticker", FEATURE)
    ax = _new_axes(ax, (9.0, 4.5))
    edges, counts = profile.hist_edges, profile.hist_counts
    ax.stairs(
        counts,
        edges,
        fill=True,
        color="#9ecae1",
        edgecolor="#3182bd",
        linewidth=0.8,
        label="sequences per bin",
    )
    ax.set_xscale("log")
    if counts.sum() == 0:
        ax.text(0.5, 0.5, "no non-empty sequences", transform=ax.transAxes, ha="center", va="center")
    marks = []  # (x, short label, color): every marker is also written at the top of the plot
    if max_length is not None:
        share = profile.num_truncated(max_length) / profile.count if profile.count else 0.0
        dropped = 1.0 - profile.tokens_kept_share(max_length)
        ax.axvline(
            max_length,
            color=MAX_LENGTH_COLOR,
            linewidth=2.6,
            alpha=0.55,
            zorder=2,
            label=f"max_length = {max_length:,}\n  truncates {share:.2%} of sequences\n"
            f"  bfd drops {dropped:.2%} of tokens",
        )
        marks.append((max_length, f"max_length {max_length:,}", MAX_LENGTH_COLOR))
    # (name, length, color, line style, width): the percentiles, then the longest sequence
    markers = [(k, v, c, "--", 1.2) for (k, v), c in zip(profile.percentiles.items(), PERCENTILE_COLORS)]
    for key, value, color, style, width in [*markers, ("max", profile.max, "black", ":", 1.4)]:
        if value > 0:  # drawn over the max_length line, so a percentile next to it stays visible
            label = f"{key} = {value:,} tokens"
            ax.axvline(value, color=color, linestyle=style, linewidth=width, zorder=3, label=label)
            marks.append((value, f"{key} {value:,}", color))
    right = max(edges[-1], profile.max, max_length or 0) * 1.6
    nonempty = np.flatnonzero(counts > 0)
    # from the shortest length (a little room to its left), not from 1
    left = max(1.0, float(edges[nonempty[0]]) / 1.3) if nonempty.size else float(edges[0])
    ax.set_xlim(left, right)
    if max_length is not None and right > max_length:
        ax.axvspan(max_length, right, color=MAX_LENGTH_COLOR, alpha=0.07, linewidth=0)
    top = float(counts.max()) if counts.size and counts.max() > 0 else 1.0
    levels = _stagger(
        [x for x, _, _ in marks],
        math.log10(right / left),
        [LABEL_CHAR_WIDTH * (len(t) + 2) for _, t, _ in marks],
    )
    ax.set_ylim(0, top * (1.12 + 0.09 * (max(levels, default=0) + 1)))
    for (x, text, color), level in zip(marks, levels):
        ax.text(
            x,
            top * (1.06 + 0.09 * level),
            text,
            color=color,
            fontsize=7.5,
            ha="center",
            va="bottom",
            zorder=4,
            bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85),
        )
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(_tokens))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _p: f"{y:,.0f}"))
    ax.set_xlabel("sequence length (tokens, log scale)")
    ax.set_ylabel("sequences per bin")
    ax.set_title("\n".join(textwrap.wrap(profile.title, 80)), fontsize=11)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return ax


def plot_tradeoffs(
    profile: LengthProfile,
    candidates: Iterable[int] | None = None,
    ax: Axes | None = None,
    *,
    max_length: int | None = None,
    batch_size: int = 8,
    table: TradeoffTable | None = None,
) -> Axes:
    """Tokens kept and row fill of each strategy against ``max_length`` (from :meth:`LengthProfile.tradeoffs`).

    Fill is the share of each packed row (or padded batch, without packing) holding real tokens.  Pass
    ``table`` to reuse a computed :class:`~packtools.profiling.tradeoffs.TradeoffTable`.  Returns the axes.
    """
    ticker = require("matplotlib.ticker", FEATURE)
    ax = _new_axes(ax, (9.0, 4.5))
    if table is None:
        table = profile.tradeoffs(candidates, batch_size=batch_size)
    xs = [r.max_length for r in table]
    series = [
        (
            "tokens kept, bfd",
            [r.kept for r in table],
            dict(color="C0", linestyle="-", marker="o", linewidth=2.2),
        ),
        # the three fills often sit together near 100%: widest and hollow first, so that each stays visible
        (
            "row fill, bfd",
            [r.bfd_fill for r in table],
            dict(
                color="C0", linestyle="--", linewidth=3.2, marker="s", markersize=11, markerfacecolor="none"
            ),
        ),
        (
            "row fill, bfd_split",
            [r.bfd_split_fill for r in table],
            dict(color="C1", linestyle="-.", linewidth=1.8, marker="^", markersize=8, markerfacecolor="none"),
        ),
        (
            "row fill, wrapped",
            [r.wrapped_fill for r in table],
            dict(color="C2", linestyle=":", linewidth=1.2, marker="v", markersize=4),
        ),
        (
            f"batch fill, padded batches of {table.batch_size} (no packing)",
            [1.0 - r.padding for r in table],
            dict(color="C3", linestyle=":", marker="d"),
        ),
    ]
    if table.rows and table.rows[0].trained_kept is not None:  # data with labels: what training learns from
        series.insert(
            1,
            (
                "trained (label) tokens kept, bfd",
                [r.trained_kept for r in table],
                dict(color="C4", linestyle="-", marker="*", markersize=9, linewidth=1.8),
            ),
        )
    ax.axhline(
        100,
        color="0.5",
        linestyle=":",
        linewidth=1.2,
        label="tokens kept, bfd_split and wrapped (always 100%)",
    )
    for label, ys, style in series:
        ax.plot(xs, [100 * y for y in ys], label=label, **style)
    fills = np.array([ys for label, ys, _ in series if label.startswith("row fill")])
    if fills.size and float((fills.max(axis=0) - fills.min(axis=0)).max()) < 0.01:
        ax.text(
            0.01,
            0.02,
            "the row fills of bfd, bfd_split and wrapped are within 1 point of each other",
            transform=ax.transAxes,
            fontsize=7.5,
            color="0.3",
        )
    if max_length is not None:
        ax.axvline(
            max_length,
            color=MAX_LENGTH_COLOR,
            linewidth=1.5,
            alpha=0.8,
            label=f"chosen max_length = {max_length:,}",
        )
        # the chosen value is written at the top, next to its line: no candidate's tick label gives way to it
        ax.annotate(
            f"chosen {max_length:,}",
            (max_length, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            color=MAX_LENGTH_COLOR,
            fontsize=8,
            fontweight="bold",
        )
    ax.set_xscale("log", base=2)
    ticks = [x for x in xs if x != max_length] or xs  # every candidate is labelled
    ax.set_xticks(ticks, labels=[f"{x:,}" for x in ticks])
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    close = any(b / a < 1.5 for a, b in zip(ticks, ticks[1:]))
    if len(ticks) > 5 or close:
        ax.tick_params(axis="x", labelrotation=40, labelsize=8)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    if len(xs) == 1:
        ax.set_xlim(xs[0] / 1.5, xs[0] * 1.5)
    low = min(min(ys) for _, ys, _ in series) * 100
    ax.set_ylim(max(0.0, low - 5), 102)
    ax.yaxis.set_major_formatter(ticker.PercentFormatter(decimals=0))
    ax.set_xlabel("max_length (tokens, log scale)")
    ax.set_ylabel("tokens kept / fill (%)")
    ax.set_title(
        "\n".join(
            textwrap.wrap(f"{profile.name or 'dataset'}: what each strategy does at each max_length", 80)
        ),
        fontsize=11,
        pad=14,
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return ax


def profile_figure(
    profile: LengthProfile,
    candidates: Iterable[int] | None = None,
    max_length: int | None = None,
    batch_size: int = 8,
    table: TradeoffTable | None = None,
) -> Figure:
    """Both plots stacked in one figure, built without pyplot (any backend, any thread)."""
    figure = require("matplotlib.figure", FEATURE)
    fig = figure.Figure(figsize=(11.0, 8.5), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    plot_lengths(profile, max_length, ax=top)
    plot_tradeoffs(profile, candidates, ax=bottom, max_length=max_length, batch_size=batch_size, table=table)
    return fig
