"""The tradeoff table: what each strategy would do at each candidate ``max_length``, from the real planner.

For a candidate ``max_length`` ``m`` and lengths ``l_i`` (``n`` sequences, ``T`` tokens), a row holds:

- ``truncated``: share of sequences longer than ``m`` (``#{l_i > m} / n``).
- ``dropped``: share of tokens ``bfd`` drops (``sum(max(l_i - m, 0)) / T``); ``bfd_split`` and ``wrapped``
  drop none.
- ``bfd_rows``, ``bfd_split_rows``, ``wrapped_rows``: packed rows (training examples) from
  :func:`packtools.plan`; ``*_fill``: tokens kept / (rows * ``m``).
- ``padding``: with no packing, batches of ``batch_size`` consecutive sequences in dataset order (the last
  may be shorter), each sequence cut to ``m`` and each batch padded to its longest cut sequence: pad tokens /
  all tokens of the padded batches.  ``padded_batches`` is the number of such batches.
- ``trained_kept``, ``untrained`` (data with labels only): the share of the trained (label) tokens ``bfd``
  keeps, and the share of its kept tokens in sequences whose kept part trains nothing.
- ``attn_*``: attention cost, the sum over attention blocks of their squared length (causal attention work
  grows with it), relative to training every sequence whole, one per block: ``sum(l_i ** 2)``.  Blocks are
  the planner's segments for ``bfd`` / ``bfd_split`` (padding-free varlen attention over ``seq_lengths``),
  whole packed rows for ``wrapped`` (it has no ``seq_lengths``), and ``batch_size * longest ** 2`` per
  padded batch for ``padded``.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any, Generic, TypeVar

import numpy as np

from .._format import group_spans, text_table
from ..core.plan import check_max_length, plan
from ..errors import PackingError
from .distribution import LengthDistribution


@dataclass(frozen=True)
class Tradeoff:
    """One candidate ``max_length``; shares are fractions in [0, 1] (see the module docstring)."""

    max_length: int
    truncated: float
    dropped: float
    bfd_rows: int
    bfd_fill: float
    bfd_split_rows: int
    bfd_split_fill: float
    wrapped_rows: int
    wrapped_fill: float
    padded_batches: int
    padding: float
    attn_bfd: float
    attn_bfd_split: float
    attn_wrapped: float
    attn_padded: float
    #: data with labels only (a profile with ``trained``; None otherwise)
    trained_kept: float | None = None
    untrained: float | None = None

    @property
    def kept(self) -> float:
        """Share of tokens ``bfd`` keeps."""
        return 1.0 - self.dropped


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _int(x: int) -> str:
    return f"{x:,}"


def _times(x: float) -> str:
    return f"{x:.3g}x"


# (group, header, field, formatter); group "" spans nothing
COLUMNS: tuple[tuple[str, str, str, Callable[[Any], str]], ...] = (
    ("", "max_length", "max_length", _int),
    ("", "truncated", "truncated", _pct),
    ("bfd", "dropped", "dropped", _pct),
    ("bfd", "trained kept", "trained_kept", _pct),
    ("bfd", "training nothing", "untrained", _pct),
    ("bfd", "rows", "bfd_rows", _int),
    ("bfd", "fill", "bfd_fill", _pct),
    ("bfd_split", "rows", "bfd_split_rows", _int),
    ("bfd_split", "fill", "bfd_split_fill", _pct),
    ("wrapped", "rows", "wrapped_rows", _int),
    ("wrapped", "fill", "wrapped_fill", _pct),
    ("padded", "batches", "padded_batches", _int),
    ("padded", "padding", "padding", _pct),
    ("attention cost", "bfd", "attn_bfd", _times),
    ("attention cost", "split", "attn_bfd_split", _times),
    ("attention cost", "wrapped", "attn_wrapped", _times),
    ("attention cost", "padded", "attn_padded", _times),
)


R = TypeVar("R")


class _Rows(Generic[R]):
    """What both tables share: their ``rows`` read in order, by index, or as plain dicts."""

    rows: tuple[R, ...]

    def __iter__(self) -> Iterator[R]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> R:
        return self.rows[i]

    def to_dicts(self) -> list[dict[str, Any]]:
        """One plain dict per row (e.g. for ``pandas.DataFrame`` or JSON)."""
        return [asdict(r) for r in self.rows]


def _markdown(heads: list[str], aligns: list[str], cells: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table: ``heads``, their alignments (``---:``) and a line per row of ``cells``."""
    lines = ["| " + " | ".join(row) + " |" for row in (heads, *cells)]
    return "\n".join([lines[0], "|" + "|".join(aligns) + "|", *lines[1:]])


@dataclass(frozen=True)
class TradeoffTable(_Rows[Tradeoff]):
    """Rows of :class:`Tradeoff`, one per candidate, with text / Markdown / HTML renderings."""

    rows: tuple[Tradeoff, ...]
    batch_size: int
    name: str | None = None

    @property
    def columns(self) -> tuple[tuple[str, str, str, Callable[[Any], str]], ...]:
        """:data:`COLUMNS`, without the trained-token ones for data without labels."""
        trained = bool(self.rows) and self.rows[0].trained_kept is not None
        return tuple(c for c in COLUMNS if trained or c[2] not in ("trained_kept", "untrained"))

    def _cells(self) -> list[list[str]]:
        return [[fmt(getattr(r, key)) for _, _, key, fmt in self.columns] for r in self.rows]

    def _groups(self) -> list[str]:
        return [g.replace("padded", f"padded, batch {self.batch_size}") for g, _, _, _ in self.columns]

    def to_text(self) -> str:
        """A fixed-width table with a group header line (what the CLI prints)."""
        heads = [h for _, h, _, _ in self.columns]
        return text_table([heads, *self._cells()], groups=self._groups(), first_left=False)

    def to_markdown(self) -> str:
        """A GitHub-flavoured Markdown table."""
        heads = [
            f"{g} {h}".strip() if g and g != h else h
            for g, h in zip(self._groups(), (c[1] for c in self.columns))
        ]
        return _markdown(heads, ["---:"] * len(heads), self._cells())

    def to_html(self, highlight: int | None = None) -> str:
        """An HTML ``<table>`` with grouped headers; the row of ``max_length == highlight`` gets class "chosen"."""
        top = "".join(
            f'<th colspan="{b - a + 1}">{html.escape(g)}</th>' for g, a, b in group_spans(self._groups())
        )
        heads = "".join(f"<th>{html.escape(h)}</th>" for _, h, _, _ in self.columns)
        body = "".join(
            ('<tr class="chosen">' if r.max_length == highlight else "<tr>")
            + "".join(f"<td>{html.escape(c)}</td>" for c in row)
            + "</tr>"
            for r, row in zip(self.rows, self._cells())
        )
        return (
            f'<table class="tradeoffs"><thead><tr>{top}</tr><tr>{heads}</tr></thead>'
            f"<tbody>{body}</tbody></table>"
        )


def check_candidates(candidates: Iterable[int]) -> list[int]:
    """The candidate ``max_length`` values, each checked, sorted without repeats (none given: refused)."""
    try:
        values = [check_max_length(c) for c in candidates]
    except PackingError as exc:
        raise PackingError(f"candidates: {exc}") from None
    if not values:
        raise PackingError("candidates is empty; give at least one max_length, e.g. [512, 1024, 2048].")
    return sorted(set(values))


def _squares(x: np.ndarray) -> float:
    f = x.astype(np.float64)
    return float(np.dot(f, f))


def padded_batches(lengths: np.ndarray, max_length: int, batch_size: int) -> tuple[int, int, float]:
    """``(batches, padded tokens, sum of batch_size * longest**2)`` for padded batches in dataset order."""
    n = lengths.shape[0]
    if n == 0:
        return 0, 0, 0.0
    nb = -(-n // batch_size)
    cut = np.zeros(nb * batch_size, np.int64)
    np.minimum(lengths, max_length, out=cut[:n])
    longest = cut.reshape(nb, batch_size).max(axis=1)
    sizes = np.full(nb, batch_size, np.int64)
    sizes[-1] = n - (nb - 1) * batch_size
    f = longest.astype(np.float64)
    return nb, int(np.dot(sizes, longest)), float(np.dot(sizes.astype(np.float64), f * f))


def tradeoff_row(profile: LengthDistribution, max_length: int, batch_size: int) -> Tradeoff:
    """Plan ``bfd``, ``bfd_split`` and ``wrapped`` at ``max_length`` and summarize them."""
    lens = profile.lengths
    n, total = profile.count, profile.total_tokens
    base = _squares(lens) or 1.0
    plans = {s: plan(lens, max_length, s) for s in ("bfd", "bfd_split", "wrapped")}
    kept = profile.tokens_kept(max_length)
    nb, padded_tokens, padded_sq = padded_batches(lens, max_length, batch_size)
    return Tradeoff(
        max_length=max_length,
        truncated=profile.num_truncated(max_length) / n if n else 0.0,
        dropped=(total - kept) / total if total else 0.0,
        bfd_rows=plans["bfd"].num_rows,
        bfd_fill=plans["bfd"].fill,
        bfd_split_rows=plans["bfd_split"].num_rows,
        bfd_split_fill=plans["bfd_split"].fill,
        wrapped_rows=plans["wrapped"].num_rows,
        wrapped_fill=plans["wrapped"].fill,
        padded_batches=nb,
        padding=1.0 - kept / padded_tokens if padded_tokens else 0.0,
        attn_bfd=_squares(plans["bfd"].seg_length) / base,
        attn_bfd_split=_squares(plans["bfd_split"].seg_length) / base,
        attn_wrapped=_squares(plans["wrapped"].row_lengths) / base,
        attn_padded=padded_sq / base,
        **_trained(profile, max_length, kept),
    )


def _trained(profile: LengthDistribution, max_length: int, kept: int) -> dict[str, float]:
    """The trained-token columns of a profile with ``trained`` (:mod:`packtools.profiling.trained`)."""
    trained = getattr(profile, "trained", None)
    if trained is None:
        return {}
    _, idle = trained.idle_under_bfd(max_length)
    return {
        "trained_kept": trained.kept_by_bfd(max_length) / trained.total if trained.total else 1.0,
        "untrained": idle / kept if kept else 0.0,
    }


FIELDS = tuple(f.name for f in fields(Tradeoff))


# ---------------------------------------------------------------------------------------------------------
# Static shapes: what rounding each batch up to one of K bucket sizes costs
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BucketTradeoff:
    """One candidate number of bucket sizes ``k`` (``None``: no buckets, every batch its own length).

    ``buckets``: the sizes :func:`~packtools.batches.choose_buckets` picks; ``shapes``: distinct batch lengths over the
    epoch (what ``torch.compile(dynamic=False)`` compiles once each); ``padding``: pad tokens / all tokens.
    """

    k: int | None
    buckets: tuple[int, ...]
    shapes: int
    padding: float


@dataclass(frozen=True)
class BucketTable(_Rows[BucketTradeoff]):
    """Rows of :class:`BucketTradeoff` for one ``max_length`` / ``max_tokens`` / strategy."""

    rows: tuple[BucketTradeoff, ...]
    max_length: int
    max_tokens: int
    strategy: str
    batch_tokens: np.ndarray  # tokens in each batch of the epoch the buckets were chosen on

    def _cells(self) -> list[list[str]]:
        return [
            [
                "none" if r.k is None else str(r.k),
                _int(r.shapes),
                _pct(r.padding),
                "-" if r.k is None else ", ".join(_int(b) for b in r.buckets),
            ]
            for r in self.rows
        ]

    def to_text(self) -> str:
        """A fixed-width table with a title line."""
        title = (
            f"{self.strategy} rows of max_length {_int(self.max_length)} in batches of <= {_int(self.max_tokens)} "
            f"tokens ({_int(len(self.batch_tokens))} batches)"
        )
        return title + "\n" + text_table([["K", "shapes", "padding", "bucket sizes"], *self._cells()])

    def to_markdown(self) -> str:
        heads = ["K", "shapes", "padding", "bucket sizes"]
        return _markdown(heads, ["---:", "---:", "---:", "---"], self._cells())
