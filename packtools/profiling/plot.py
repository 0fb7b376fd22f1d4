"""Plots and a shareable HTML report of a :class:`~packtools.profiling.LengthProfile` (extra ``packtools[plot]``).

Not imported by ``packtools``; matplotlib is imported inside the functions.  The figures are drawn by
:mod:`packtools.profiling.figures` (:func:`plot_lengths`, :func:`plot_tradeoffs`, :func:`profile_figure`, all
importable from here); this module saves them (:func:`save_figure`) and writes the HTML report
(:func:`write_report`), whose figures are built without pyplot, so it works on any backend and in threads.

>>> from packtools import profile_lengths
>>> from packtools.profiling.plot import plot_lengths
>>> ax = plot_lengths(profile_lengths([10, 200, 3000, 45]), max_length=1024)
>>> ax.get_xlabel()
'sequence length (tokens, log scale)'
>>> ax.figure.savefig(os.devnull, format="png")
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .._atomic import atomic_path
from .._optional import require
from .figures import FEATURE, plot_lengths, plot_tradeoffs, profile_figure
from .profile import LengthProfile
from .recommend import Recommendation

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_format", "plot_lengths", "plot_tradeoffs", "profile_figure", "save_figure", "write_report"]


def plot_format(path: str | os.PathLike[str]) -> str:
    """The format of a plot file from its suffix (``png``, ``svg`` or ``pdf``), or ``ValueError``: callers
    check it before the work whose result the plot shows."""
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    if suffix not in (".png", ".svg", ".pdf"):
        raise ValueError(f"plot path {os.fspath(path)!r}: name a .png, .svg or .pdf file.")
    return suffix[1:]


def save_figure(fig: Figure, path: str | os.PathLike[str], dpi: int = 120) -> None:
    """Save ``fig`` to ``path`` atomically; the format comes from the suffix (``.png``, ``.svg``, ``.pdf``)."""
    path = os.fspath(path)
    suffix = "." + plot_format(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=suffix[1:], dpi=dpi)


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; }
img { max-width: 100%; display: block; margin: 1em 0; }
.reason { background: #f6fbf4; border-left: 4px solid #2ca02c; padding: 0.6em 1em; }
dt { font-weight: bold; } dd { margin: 0 0 0.5em 1.5em; }
tr.chosen td { background: #fff3c4; font-weight: bold; }
.flag { background: #fff4f0; border-left: 4px solid #d62728; padding: 0.6em 1em; }
"""

_DEFINITIONS = (
    ("truncated", "share of sequences longer than max_length"),
    (
        "bfd dropped",
        "share of tokens bfd drops (everything past max_length); bfd_split and wrapped drop none",
    ),
    (
        "bfd trained kept / training nothing",
        "data with labels (chat, prompt/completion): share of the trained (label) tokens bfd keeps, and share "
        "of its kept tokens in sequences whose kept part trains nothing; bfd_split (packtools pack) keeps every "
        "trained token and drops pieces that train nothing",
    ),
    ("rows / fill", "packed rows from the real planner; fill = tokens kept / (rows × max_length)"),
    (
        "padded, batch B",
        "no packing: batches of B consecutive sequences in dataset order, each cut to max_length "
        "and padded to the longest in its batch; padding = pad tokens / all tokens of the batches",
    ),
    (
        "attention cost",
        "sum of squared attention-block lengths, relative to training every sequence whole "
        "one per block (sum of length²); blocks: segments for bfd/bfd_split (padding-free), whole rows for "
        "wrapped, B × longest² per padded batch",
    ),
)


def _rules_html(rec: Recommendation) -> str:
    """Both rules side by side (the recommended one marked), and the flags."""
    if not rec.options:
        return ""
    head = (
        "<tr><th>rule</th><th>max_length</th><th>sequences cut</th><th>tokens bfd drops</th><th>rows bfd</th>"
        "<th>rows bfd_split</th><th>attention cost</th></tr>"
    )
    chosen = ' class="chosen"'
    rows = "".join(
        f"<tr{chosen if o.rule == rec.rule else ''}><td>{html.escape(o.label)}</td>"
        f"<td>{o.max_length:,}</td><td>{o.sequences_cut:,}</td><td>{o.tokens_dropped_bfd:,}</td>"
        f"<td>{o.bfd_rows:,}</td><td>{o.bfd_split_rows:,}</td><td>{o.attention:.3g}x ({o.strategy})</td></tr>"
        for o in rec.options
    )
    flags = "".join(f'<p class="flag">{html.escape(f)}</p>' for f in rec.flags)
    return f'<table class="rules">{head}{rows}</table>{flags}'


def write_report(
    profile: LengthProfile,
    path: str | os.PathLike[str],
    candidates: Iterable[int] | None = None,
    max_length: int | None = None,
    *,
    batch_size: int = 8,
    keep_tokens: float | None = None,
    multiple_of: int = 64,
    keep_sequences: float | None = None,
    max_context: int = 32768,
) -> Recommendation:
    """Write one self-contained HTML file: statistics, recommendation, both plots (inline PNG) and the table.

    Without ``max_length`` the recommended one is marked; either way it joins the candidates of the table.
    The recommendation is :meth:`LengthProfile.recommend`'s (given the last four arguments): both rules side by
    side with their costs, its flags under them.  Written atomically; returns the recommendation.
    """
    figure = require("matplotlib.figure", FEATURE)
    rec = profile.recommend(
        keep_tokens=keep_tokens,
        multiple_of=multiple_of,
        keep_sequences=keep_sequences,
        max_context=max_context,
    )
    chosen = rec.max_length if max_length is None else max_length
    cands = set(profile.default_candidates() if candidates is None else candidates) | {chosen}
    table = profile.tradeoffs(sorted(cands), batch_size=batch_size)
    images = []
    for draw in (
        lambda ax: plot_lengths(profile, chosen, ax=ax),
        lambda ax: plot_tradeoffs(profile, ax=ax, max_length=chosen, table=table),
    ):
        fig = figure.Figure(figsize=(10.0, 4.6), layout="constrained")
        draw(fig.subplots())
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=110)
        images.append(base64.b64encode(png.getvalue()).decode("ascii"))
    stats = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{v:,.1f}</td></tr>"
        if isinstance(v, float)
        else f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(f'{v:,}' if isinstance(v, int) else str(v))}</td></tr>"
        for k, v in profile.summary().items()
    )
    defs = "".join(f"<dt>{html.escape(a)}</dt><dd>{html.escape(b)}</dd>" for a, b in _DEFINITIONS)
    title = html.escape(profile.title)
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Length profile: {title}</title>
<style>{_CSS}</style></head><body>
<h1>Length profile: {html.escape(profile.name or "dataset")}</h1>
<p>{title}</p>
<h2>Recommendation</h2>
<p class="reason">{html.escape(rec.reason)}</p>
{_rules_html(rec)}
<h2>Length distribution</h2>
<img alt="histogram of sequence lengths" src="data:image/png;base64,{images[0]}">
<table class="stats">{stats}</table>
<h2>Tradeoffs per max_length</h2>
<img alt="tokens kept and fill per strategy against max_length" src="data:image/png;base64,{images[1]}">
{table.to_html(highlight=chosen)}
<dl>{defs}</dl>
<p><small>Made by packtools from sequence lengths only; rows and fill come from packtools.plan.</small></p>
</body></html>
"""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(doc.encode("utf-8"))
    return rec
