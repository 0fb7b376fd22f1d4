"""Data parallelism for the trainer adapters: the loss scaling ``Trainer`` really applies, and gathers that
accept a different number of items on every process.

* :func:`trainer_divides_by_accumulation` reads the predicate the installed ``transformers.Trainer`` uses in
  ``training_step`` to decide whether it divides a micro-batch's loss by the number of micro-batches of the
  step; :func:`check_loss_path` refuses the configurations whose scaling packtools does not know.
* :func:`is_sharded`: whether DeepSpeed or FSDP shards the model; :func:`sharded_by`: which of them shards a
  module of one's own (a plain loop's ``fully_shard`` / ``FullyShardedDataParallel`` / ZeRO-3 model).
* :func:`uneven_gather`: ``accelerator.gather`` when the ranks hold different numbers of items (a micro-batch of
  packed pairs holds as many pairs as fit), where the collective alone fails (a size mismatch on gloo, a hang
  or a crash on NCCL).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..._optional import is_instance, require
from ...compat.accelerate import replaced_gather
from ...errors import PackingError


def is_sharded(trainer: Any) -> bool:
    """Whether DeepSpeed or FSDP shards ``trainer``'s model (it cannot be probed before ``train()``; packtools'
    context parallelism has not been run with either)."""
    return bool(getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False))


def sharded_by(model: Any) -> str | None:
    """What shards ``model``'s parameters so that its forward gathers them from every process (a collective), or
    ``None``: FSDP2 (``fully_shard`` on it or a submodule), FSDP1 (a ``FullyShardedDataParallel`` wrapper
    anywhere in it) or DeepSpeed ZeRO-3 (partitioned parameters, which carry ``ds_id``).

    >>> import torch
    >>> sharded_by(torch.nn.Linear(2, 2)) is None
    True
    """
    modules = model.modules() if hasattr(model, "modules") else [model]
    for sub in modules:
        if is_instance(sub, "torch", "FSDPModule"):
            return "FSDP2 (torch.distributed.fsdp.fully_shard)"
        if is_instance(sub, "torch", "FullyShardedDataParallel"):
            return "FSDP (torch.distributed.fsdp.FullyShardedDataParallel)"
    parameters = model.parameters() if hasattr(model, "parameters") else []
    if any(hasattr(p, "ds_id") for p in parameters):
        return "DeepSpeed ZeRO-3"
    return None


def check_loss_path(trainer: Any, caller: str = "") -> None:
    """Refuse trainers whose loss scaling packtools cannot read from the installed ``Trainer``, and those it would
    wrap in ``torch.nn.DataParallel`` (:func:`refuse_data_parallel`; ``caller``: the ``prepare_*`` named there)."""
    if "loss_is_scaled_for_ga" not in dir(type(trainer)):
        raise PackingError(
            f"this transformers version's Trainer has no loss_is_scaled_for_ga, the predicate packtools reads to "
            f"know whether {type(trainer).__name__} divides each micro-batch's loss by the accumulation steps; "
            f"packtools handles transformers >= 5.x with that attribute. Upgrade transformers."
        )
    refuse_data_parallel(trainer, caller)


def refuse_data_parallel(trainer: Any, caller: str = "") -> None:
    """Refuse a trainer that ``Trainer`` will wrap in ``torch.nn.DataParallel`` (``args.n_gpu > 1``: one process
    driving several GPUs; a model quantized in 8 or 4 bits is not wrapped, so passes).  DataParallel chunks every tensor of the batch along dim 0 on its own -- a packed row's
    ``cu_seq_lens_q`` cut apart from the tokens it describes, a preference row's pairs split -- and runs each replica
    in a thread of its own, where the check of a ``compute_loss``'s forwards (``guard.packed_loss_inputs``, a
    ``ContextVar``) is not set: a forward dropping the packed row's positions would pass with no error.

    >>> from types import SimpleNamespace as NS
    >>> refuse_data_parallel(NS(args=NS(n_gpu=1)))
    >>> refuse_data_parallel(NS(args=NS(n_gpu=2)), "prepare_trainer")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: prepare_trainer: n_gpu=2: transformers' Trainer wraps the model in torch.nn...
    """
    n_gpu = getattr(trainer.args, "n_gpu", 1)
    model = getattr(trainer, "model", None)
    # Trainer._wrap_model's own predicate: a model quantized in 8 or 4 bits (bitsandbytes, QLoRA) is never wrapped
    # in DataParallel -- it trains on its one device, whatever n_gpu counts -- so nothing is split
    quantized = getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False)
    if n_gpu > 1 and not quantized:
        raise PackingError(
            f"{caller + ': ' if caller else ''}n_gpu={n_gpu}: transformers' Trainer wraps the model in "
            f"torch.nn.DataParallel, which splits every batch along dim 0 tensor by tensor (a padding-free row's "
            f"cu_seq_lens apart from its tokens, a preference row's pairs apart) and runs each replica in a thread "
            f"where packtools' check of your compute_loss's forwards is off. Launch one process per GPU (torchrun / "
            f"accelerate launch) instead, or make one GPU visible (CUDA_VISIBLE_DEVICES=0).",
            param="n_gpu",
        )


def trainer_divides_by_accumulation(trainer: Any, num_items_in_batch: Any = None) -> bool:
    """Whether ``Trainer.training_step`` divides the loss of ``compute_loss`` by the step's micro-batches.

    The same predicate the installed ``transformers.Trainer`` evaluates (see :func:`check_loss_path`).

    >>> from types import SimpleNamespace as T
    >>> trainer_divides_by_accumulation(T(loss_is_scaled_for_ga=False))  # TRL's DPOTrainer
    True
    >>> trainer_divides_by_accumulation(T(loss_is_scaled_for_ga=None, model_accepts_loss_kwargs=True,
    ...                                   compute_loss_func=None), num_items_in_batch=40)
    False
    """
    flag = getattr(trainer, "loss_is_scaled_for_ga", None)
    if flag is not None:
        return not bool(flag)
    scaled = (
        bool(getattr(trainer, "model_accepts_loss_kwargs", False)) and num_items_in_batch is not None
    ) or getattr(trainer, "compute_loss_func", None) is not None
    return not scaled


def _gather_uneven(gather: Any, tensor: Any, device: Any) -> Any:
    torch = require("torch", "packtools.integrations.parallel.distributed")
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        return gather(tensor)
    sizes = gather(torch.tensor([tensor.shape[0]], device=device)).tolist()
    longest = max(sizes)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    everything = gather(padded.contiguous())
    return torch.cat([everything[r * longest : r * longest + n] for r, n in enumerate(sizes)])


@contextlib.contextmanager
def uneven_gather(accelerator: Any) -> Iterator[None]:
    """Within the block, ``accelerator.gather`` of a tensor whose first dimension differs across processes
    returns every process's items, concatenated in rank order (scalars and other inputs as before)."""
    if accelerator is None or accelerator.num_processes <= 1 or "gather" in vars(accelerator):
        yield
        return
    original = accelerator.gather

    def gather(tensor: Any) -> Any:
        return _gather_uneven(original, tensor, accelerator.device)

    with replaced_gather(accelerator, gather):
        yield
