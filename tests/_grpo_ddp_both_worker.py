"""One rank of both 2-process checks of ``tests/test_grpo.py`` in one torchrun launch (torchrun's start and the
imports paid once): first ``_grpo_ddp_global_worker.run`` (it saves each rank's reference model before
torch.distributed starts, so it goes first), then ``_grpo_ddp_worker.main``; each writes the files it writes when
launched alone (``global-rank{r}.pt``, ``rank{r}.pt``), every trainer built from its own seeds.

Usage: ``torchrun --nproc_per_node 2 tests/_grpo_ddp_both_worker.py OUT_DIR``.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _grpo_ddp_global_worker  # noqa: E402
import _grpo_ddp_worker  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    results = _grpo_ddp_global_worker.run(out / "two", 2)
    torch.save(results, out / "two" / f"global-rank{os.environ['RANK']}.pt")
    _grpo_ddp_worker.main(out / "trl")
