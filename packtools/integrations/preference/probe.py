"""The isolation probe of the DPO path, run through the forward that training really calls.

:func:`packtools.integrations.check_isolation` checks a batch built by ``PaddingFreeCollator``; ``DPOTrainer`` under
:func:`packtools.prepare_dpo_trainer` sends TRL's padded batch through packtools' padding-free forward instead,
so :func:`check_padding_free_forward` probes that forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._optional import require
from ...errors import PackingError
from ..attention.backends import attention_implementation
from ..attention.backends import base_model as _base_model
from ..attention.isolation import TOLERANCE, autocast_inside, compute_dtype


def check_padding_free_forward(
    model: Any,
    lengths: Sequence[int] = (5, 9, 3, 7),
    seed: int = 0,
    atol: float | None = None,
    *,
    trainer: str = "DPO",
) -> float:
    """Largest log-prob difference between the sequences run together and alone; raises on a leak, naming the
    ``trainer`` whose forward it is (``"DPO"``, ``"KTO"``) and its prepare function.

    ``model`` must carry packtools' padding-free forward
    (:func:`~packtools.integrations.preference.dpo.install_padding_free_forward`).  Runs under ``no_grad`` in eval mode
    and restores the mode.

    >>> import torch
    >>> from trl.trainer.utils import add_fused_lm_head
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from packtools.integrations.preference.dpo import install_padding_free_forward
    >>> _ = torch.manual_seed(0)
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa"))
    >>> add_fused_lm_head(model)
    >>> install_padding_free_forward(model)
    >>> check_padding_free_forward(model) < 1e-5
    True
    """
    torch = require("torch", "packtools.prepare_dpo_trainer")
    base = _base_model(model)
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    param = next(base.parameters())
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, int(config.vocab_size), (n,), generator=gen)
        mask[i, :n] = 1
    ids, mask = ids.to(param.device), mask.to(param.device)
    labels = ids.masked_fill(mask == 0, -100)
    training = base.training
    base.eval()
    try:
        with torch.no_grad(), autocast_inside(base) as seen:  # the precision the forward itself enters
            together = base(
                input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False
            ).log_probs.float()
            worst, scale = 0.0, 1.0
            for i, n in enumerate(lengths):
                alone = base(
                    input_ids=ids[i : i + 1, :n],
                    attention_mask=mask[i : i + 1, :n],
                    labels=labels[i : i + 1, :n],
                    fused_lm_head=True,
                    use_cache=False,
                ).log_probs.float()
                worst = max(worst, float((together[i, : n - 1] - alone[0]).abs().max()))
                scale = max(scale, float(alone.abs().max()))
    finally:
        base.train(training)
    dtype = compute_dtype(base, seen=seen)
    tol = float(atol) if atol is not None else TOLERANCE.get(dtype, 1e-5) * scale
    if worst > tol:
        raise PackingError(
            f"{type(base).__name__} ({attention_implementation(base)!r} attention, {dtype}) lets the sequences "
            f"of a padding-free {trainer} row see each other: their log-probs differ from the same sequences run "
            f"alone by {worst:.2e} (tolerance {tol:.1e}). Hybrid layers need kernels that read seq_idx / "
            f"cu_seq_lens (mamba-ssm, causal-conv1d on CUDA); otherwise keep TRL's padded batches (do not call "
            f"prepare_{trainer.lower()}_trainer), or pass check_isolation=False if you know better."
        )
    return worst
