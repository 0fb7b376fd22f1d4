"""Adapters to Hugging Face ``datasets`` and Ray Data: ``pack_dataset``, ``truncate_dataset``,
``packed_view``, the drop reports."""
