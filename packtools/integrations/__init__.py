"""Adapters to other libraries: Hugging Face ``datasets``, ``transformers``/TRL trainers, Ray Data."""
