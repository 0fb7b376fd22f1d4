"""Which processes read which batch (``RankLayout``), data-parallel gathers, the loss over context-parallel
shards."""
