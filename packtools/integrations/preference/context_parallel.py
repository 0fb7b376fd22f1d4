"""``prepare_dpo_trainer(trainer, context_parallel=N)``: TRL's ``DPOTrainer`` on context-parallel (CP) shards.

Every rank of a CP group gets the same micro-batch; :class:`CPForward` runs only this rank's share of the
padding-free row through TRL's fused LM head, and the shard's per-token outputs are put back at their places
in the row and added over the CP group with an identity backward, so TRL's loss code sees the whole row on
every peer while each peer's gradient flows into its own tokens only.  :func:`check_cp_dpo` refuses, by name,
what this does not handle.  The layout, the loss and what is tested: ``docs/preference.md`` (*Context
parallelism*).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._optional import require
from ...batches.context_parallel import CP_KEY, shard_row
from ...compat.trl import tokenizer_of
from ...constants import VARLEN_KEYS
from ...errors import PackingError
from ..attention.context_parallel import use_cp_attention
from ..parallel.distributed import is_sharded
from ..parallel.layout import RankLayout
from ..parallel.shard_loss import sum_over_group
from .calls import PER_TOKEN

_ROW_KEYS = ("input_ids", "labels", "position_ids", *VARLEN_KEYS)


@dataclass(frozen=True)
class CPForward:
    """Runs this rank's CP shard of a padding-free row through TRL's fused LM head (module docstring)."""

    layout: RankLayout
    pad_token_id: int

    def __call__(self, inner: Any, flat: dict[str, Any], lengths: Any) -> Any:
        """``inner`` (TRL's fused-head forward) on the shard of ``flat`` (the one-row call of the padding-free
        forward, sequences of ``lengths``); the per-token outputs come back as the whole row's, ``[1, T - 1]``
        (output ``i`` scores token ``i + 1``), the same on every rank of the CP group."""
        torch = require("torch", "packtools context parallelism")
        ids, labels = flat["input_ids"][0], flat["labels"][0]
        device, tokens = ids.device, int(ids.shape[0])
        self._check_same_row(ids)
        batch = shard_row(
            ids.cpu().numpy(),
            labels.cpu().numpy(),
            lengths.cpu().numpy(),
            self.layout.cp_size,
            self.layout.cp_rank,
            self.pad_token_id,
            balance=self.layout.balance,  # the layout's choice (packtools_cp reads it from the shard)
            bound=self.layout,
        )
        shard = batch[CP_KEY]
        rest = {k: v for k, v in flat.items() if k not in _ROW_KEYS}
        out = inner(
            fused_lm_head=True,
            input_ids=torch.from_numpy(batch["input_ids"]).to(device),
            position_ids=torch.from_numpy(batch["position_ids"]).to(device),
            shift_labels=torch.from_numpy(batch["shift_labels"]).to(device),
            **{CP_KEY: shard},
            **rest,
        )
        source = torch.from_numpy(shard.layout.source(self.layout.cp_rank)).to(device)
        real = source >= 0
        for name in PER_TOKEN:
            value = getattr(out, name, None)
            if value is None:
                continue
            if tuple(value.shape) != (1, shard.layout.local_tokens):
                raise PackingError(
                    f"the model's {name} has shape {tuple(value.shape)} for a CP shard of "
                    f"{shard.layout.local_tokens} tokens; context_parallel needs one value per shard token.",
                    param="context_parallel",
                )
            whole = value.new_zeros((1, tokens))
            whole[0, source[real]] = value[0, real]
            out[name] = self._sum(whole)[:, :-1]
        return out

    def _check_same_row(self, ids: Any) -> None:
        """Refuse, on every rank of the CP group at once, a call whose row differs between the ranks (an
        evaluation or precompute loader sharding over every process, a user's own loop): ``packtools_cp``
        would attend across their shards as if they were one row's."""
        torch = require("torch", "packtools context parallelism")
        if self.layout.cp_size == 1:
            return
        weights = torch.arange(1, ids.shape[0] + 1, device=ids.device, dtype=torch.int64)
        mine = torch.stack([torch.tensor(ids.shape[0], device=ids.device), (ids.long() * weights).sum()])
        every = [torch.empty_like(mine) for _ in range(self.layout.cp_size)]
        torch.distributed.all_gather(every, mine, group=self.layout.cp_group)
        if any(not torch.equal(other, mine) for other in every):
            raise PackingError(
                f"the {self.layout.cp_size} ranks of a CP group called the model on different rows (token counts "
                f"{[int(e[0]) for e in every]}); under context_parallel every rank of the group must run the same "
                f"batch, its share of it. Evaluation and precomputed reference log-probs are not run under "
                f"context_parallel: run them without it.",
                param="context_parallel",
            )

    def _sum(self, whole: Any) -> Any:
        torch = require("torch", "packtools context parallelism")
        if whole.is_floating_point():
            return sum_over_group(whole, self.layout.cp_group)
        counts = whole.long()
        if self.layout.cp_size > 1:
            torch.distributed.all_reduce(counts, group=self.layout.cp_group)
        return counts.to(whole.dtype)


def check_cp_dpo(trainer: Any, layout: RankLayout, shared: bool) -> None:
    """Refuse, by name, what packtools' DPO under CP does not handle."""
    refusals = []
    if layout.tp_size > 1:
        refusals.append("tensor parallelism (TP groups would overlap the CP groups)")
    if is_sharded(trainer):
        refusals.append("DeepSpeed or FSDP (not run with packtools' CP; use DDP)")
    if shared:
        refusals.append("prompt-shared rows (share_prompt: the tree attention has no CP shards)")
    if getattr(trainer, "precompute_ref_logps", False):
        refusals.append("precompute_ref_log_probs=True (its loader does not keep CP peers on one batch)")
    strategy = getattr(trainer.args, "eval_strategy", "no")
    if trainer.eval_dataset is not None and getattr(strategy, "value", strategy) != "no":
        refusals.append("evaluation during training (its loader does not keep CP peers on one batch)")
    if getattr(trainer, "aux_loss_enabled", False):
        refusals.append("a MoE router loss (it would be summed per shard, not computed on the row)")
    if refusals:
        raise PackingError(
            f"prepare_dpo_trainer(context_parallel={layout.cp_size}) does not run with "
            f"{'; '.join(refusals)}. Drop it, or train without context_parallel.",
            param="context_parallel",
        )


def prepare_dpo_context_parallel(
    trainer: Any, layout: RankLayout, models: list[Any]
) -> tuple[RankLayout, CPForward]:
    """Create the layout's CP group and switch ``models`` (the policy, and the reference model if any) to
    ``packtools_cp`` attention, recorded on ``trainer``; returns the layout holding its group and the
    :class:`CPForward` the step plan hands to the padding-free forward."""
    layout = layout.with_cp_group()
    for model in models:
        use_cp_attention(model, owner=trainer)
    return layout, CPForward(layout, int(tokenizer_of(trainer).pad_token_id))
