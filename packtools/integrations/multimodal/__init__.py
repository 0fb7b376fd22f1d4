"""Vision-language models: the checks of ``prepare_trainer`` and the processor of TRL's vision format."""
