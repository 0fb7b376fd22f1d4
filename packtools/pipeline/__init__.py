"""The offline job: input files -> (tokenize) -> one global plan -> packed output folder, on any executor."""
