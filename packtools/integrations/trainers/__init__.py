"""What packtools changes on a transformers ``Trainer`` / TRL ``SFTTrainer``: ``prepare_trainer``, its checks,
its loader and its loss."""
