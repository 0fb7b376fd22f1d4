"""Online RL (TRL's ``GRPOTrainer`` and ``RLOOTrainer``) and on-policy distillation (TRL's
``DistillationTrainer``) without padding: :func:`prepare_grpo_trainer`, :func:`prepare_distillation_trainer`."""

from .distillation import prepare_distillation_trainer
from .grpo import prepare_grpo_trainer

__all__ = ["prepare_distillation_trainer", "prepare_grpo_trainer"]
