"""Padding-free training batches: collators, the Arrow-native loader, the token-budget sampler, varlen attention."""
