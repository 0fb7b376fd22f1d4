"""The assistant-token mask (packtools.pipeline.tokenizer.chat.labels.overlap_mask) equals transformers' rule written out
plainly: a token is marked when it overlaps one of the sorted, disjoint spans."""

from __future__ import annotations

import numpy as np

from packtools.pipeline.tokenizer.chat.labels import overlap_mask


def plain_mask(starts, ends, lo, hi):
    return np.array([any(s < b and e > a for a, b in zip(lo, hi)) for s, e in zip(starts, ends)], bool)


def test_overlap_mask_equals_the_plain_rule():
    rng = np.random.default_rng(0)
    for trial in range(400):
        n = int(rng.integers(0, 40))
        lengths = rng.integers(0, 4, n)  # empty tokens too (a special token's zero-width offsets)
        starts = (
            np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
        )
        ends = starts + lengths
        if trial % 4 == 3 and n > 1:  # tokens out of order (offsets as a reference might give them)
            order = rng.permutation(n)
            starts, ends = starts[order], ends[order]
        room = int(lengths.sum()) + 3
        spans = min(int(rng.integers(0, 5)), room // 2)
        cuts = np.sort(rng.choice(np.arange(room), size=2 * spans, replace=False))
        lo, hi = cuts[0::2].astype(np.int64), cuts[1::2].astype(np.int64)
        got = overlap_mask(starts, ends, lo, hi)
        assert got.dtype == bool and got.tolist() == plain_mask(starts, ends, lo, hi).tolist(), (
            starts,
            ends,
            lo,
            hi,
        )
