"""The attention functions packtools registers with transformers (per document, prompt-shared tree, context-
parallel), the backend switch and the isolation probe."""
