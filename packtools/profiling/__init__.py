"""Sequence-length profiles, the max_length tradeoff table, plots and the HTML report."""
