"""Preference training: TRL's ``DPOTrainer`` run padding-free (prompt-shared, context-parallel), preference
data packed whole."""
