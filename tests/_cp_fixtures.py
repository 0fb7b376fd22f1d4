"""The rows and the model of the context-parallel tests (test data lives with the tests; benchmarks/cp_loop.py
and cp_dpo_loop.py, the documented recipes these tests run, keep their own demo data)."""

from __future__ import annotations

from typing import Any

#: Packed rows (token ids from a fixed generator): documents shorter than 2·CP, one long document, a row of a
#: single document; two batches (one per DP group with DP = 2).
_SHAPES = [[[3, 40, 1, 9], [23]], [[2, 17, 5, 6], [30]]]
#: Packed pairs (sequence lengths, chosen and rejected in turn): sequences shorter than 2·CP, one long sequence,
#: a row of a single pair; two batches.
_PAIR_SHAPES = [[[3, 2, 30, 9], [12, 14]], [[2, 5, 17, 6], [25, 21]]]


def _rows() -> list[list[dict[str, Any]]]:
    import numpy as np

    rng = np.random.default_rng(7)
    return [
        [
            {"input_ids": rng.integers(2, 97, sum(lengths)).tolist(), "seq_lengths": lengths}
            for lengths in batch
        ]
        for batch in _SHAPES
    ]


def _pair_rows() -> list[list[dict[str, Any]]]:
    import numpy as np

    rng = np.random.default_rng(11)
    out = []
    for batch in _PAIR_SHAPES:
        rows = []
        for lengths in batch:
            ids, mask = [], []
            for i in range(0, len(lengths), 2):
                prompt = int(rng.integers(1, min(lengths[i], lengths[i + 1])))  # a shared prompt, >= 1 token
                prompt_ids = rng.integers(2, 97, prompt).tolist()
                for n in lengths[i : i + 2]:
                    ids += prompt_ids + rng.integers(2, 97, n - prompt).tolist()
                    mask += [0] * prompt + [1] * (n - prompt)
            rows.append({"input_ids": ids, "completion_mask": mask, "seq_lengths": lengths})
        out.append(rows)
    return out


BATCHES = _rows()
PAIR_BATCHES = _pair_rows()


def tiny_llama_fp32(seed: int = 0) -> Any:
    """A 2-layer Llama with grouped-query attention (hidden 64, 4 heads, 2 key/value heads), fp32, sdpa."""
    from _hf_models import tiny_llama

    return tiny_llama("sdpa", seed)
