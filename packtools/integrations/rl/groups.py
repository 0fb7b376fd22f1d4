"""Whole GRPO/RLOO groups per rank, with the ranks' prompt tokens balanced, through TRL's own sampler.

TRL 1.16's ``RepeatSampler`` yields each generation batch (``generation_batch_size`` indices, the same on every
rank) as ``generation_batch_size / G`` prompts, each ``G = num_generations`` times in a row; accelerate hands rank
``r`` the ``r``-th slice of ``generation_batch_size / ranks`` indices; TRL gathers the rewards of every rank in
rank order and computes the advantages over ``rewards.view(-1, G)``, then keeps its own ``process_slice``.  So a
group stays on one rank exactly when a rank's slice is a multiple of ``G``, and which groups a rank gets is the
order of the prompts in the block.

:class:`GroupBalancedSampler` takes TRL's sampler as it is and, within each generation batch, reorders whole
groups so that the ranks' slices carry nearly equal prompt tokens (:func:`balance_groups`: known before
generation, the one part of a rank's work the sampler can see).  Each rank keeps the same number of sequences
(TRL's gathers need it), every group stays ``G`` consecutive indices inside one slice (TRL's advantage code is
unchanged), and the block holds the same prompts, so the global batch of the step is the one TRL's order gives:
losses that TRL normalizes over the global batch (``grpo``, ``dapo``, ...) step as one process on that batch
does; ``bnpo`` normalizes per rank (TRL's semantics), so it depends on the placement, as it does in TRL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..._optional import require
from ...errors import PackingError


def balance_groups(lengths: np.ndarray, ranks: int) -> np.ndarray:
    """The order of one generation batch's groups, rank 0's first: ``len(lengths) / ranks`` groups per rank.

    Longest group first, each to the rank with the fewest prompt tokens that still has room (ties: the lower
    rank); then swaps of one group between the busiest and the idlest rank while they lower the busier of the
    two.  TRL's order (``0, 1, ...``) is kept when it is no busier; a rank's groups keep their order in the batch.

    >>> balance_groups(np.array([9, 8, 1, 2]), 2).tolist()  # TRL's order puts 17 tokens on rank 0, 3 on rank 1
    [0, 2, 1, 3]
    """
    lengths = np.asarray(lengths, np.int64)
    n = lengths.shape[0]
    if ranks < 1 or n % ranks:
        raise PackingError(f"{n} groups cannot be split evenly over {ranks} ranks.")
    room = np.full(ranks, n // ranks)
    load = np.zeros(ranks, np.int64)
    rank_of = np.empty(n, np.int64)
    for g in np.argsort(-lengths, kind="stable"):
        open_ranks = np.flatnonzero(room > 0)
        r = open_ranks[np.argmin(load[open_ranks])]
        rank_of[g], load[r], room[r] = r, load[r] + lengths[g], room[r] - 1
    for _ in range(n * n):  # bounded; each swap lowers the pair's maximum, so it ends well before
        busy, idle = int(np.argmax(load)), int(np.argmin(load))
        a, b = np.flatnonzero(rank_of == busy), np.flatnonzero(rank_of == idle)
        moved = lengths[a][:, None] - lengths[b][None, :]  # tokens leaving the busy rank per swap
        after = np.maximum(load[busy] - moved, load[idle] + moved)
        i, j = np.unravel_index(np.argmin(after), after.shape)
        if after[i, j] >= load[busy]:
            break
        rank_of[a[i]], rank_of[b[j]] = idle, busy
        load[busy], load[idle] = load[busy] - moved[i, j], load[idle] + moved[i, j]
    if load.max() >= rank_loads(lengths, np.arange(n), ranks).max():
        return np.arange(n)
    return np.lexsort((np.arange(n), rank_of))


def rank_loads(lengths: np.ndarray, order: np.ndarray, ranks: int) -> np.ndarray:
    """Prompt tokens per rank when the groups of one generation batch are laid out in ``order``.

    >>> lengths = np.array([9, 8, 1, 2])
    >>> rank_loads(lengths, np.arange(4), 2).tolist(), rank_loads(lengths, balance_groups(lengths, 2), 2).tolist()
    ([17, 3], [10, 10])
    """
    return np.asarray(lengths, np.int64)[np.asarray(order)].reshape(ranks, -1).sum(1)


class GroupBalancedSampler:
    """TRL's sampler, each generation batch's groups reordered by :func:`balance_groups` (see the module).

    ``prompt_tokens(index)`` gives a dataset row's prompt length in tokens.  Raises :class:`PackingError` when
    the sampler's stream is not whole groups of ``group`` equal indices in blocks of ``block`` indices (a
    sampler other than TRL's ``RepeatSampler``).
    """

    def __init__(
        self, inner: Any, *, group: int, block: int, ranks: int, prompt_tokens: Callable[[int], int]
    ) -> None:
        if block % (group * ranks):
            raise PackingError(
                f"generation batch of {block} sequences over {ranks} ranks: a rank's {block // ranks} is not a "
                f"multiple of num_generations={group}, so a group would span ranks.",
                param="balance_groups",
            )
        self.inner, self.group, self.block, self.ranks = inner, group, block, ranks
        self.prompt_tokens = prompt_tokens

    def __len__(self) -> int:
        return len(self.inner)

    def _groups(self, indices: list[int]) -> np.ndarray:
        runs = np.asarray(indices, np.int64).reshape(-1, self.group)
        if len(indices) != self.block or not (runs == runs[:, :1]).all():
            raise PackingError(
                f"the train sampler yielded {len(indices)} indices where a generation batch of {self.block} "
                f"(groups of num_generations={self.group} equal indices) was expected; packtools balances TRL's "
                f"RepeatSampler only. Use prepare_grpo_trainer(..., balance_groups=False).",
                param="balance_groups",
            )
        return runs[:, 0]

    def __iter__(self) -> Iterator[int]:
        stream = iter(self.inner)
        while True:
            indices = [i for _, i in zip(range(self.block), stream)]
            if not indices:
                return
            firsts = self._groups(indices)
            lengths = np.array([self.prompt_tokens(int(i)) for i in firsts], np.int64)
            for i in firsts[balance_groups(lengths, self.ranks)]:
                yield from [int(i)] * self.group


def prompt_token_counter(trainer: Any, dataset: Any) -> Callable[[int], int]:
    """``index -> prompt tokens`` as TRL 1.16 tokenizes a prompt for generation (its chat template with the
    generation prompt for conversational rows, the processing class on text otherwise); cached per index."""
    cache: dict[int, int] = {}
    tok = trainer.processing_class

    def count(index: int) -> int:
        if index not in cache:
            prompt = dataset[index]["prompt"]
            if isinstance(prompt, list):  # conversational
                ids = tok.apply_chat_template(
                    conversation=[prompt],
                    tools=getattr(trainer, "tools", None) or None,
                    chat_template=getattr(trainer, "chat_template", None),
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                    **(getattr(trainer, "chat_template_kwargs", None) or {}),
                )["input_ids"][0]
            else:
                ids = tok(text=[prompt])["input_ids"][0]
            cache[index] = len(ids)
        return cache[index]

    return count


def choose_balance(trainer: Any, balance_groups: bool | str) -> tuple[bool, str]:
    """``(balance, reason)``, decided once: whether the train sampler reorders groups across ranks.

    ``"auto"`` balances under data parallelism when TRL's sampler can keep whole groups per rank (a map-style
    dataset; a rank's share of the generation batch a multiple of ``num_generations``), else keeps TRL's order
    (the reason says why); ``True`` balances or raises that reason by name; ``False`` keeps TRL's order."""
    if not (isinstance(balance_groups, bool) or balance_groups == "auto"):
        raise PackingError(
            f"balance_groups={balance_groups!r}: expected True, False or 'auto'.", param="balance_groups"
        )
    if balance_groups is False:
        return False, "balance_groups=False (asked): TRL's sampler order"
    ranks = int(trainer.accelerator.num_processes)
    if ranks == 1:
        return False, "one process: nothing to balance"
    per_rank, group = int(trainer.args.generation_batch_size) // ranks, int(trainer.num_generations)
    refusal = None
    dataset = trainer.train_dataset
    iterable = require("torch", "packtools.prepare_grpo_trainer").utils.data.IterableDataset
    # Trainer asks no sampler of a torch IterableDataset (one with a length and __getitem__ included)
    if (
        dataset is None
        or isinstance(dataset, iterable)
        or not hasattr(dataset, "__getitem__")
        or not hasattr(dataset, "__len__")
    ):
        refusal = "the train dataset is iterable (TRL orders it without a sampler)"
    elif per_rank % group:
        refusal = (
            f"a rank's share of the generation batch ({per_rank} sequences) is not a multiple of "
            f"num_generations={group}, so TRL's sampler cuts groups across ranks (exact, as TRL computes it); "
            f"make per_device_train_batch_size * steps_per_generation a multiple of num_generations"
        )
    if refusal is not None:
        if balance_groups is True:
            raise PackingError(f"balance_groups=True: {refusal}.", param="balance_groups")
        return False, f"TRL's sampler order: {refusal}"
    return True, (
        f"whole groups per rank, each generation batch's prompt tokens balanced over {ranks} ranks "
        f"(balance_groups={balance_groups!r})"
    )
