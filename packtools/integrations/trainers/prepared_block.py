"""``prepared(trainer, **kwargs)``: a trainer prepared for the span of a ``with`` block, then unprepared.

TRL's DPO, reward, KTO, GRPO / RLOO and distillation trainers get the ``prepare_*`` of their kind, any other trainer
:func:`~packtools.integrations.trainers.transformers.prepare_trainer`; each records what it changes on the trainer,
and :func:`~packtools.compat.unprepare` puts it back when the block ends (also on an error).

>>> import tempfile, datasets, transformers
>>> from packtools import PaddingFreeCollator, pack_dataset
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                                   num_attention_heads=2, attn_implementation="sdpa")
>>> rows = pack_dataset(datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]]}), 8)
>>> args = transformers.TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True)
>>> trainer = transformers.Trainer(transformers.LlamaForCausalLM(config), args, train_dataset=rows,
...                                data_collator=PaddingFreeCollator(0))
>>> with prepared(trainer):
...     trainer.model.config._attn_implementation
'packtools_sdpa'
>>> trainer.model.config._attn_implementation, trainer._signature_columns
('sdpa', None)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..._optional import is_instance
from ...compat import unprepare
from ...errors import PackingError
from .step import plan_of


@contextlib.contextmanager
def prepared(trainer: Any, **kwargs: Any) -> Iterator[Any]:
    """Prepare ``trainer`` for the block with the ``prepare_*`` of its kind (see the module docstring) and
    ``kwargs``, and :func:`~packtools.compat.unprepare` it after (also on error)::

        with prepared(trainer, max_tokens=4096):
            trainer.train()
        # trainer, model, collator, loader and attention registry as they were built
    """
    # its unprepare at the block's end would undo the earlier preparation too
    if plan_of(trainer) is not None:
        raise PackingError(
            f"prepared() got a {type(trainer).__name__} that prepare_* already prepared: leaving the block would "
            f"unprepare it (its loss mode, loader and attention back to the trainer's own, with no error). Use "
            f"the prepared trainer as it is, or call packtools.integrations.unprepare(trainer) before the block.",
            param="trainer",
        )
    if is_instance(trainer, "trl", "DPOTrainer"):
        from ..preference.dpo import prepare_dpo_trainer as prepare
    elif is_instance(trainer, "trl", "RewardTrainer"):
        from ..preference.reward import prepare_reward_trainer as prepare
    elif is_instance(trainer, "trl", "KTOTrainer"):
        from ..preference.kto import prepare_kto_trainer as prepare
    elif is_instance(trainer, "trl", "GRPOTrainer") or is_instance(trainer, "trl", "RLOOTrainer"):
        from ..rl.grpo import prepare_grpo_trainer as prepare
    elif is_instance(trainer, "trl", "DistillationTrainer"):
        from ..rl.distillation import prepare_distillation_trainer as prepare
    else:
        from .transformers import prepare_trainer as prepare
    prepare(trainer, **kwargs)
    try:
        yield trainer
    finally:
        unprepare(trainer)
