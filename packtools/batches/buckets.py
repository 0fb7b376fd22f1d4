"""Static shapes for compiled training: round each batch's token count up to one of a few bucket sizes.

Padding-free batches have a new total length ``T`` almost every step, and ``torch.compile(dynamic=False)``,
CUDA graphs and XLA compile once per shape.  Rounding ``T`` up to the smallest of ``K`` sizes bounds the
shapes at ``K``; :func:`choose_buckets` picks the ``K`` sizes that cost the least padding on given lengths
(exactly, by dynamic programming over the distinct lengths).

>>> choose_buckets([100, 120, 300, 310, 320], 2)
(120, 320)
>>> bucket_for(301, (120, 320)), round(bucket_padding([100, 120, 300, 310, 320], (120, 320)), 4)
(320, 0.0417)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import PackingError

#: Most distinct candidate sizes :func:`choose_buckets` optimizes over (finer grids are coarsened).
MAX_CANDIDATES = 2048


def check_buckets(buckets: object, name: str = "buckets") -> tuple[int, ...]:
    """Validate explicit bucket sizes: positive ints, returned sorted without duplicates."""
    if (
        isinstance(buckets, (str, bytes))
        or not isinstance(buckets, (Sequence, np.ndarray))
        or not len(buckets)
    ):
        raise PackingError(
            f"{name} must be a non-empty list of positive ints (token counts), got {buckets!r}.",
            param=name,
        )
    out = []
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise PackingError(f"{name} holds {b!r}; every bucket size must be a positive int.", param=name)
        out.append(int(b))
    return tuple(sorted(set(out)))


def choose_buckets(
    lengths: Sequence[int] | np.ndarray, k: int, *, multiple_of: int = 1, top: int | None = None
) -> tuple[int, ...]:
    """At most ``k`` sizes such that rounding every length up to the next size costs the least padding.

    The largest size is ``max(lengths)`` (or ``top``, when given and larger: e.g. a sampler's ``max_tokens``,
    so batches of later epochs fit too).  Sizes are multiples of ``multiple_of``; with more than
    :data:`MAX_CANDIDATES` distinct rounded lengths the grid is coarsened to keep the search fast.

    >>> choose_buckets([5, 6, 7, 20], 2), choose_buckets([5, 6, 7, 20], 2, multiple_of=8, top=32)
    ((7, 20), (8, 32))
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise PackingError(f"k (the number of bucket sizes) must be a positive int, got {k!r}.", param="k")
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, (int, np.integer)) or multiple_of < 1:
        raise PackingError(f"multiple_of must be a positive int, got {multiple_of!r}.", param="multiple_of")
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size == 0 and top is None:
        raise PackingError(
            "lengths is empty; bucket sizes are chosen from at least one length (or give top=).",
            param="lengths",
        )
    if lens.size and lens.min() < 1:
        raise PackingError(f"lengths must be >= 1 token, got {int(lens.min())}.", param="lengths")
    step = int(multiple_of)
    hi = max(int(lens.max()) if lens.size else 0, int(top or 0))
    while np.unique(-(-lens // step)).shape[0] >= MAX_CANDIDATES:
        step *= 2
    sizes, counts = np.unique(-(-lens // step) * step, return_counts=True)
    top_size = -(-hi // step) * step
    if sizes.size == 0 or sizes[-1] < top_size:  # the top size is always a bucket, even with no length there
        sizes, counts = np.append(sizes, top_size), np.append(counts, 0)
    return tuple(int(x) for x in _optimal_buckets(sizes, counts, int(k)))


def _optimal_buckets(sizes: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """Exact DP: ``cost[j]`` = least padding covering sizes ``0..j`` with buckets ending at ``sizes[j]``."""
    n = sizes.shape[0]
    if k >= n:
        return sizes
    w = counts.astype(np.float64)
    v = sizes.astype(np.float64)
    cw = np.concatenate(([0.0], np.cumsum(w)))
    cs = np.concatenate(([0.0], np.cumsum(w * v)))
    i = np.arange(n)[:, None]  # first size a bucket covers
    j = np.arange(n)[None, :]  # the bucket (the largest size it covers)
    # Padding when sizes i..j all round up to sizes[j]; +inf where i > j.
    span = np.where(i <= j, v[None, :] * (cw[j + 1] - cw[i]) - (cs[j + 1] - cs[i]), np.inf)
    cost = span[0].copy()  # one bucket
    choice = [np.zeros(n, np.int64)]
    for _ in range(1, k):
        prev = np.concatenate(([0.0], cost[:-1]))  # best cost of sizes 0..i-1 (0 for none)
        total = prev[:, None] + span
        best = np.argmin(total, axis=0)
        cost = total[best, np.arange(n)]
        choice.append(best)
    picked, j = [], n - 1
    for layer in range(k - 1, -1, -1):
        picked.append(sizes[j])
        i0 = int(choice[layer][j])
        if i0 == 0:
            break
        j = i0 - 1
    return np.array(sorted(picked), np.int64)


def bucket_for(total: int, buckets: Sequence[int]) -> int:
    """The smallest bucket size >= ``total``; a :class:`PackingError` if none is."""
    i = int(np.searchsorted(np.asarray(buckets), total, side="left"))
    if i == len(buckets):
        raise PackingError(
            f"the batch holds {total} tokens, more than the largest bucket ({buckets[-1]}); add a bucket of at "
            f"least {total} tokens, or keep batches smaller (TokenBudgetBatchSampler(max_tokens=...) with "
            f"buckets=K makes max_tokens the largest bucket).",
            param="pad_to_buckets",
        )
    return int(buckets[i])


def bucket_padding(lengths: Sequence[int] | np.ndarray, buckets: Sequence[int]) -> float:
    """Padding share when each length is rounded up to its bucket: pad tokens / all tokens after padding."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lens.size == 0:
        return 0.0
    sizes = np.asarray(check_buckets(buckets), np.int64)
    where = np.searchsorted(sizes, lens, side="left")
    if where.max() == sizes.shape[0]:
        bucket_for(int(lens.max()), tuple(sizes.tolist()))  # raises, naming the length
    padded = int(sizes[where].sum())
    return 1.0 - int(lens.sum()) / padded


def pad_cu_seq_lens(cu: np.ndarray, size: int) -> np.ndarray:
    """``cu_seq_lens`` with its last value repeated up to ``size`` entries (empty trailing segments).

    >>> pad_cu_seq_lens(np.array([0, 3, 8], np.int32), 5).tolist()
    [0, 3, 8, 8, 8]
    """
    if cu.shape[0] > size:
        raise PackingError(
            f"the batch has {cu.shape[0] - 1} segments (padding included), more than pad_cu_seq_lens_to={size} "
            f"allows ({size - 1}); raise pad_cu_seq_lens_to to at least {cu.shape[0]}, or make batches smaller.",
            param="pad_cu_seq_lens_to",
        )
    out = np.full(size, cu[-1], np.int32)
    out[: cu.shape[0]] = cu
    return out
