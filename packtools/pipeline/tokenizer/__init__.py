"""The tokenizer engine: raw rows to token columns (``BatchTokenizer``), the fast exact engine and its proofs,
the run's verdict, the reference ids, the tokenizer folder."""
