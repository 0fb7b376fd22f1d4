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
from ...constants import IGNORE_INDEX
from .sft import summed_next_token_loss


def token_mean_loss(trainer: Any, eval_dataset: Any = None) -> float:
    """The next-token loss of the model of ``trainer`` summed over every predicted token of ``eval_dataset``
    (default: the trainer's own) and divided by their count, over the trainer's evaluation batches (its
    ``get_eval_dataloader``, so its collator), in eval mode under ``no_grad``.

    With several processes the sums and counts are added across processes (``torch.distributed``); the
    evaluation sampler may then repeat a few rows to even out the batches, as for ``evaluate()``.
    """
    torch = require("torch", "packtools.integrations.trainers.evaluation.token_mean_loss")
    model = trainer.model
    loader = trainer.get_eval_dataloader(eval_dataset)
    device = trainer.args.device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    try:
        with torch.no_grad():
            for batch in loader:
                batch = {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}
                labels = batch.pop("labels")
                out = model(**batch)
                logits = out["logits"] if isinstance(out, dict) else out.logits
                loss, target = summed_next_token_loss(logits, labels)
                total += loss.double()
                count += (target != IGNORE_INDEX).sum()
    finally:
        model.train(was_training)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        both = torch.stack([total, count.double()])
        dist.all_reduce(both)
        total, count = both[0], both[1]
    return float(total / max(float(count), 1.0))
