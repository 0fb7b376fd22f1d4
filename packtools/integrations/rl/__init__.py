"""Online RL (TRL's ``GRPOTrainer`` and ``RLOOTrainer``) without padding: :func:`prepare_grpo_trainer`."""

from .grpo import prepare_grpo_trainer

__all__ = ["prepare_grpo_trainer"]
