"""The evaluation loss of packed rows as the training loss is: the mean over every predicted token of the
evaluation set.

``Trainer.evaluate()`` reports ``eval_loss`` as the mean of its batches' losses, each already a mean over that
batch's tokens, so with packed rows (uneven token counts per batch) it is not the token mean the training loss is.
transformers has no public hook that changes that aggregation, so packtools does not patch it;
:func:`token_mean_loss` computes the token mean over the same batches instead (docs/training.md)::

    metrics = trainer.evaluate()
    metrics["eval_loss"] = token_mean_loss(trainer)

>>> import tempfile, datasets, transformers
>>> from packtools import PaddingFreeCollator, pack_dataset, prepare_trainer
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                   num_attention_heads=2, attn_implementation="sdpa")
>>> rows = pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}), 8)
>>> args = transformers.TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True)
>>> trainer = prepare_trainer(transformers.Trainer(transformers.LlamaForCausalLM(config), args, train_dataset=rows,
...                                                eval_dataset=rows, data_collator=PaddingFreeCollator(0)))
>>> 3.0 < token_mean_loss(trainer) < 5.0  # about ln(64) for a random model
True
"""

from __future__ import annotations

from typing import Any

from ..._optional import require
from ...compat.accelerate import batches_with_first_seen
from ...constants import IGNORE_INDEX
from ...errors import PackingError
from .guard import refuse_encoder_decoder
from .sft import summed_next_token_loss


def token_mean_loss(trainer: Any, eval_dataset: Any = None) -> float:
    """The next-token loss of the model of ``trainer`` summed over every predicted token of ``eval_dataset``
    (default: the trainer's own) and divided by their count, over the trainer's evaluation batches (its
    ``get_eval_dataloader``, so its collator), in eval mode under ``no_grad``.

    With several processes the sums and counts are added across processes (``torch.distributed``), and every
    row counts once: where the rows do not divide evenly among the processes, accelerate fills the last batches
    with rows from the start of the set (``even_batches=True``, so that each process runs as many batches); a
    batch holding such repeats is run on its rows seen for the first time only (one forward a batch on every
    process all the same, which sharded models need), so the result is the one-process token mean. The
    evaluation sampler must give the same order each time it is iterated (``Trainer``'s sequential one does);
    an order that changes is refused by name.
    """
    torch = require("torch", "packtools.integrations.trainers.evaluation.token_mean_loss")
    model = trainer.model
    refuse_encoder_decoder(
        model, "token_mean_loss"
    )  # its loss is no next-token loss over labels shifted here
    loader = trainer.get_eval_dataloader(eval_dataset)
    dist = torch.distributed
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rows = batches_with_first_seen(loader)
    if (
        several and rows is None and int(trainer.args.world_size) > 1
    ):  # sharded, but not by a BatchSamplerShard
        raise PackingError(
            f"token_mean_loss under {dist.get_world_size()} processes: the evaluation loader "
            f"({type(getattr(loader, 'batch_sampler', None)).__name__} batches) is not dealt out by accelerate's "
            "BatchSamplerShard, so the rows repeated to even out the processes cannot be told apart. Evaluate a "
            "map-style dataset (a datasets.Dataset, not a stream), or call it in one process.",
            param="eval_dataset",
        )
    device = trainer.args.device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    changed = False  # the order changed between iterations: refused on every process at once, after the loop
    try:
        with torch.no_grad():
            for batch in loader:
                counted = batch if rows is None else _first_seen(loader, batch, next(rows))
                if counted is CHANGED:
                    changed, counted = True, None
                inputs = {k: _on(v, device) for k, v in (batch if counted is None else counted).items()}
                labels = inputs.pop("labels")
                out = model(**inputs)  # every batch runs, on every process: sharded models gather weights
                if counted is None:  # every row a repeat
                    continue
                logits = out["logits"] if isinstance(out, dict) else out.logits
                loss, target = summed_next_token_loss(logits, labels)
                total += loss.double()
                count += (target != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    if several:  # the refusal travels with the sums: a process that alone found the change would leave the
        # others waiting in this all_reduce
        both = torch.stack([total, count.double(), total.new_tensor(float(changed))])
        dist.all_reduce(both)
        total, count, changed = both[0], both[1], bool(both[2] > 0)
    if changed:
        raise order_changed(loader)
    return float(total / max(float(count), 1.0))


def _on(value: Any, device: Any) -> Any:
    return value.to(device) if hasattr(value, "to") else value


#: What :func:`_first_seen` returns for a batch that is not the one the sampler gives when iterated again.
CHANGED: Any = object()


def _first_seen(loader: Any, batch: dict[str, Any], dealt: tuple[list[int], int]) -> Any:
    """The batch to count: ``batch`` whole when none of its rows repeats; ``None`` when all do; else its
    rows seen for the first time, collated again by the loader's collator, checked to be the rows ``batch``
    was collated from: :data:`CHANGED` where they are not (a sampler whose order changes between iterations,
    refused by :func:`order_changed` on every process, never miscounted)."""
    indices, first = dealt
    if first == len(indices):
        return batch
    if first == 0:
        return None
    rows = [loader.dataset[i] for i in indices]
    again = loader.collate_fn(rows)
    if not _same(again["input_ids"], batch["input_ids"]):
        return CHANGED
    return loader.collate_fn(rows[:first])


def order_changed(loader: Any) -> PackingError:
    """The refusal of an evaluation sampler whose order changed between two iterations (:func:`_first_seen`)."""
    return PackingError(
        "token_mean_loss: the evaluation loader's sampler gave another order when iterated again "
        f"({type(getattr(loader.batch_sampler.batch_sampler, 'sampler', None)).__name__}), so the rows "
        "accelerate repeated to even out the processes cannot be found. Evaluate with Trainer's sequential "
        "evaluation sampler (any train_sampling_strategy but 'group_by_length' leaves it sequential).",
        param="eval_dataset",
    )


def _same(a: Any, b: Any) -> bool:
    return tuple(a.shape) == tuple(b.shape) and bool((a.cpu() == b.cpu()).all())
