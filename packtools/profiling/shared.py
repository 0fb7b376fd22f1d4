"""How many tokens sharing the prompt saves on a preference or group dataset (``P`` vs ``G x P`` per unit).

A figure for the profiler, beside its padding and packing ones: the tokens of the unshared layout
(``G * P + sum(C)`` per unit, ``2P + C + R`` per pair), of the prompt-shared one (``P + sum(C) + G - 1``:
:mod:`packtools.core.shared_pairs`) and the share saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from ..compat.datasets import dataset_table
from ..core.arrow import column_lengths
from ..core.shared_groups import refuse_empty_groups
from ..core.shared_pairs import unit_lengths
from ..errors import PackingError


@dataclass(frozen=True)
class SharedSavings:
    units: int  # pairs or groups
    completions: int
    tokens_unshared: int
    tokens_shared: int

    @property
    def saved(self) -> float:
        return 1.0 - self.tokens_shared / self.tokens_unshared if self.tokens_unshared else 0.0


def shared_prompt_savings(dataset: Any) -> SharedSavings:
    """Token counts with and without sharing the prompt, from ``prompt_ids`` and ``chosen_ids`` /
    ``rejected_ids`` (pairs) or ``completion_ids`` (groups: a list of token lists per row).

    >>> t = pa.table({"prompt_ids": [[1] * 10], "chosen_ids": [[2] * 3], "rejected_ids": [[3] * 2]})
    >>> s = shared_prompt_savings(t)
    >>> s.tokens_unshared, s.tokens_shared, round(s.saved, 3)
    (25, 16, 0.36)
    """
    table, indices = (dataset, None) if isinstance(dataset, pa.Table) else dataset_table(dataset)
    names = table.column_names
    if "prompt_ids" not in names:
        raise PackingError(
            f"prompt sharing needs a prompt_ids column; the table has {names}.", param="dataset"
        )
    lp = column_lengths(table.column("prompt_ids"))
    if "completion_ids" in names:
        nested = table.column("completion_ids").combine_chunks()
        offsets = np.asarray(nested.offsets, np.int64) - nested.offsets[0].as_py()
        g = np.diff(offsets)
        tokens = np.concatenate(([0], np.cumsum(column_lengths(nested.flatten()))))
        sums = tokens[offsets[1:]] - tokens[offsets[:-1]]
    elif "chosen_ids" in names and "rejected_ids" in names:
        g = np.full(lp.shape[0], 2, np.int64)
        sums = column_lengths(table.column("chosen_ids")) + column_lengths(table.column("rejected_ids"))
    else:
        raise PackingError(
            f"prompt sharing needs chosen_ids and rejected_ids (pairs) or completion_ids (groups); the table "
            f"has {names}.",
            param="dataset",
        )
    if indices is not None:
        lp, g, sums = lp[indices], g[indices], sums[indices]
    refuse_empty_groups(g)  # as pack_groups: no unit to share a prompt in
    return SharedSavings(
        units=int(lp.shape[0]),
        completions=int(g.sum()),
        tokens_unshared=int((g * lp + sums).sum()),
        tokens_shared=int(unit_lengths(lp, sums, g).sum()),
    )
