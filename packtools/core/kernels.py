"""Numba kernels: plain, C-contiguous NumPy arrays in and out.

Everything here is compiled lazily on first call and cached on disk (``cache=True``); importing this module
compiles nothing.  The Python wrappers in :mod:`packtools.core.plan` and :mod:`packtools.core.pack` validate and
cast inputs once, so these functions trust their arguments.  They also run unchanged under
``NUMBA_DISABLE_JIT=1``, which the test suite uses to check their Python semantics.
"""

from __future__ import annotations

import numpy as np

from .._interrupts import held, hold_while_numba_compiles

# a Ctrl-C or SIGTERM while the main thread imports Numba, or loads or compiles a kernel, is delivered once that
# is done: delivered inside, it can be dropped by llvmlite or leave a lock held (packtools._interrupts)
with held():
    from numba import njit
hold_while_numba_compiles()


@njit(cache=True)
def make_items(lengths, max_length, split):
    """Turn sequence lengths into packable items ``(source, start, length)``.

    Empty sequences produce no item.  With ``split`` a sequence longer than ``max_length`` becomes the chunks
    ``[0:L], [L:2L], ...``; without it, it becomes one item holding its first ``max_length`` tokens.
    """
    n = lengths.shape[0]
    count = 0
    for i in range(n):
        length = lengths[i]
        if length > 0:
            if split:
                count += (length + max_length - 1) // max_length
            else:
                count += 1
    source = np.empty(count, np.int64)
    start = np.empty(count, np.int64)
    size = np.empty(count, np.int64)
    k = 0
    for i in range(n):
        length = lengths[i]
        if length <= 0:
            continue
        if split:
            offset = 0
            while offset < length:
                source[k] = i
                start[k] = offset
                size[k] = min(max_length, length - offset)
                offset += max_length
                k += 1
        else:
            source[k] = i
            start[k] = 0
            size[k] = min(max_length, length)
            k += 1
    return source, start, size


@njit(cache=True)
def _tree_set(tree, leaves, space, value):
    node = leaves + space
    tree[node] = value
    node //= 2
    while node >= 1:
        left = tree[2 * node]
        right = tree[2 * node + 1]
        tree[node] = left if left >= right else right
        node //= 2


@njit(cache=True)
def bucket_order(keys, num_keys):
    """The stable counting sort: ``(order, offsets)`` with the indices of ``keys`` (integers in
    ``[0, num_keys)``) grouped by key, ascending, in input order within a key, and the start of each key's
    group in ``order`` (``num_keys + 1`` values)."""
    offsets = np.zeros(num_keys + 1, np.int64)
    for i in range(keys.shape[0]):
        offsets[keys[i] + 1] += 1
    for k in range(num_keys):
        offsets[k + 1] += offsets[k]
    fill = offsets[:-1].copy()
    order = np.empty(keys.shape[0], np.int64)
    for i in range(keys.shape[0]):
        key = keys[i]
        order[fill[key]] = i
        fill[key] += 1
    return order, offsets


@njit(cache=True)
def bfd_assign(sizes, max_length):
    """Best-fit decreasing over item sizes in ``[1, max_length]``.

    Items are taken longest first, ties in input order (a stable counting sort).  Each goes to the open bin
    with the smallest remaining space that still fits it, found in O(log L) with a max segment tree indexed
    by remaining space; among bins with the same remaining space, the one that reached it first.  Bins are
    numbered in creation order.

    Returns ``(item_order, row_offsets)``: the item indices grouped by bin, in placement order inside a bin,
    and the start of each bin in ``item_order`` (``num_bins + 1`` values).
    """
    n = sizes.shape[0]
    # Longest first, ties in input order: the stable counting sort on ``max_length - size``.
    order, _ = bucket_order(max_length - sizes, max_length)

    # Segment tree over remaining space 0..max_length; a leaf holds its space if some bin has it, else 0.
    leaves = 1
    while leaves < max_length + 1:
        leaves *= 2
    tree = np.zeros(2 * leaves, np.int64)
    _tree_set(tree, leaves, max_length, max_length)  # a fresh bin is always available
    # FIFO queue of bins per remaining space, as linked lists.
    head = np.full(max_length + 1, -1, np.int64)
    tail = np.full(max_length + 1, -1, np.int64)
    next_bin = np.full(max(n, 1), -1, np.int64)
    # Work on sizes in sorted order: sequential reads instead of scattered ones.
    sorted_sizes = sizes[order]
    placed_bin = np.empty(n, np.int64)  # bin of the k-th placed item
    num_bins = 0
    for k in range(n):
        size = sorted_sizes[k]
        # Leftmost leaf whose value is >= size: the smallest remaining space that fits.
        node = 1
        while node < leaves:
            if tree[2 * node] >= size:
                node = 2 * node
            else:
                node = 2 * node + 1
        space = node - leaves
        if space == max_length:
            b = num_bins
            num_bins += 1
        else:
            b = head[space]
            head[space] = next_bin[b]
            if head[space] == -1:
                tail[space] = -1
                _tree_set(tree, leaves, space, 0)
        placed_bin[k] = b
        space -= size
        if space > 0:
            next_bin[b] = -1
            if tail[space] == -1:
                head[space] = b
                _tree_set(tree, leaves, space, space)
            else:
                next_bin[tail[space]] = b
            tail[space] = b

    # Group items by bin (stable on placement order).
    by_bin, row_offsets = bucket_order(placed_bin, num_bins)
    return order[by_bin], row_offsets


@njit(cache=True)
def wrapped_segments(lengths, max_length):
    """Concatenate all sequences in order and cut every ``max_length`` tokens.

    Returns ``(source, start, size, row_offsets)``: the pieces of sequences that make up each row, in order.
    """
    n = lengths.shape[0]
    pieces = 0
    # A sequence of length l starting at stream position p spans the rows p // L ... (p + l - 1) // L.
    position = 0
    for i in range(n):
        length = lengths[i]
        if length > 0:
            pieces += (position + length - 1) // max_length - position // max_length + 1
            position += length
    num_rows = (position + max_length - 1) // max_length  # position: every token of the stream
    source = np.empty(pieces, np.int64)
    start = np.empty(pieces, np.int64)
    size = np.empty(pieces, np.int64)
    row_offsets = np.zeros(num_rows + 1, np.int64)
    k = 0
    position = 0
    for i in range(n):
        length = lengths[i]
        offset = 0
        while offset < length:
            row = position // max_length
            room = (row + 1) * max_length - position
            take = min(room, length - offset)
            source[k] = i
            start[k] = offset
            size[k] = take
            row_offsets[row + 1] = k + 1
            k += 1
            offset += take
            position += take
    return source, start, size, row_offsets


@njit(cache=True, nogil=True)
def copy_all_segments(values, src_start, size, dst_start, out):
    """``out[dst:dst+size] = values[src:src+size]`` for every segment (without the GIL: a shard is written
    while the next one is gathered)."""
    for s in range(src_start.shape[0]):
        a = src_start[s]
        d = dst_start[s]
        m = size[s]
        out[d : d + m] = values[a : a + m]


@njit(cache=True)
def view_segments(
    rows,
    row_offsets,
    seg_source,
    seg_start,
    seg_length,
    mapped,
    indices,
    row_begin,
    chunk_starts,
    chunk_base,
    chunk_source,
    num_sources,
):
    """Where the segments of packed ``rows`` (of a plan) lie in a column's source buffers, for one batch.

    Segment ``k`` of the batch (row order) comes from table row ``t = indices[seg_source[s]]`` (or
    ``seg_source[s]`` when not ``mapped``), found in chunk ``c`` (``chunk_starts[c] <= t < chunk_starts[c + 1]``),
    at element ``chunk_base[c] + row_begin[t] + seg_start[s]`` of source ``chunk_source[c]``.  Returns
    ``(begin, size, dest, bounds)`` sorted by source, then by begin (reads front to back), with the segments
    of source ``j`` at ``bounds[j]:bounds[j + 1]``; ``dest`` is each segment's place in the batch.  The fifth
    array is the segments' lengths in row order.
    """
    n = 0
    for i in range(rows.shape[0]):
        n += row_offsets[rows[i] + 1] - row_offsets[rows[i]]
    begin = np.empty(n, np.int64)
    size = np.empty(n, np.int64)
    dest = np.empty(n, np.int64)
    source = np.empty(n, np.int64)
    k = 0
    at = 0
    for i in range(rows.shape[0]):
        for s in range(row_offsets[rows[i]], row_offsets[rows[i] + 1]):
            t = indices[seg_source[s]] if mapped else seg_source[s]
            c = np.searchsorted(chunk_starts, t, side="right") - 1
            begin[k] = chunk_base[c] + row_begin[t] + seg_start[s]
            size[k] = seg_length[s]
            dest[k] = at
            source[k] = chunk_source[c]
            at += seg_length[s]
            k += 1
    order = np.argsort(begin, kind="mergesort")
    by_source, bounds = bucket_order(source[order], num_sources)
    order = order[by_source]  # by source, then by begin
    return begin[order], size[order], dest[order], bounds, size


@njit(cache=True)
def gather_scattered(values, src_start, size, dst_start, out):
    """``copy_all_segments`` for segments scattered over a large buffer (a packed view's source file).

    A first pass reads one value per 1024 of every segment, so the cache and TLB misses of all segments
    overlap instead of stalling the copy one segment at a time; then the segments are copied.  Returns how many
    values read in the first pass are non-zero (so the reads are not elided).
    """
    acc = 0
    for s in range(src_start.shape[0]):
        a = src_start[s]
        end = a + size[s]
        k = a
        while k < end:
            acc += values[k] != 0
            k += 1024
        acc += values[end - 1] != 0
    copy_all_segments(values, src_start, size, dst_start, out)
    return acc


@njit(cache=True)
def plan_violation(seg_source, seg_start, seg_length, row_offsets, source_lengths, max_length):
    """First broken invariant of a packing plan as ``(code, index)``; ``(0, -1)`` when the plan is sound.

    Codes: 1 ``row_offsets`` not 0..num_segments and non-decreasing (index: row); 2 an empty or negative
    segment; 3 a source out of range; 4 a segment outside its sequence; 5 a row longer than ``max_length``
    (index: row); 6 a segment overlapping another segment of the same sequence (index: the later one).
    """
    n_seg = seg_length.shape[0]
    n_src = source_lengths.shape[0]
    n_rows = row_offsets.shape[0] - 1
    if n_rows < 0 or row_offsets[0] != 0 or row_offsets[n_rows] != n_seg:
        return 1, 0
    for r in range(n_rows):
        if row_offsets[r + 1] < row_offsets[r]:
            return 1, r
    for s in range(n_seg):
        if seg_length[s] < 1:
            return 2, s
        if seg_source[s] < 0 or seg_source[s] >= n_src:
            return 3, s
        if seg_start[s] < 0 or seg_start[s] + seg_length[s] > source_lengths[seg_source[s]]:
            return 4, s
    for r in range(n_rows):
        total = 0
        for s in range(row_offsets[r], row_offsets[r + 1]):
            total += seg_length[s]
        if total > max_length:
            return 5, r
    # Overlap: bucket segments by source (counting sort), then sort each bucket by start.
    order, counts = bucket_order(seg_source, n_src)
    for i in range(n_src):
        lo = counts[i]
        hi = counts[i + 1]
        if hi - lo > 1:
            group = order[lo:hi].copy()
            order[lo:hi] = group[np.argsort(seg_start[group], kind="mergesort")]
        for a in range(lo + 1, hi):
            prev = order[a - 1]
            if seg_start[prev] + seg_length[prev] > seg_start[order[a]]:
                return 6, order[a]
    return 0, -1


@njit(cache=True)
def balance_pairs(pair_work, row_starts):
    """The CP rank holding each head-tail chunk pair of each document (``out[d, k]``), for a ``[documents, N]``
    array of the pairs' causal work: row by row (documents ``row_starts[i]:row_starts[i + 1]``), document after
    document, the busiest rank so far takes the lightest pair, the next busiest the next lightest (ties: the lower
    rank, the lower pair), so a row of documents without padding keeps pair ``k`` on rank ``k`` throughout."""
    docs, n = pair_work.shape
    out = np.empty((docs, n), np.int64)
    load = np.zeros(n, np.int64)
    for r in range(row_starts.size - 1):
        load[:] = 0
        for d in range(row_starts[r], row_starts[r + 1]):
            ranks = np.argsort(-load, kind="mergesort")
            pairs = np.argsort(pair_work[d], kind="mergesort")
            for j in range(n):
                out[d, pairs[j]] = ranks[j]
                load[ranks[j]] += pair_work[d, pairs[j]]
    return out


@njit(cache=True, nogil=True)
def _skip_blanks(data, pos):
    """The first position at or after ``pos`` that is not a space, tab or carriage return."""
    n = data.size
    while pos < n and (data[pos] == 32 or data[pos] == 9 or data[pos] == 13):
        pos += 1
    return pos


@njit(cache=True, nogil=True)
def int_list_lines(data, key_bytes, key_starts, offsets, values, fill):
    """Read JSON lines that are each one object of the same keys, in the same order, every value a list of
    integers (``{"input_ids": [1, 2], "labels": [-100, 2]}``), from the bytes ``data``; the number of lines,
    or -1 at the first byte that does not fit that shape exactly (a blank line, other keys or key order, a
    float, a number of more than 18 digits, a leading zero, ``null``, a non-ASCII byte, ...; the caller then
    reads the block with a full JSON reader, which also names any error).

    ``key_bytes[key_starts[c]:key_starts[c + 1]]`` is key ``c`` (ASCII, no quote or backslash).  First pass
    (``fill`` False): ``offsets`` is ``[keys, 1]`` of zeros and gets each key's count of values.  Second pass
    (``fill`` True): ``offsets`` is ``[keys, lines + 1]`` with ``offsets[c, 0]`` the key's first position in
    ``values``, and gets every line's end; ``values`` (int64) gets the numbers."""
    n = data.size
    keys = key_starts.size - 1
    pos = 0
    row = 0
    while True:
        pos = _skip_blanks(data, pos)
        if pos >= n:
            return row
        if data[pos] != 123:  # '{' (a blank line, or anything else, is left to the full reader)
            return -1
        pos += 1
        for c in range(keys):
            pos = _skip_blanks(data, pos)
            if c > 0:
                if pos >= n or data[pos] != 44:  # ','
                    return -1
                pos = _skip_blanks(data, pos + 1)
            if pos >= n or data[pos] != 34:  # '"'
                return -1
            pos += 1
            k0 = key_starts[c]
            klen = key_starts[c + 1] - k0
            if pos + klen >= n:
                return -1
            for j in range(klen):
                if data[pos + j] != key_bytes[k0 + j]:
                    return -1
            pos += klen
            if data[pos] != 34:
                return -1
            pos = _skip_blanks(data, pos + 1)
            if pos >= n or data[pos] != 58:  # ':'
                return -1
            pos = _skip_blanks(data, pos + 1)
            if pos >= n or data[pos] != 91:  # '['
                return -1
            pos = _skip_blanks(data, pos + 1)
            count = 0
            if pos < n and data[pos] == 93:  # ']': an empty list
                pos += 1
            else:
                while True:
                    negative = False
                    if pos < n and data[pos] == 45:  # '-'
                        negative = True
                        pos += 1
                    if pos >= n or data[pos] < 48 or data[pos] > 57:
                        return -1
                    value = 0
                    if data[pos] == 48:  # '0' is a whole number: JSON has no leading zeros
                        pos += 1
                        if pos < n and 48 <= data[pos] <= 57:
                            return -1
                    else:
                        digits = 0
                        while pos < n and 48 <= data[pos] <= 57:
                            value = value * 10 + (data[pos] - 48)
                            pos += 1
                            digits += 1
                        if digits > 18:
                            return -1
                    if pos < n and (data[pos] == 46 or data[pos] == 101 or data[pos] == 69):  # . e E
                        return -1
                    if fill:
                        values[offsets[c, row] + count] = -value if negative else value
                    count += 1
                    pos = _skip_blanks(data, pos)
                    if pos >= n:
                        return -1
                    if data[pos] == 44:
                        pos = _skip_blanks(data, pos + 1)
                        continue
                    if data[pos] == 93:
                        pos += 1
                        break
                    return -1
            if fill:
                offsets[c, row + 1] = offsets[c, row] + count
            else:
                offsets[c, 0] += count
        pos = _skip_blanks(data, pos)
        if pos >= n or data[pos] != 125:  # '}'
            return -1
        pos = _skip_blanks(data, pos + 1)
        row += 1
        if pos < n:
            if data[pos] != 10:
                return -1
            pos += 1
