"""The end of every ``torchrun`` worker of the tests: each rank's result gathered to rank 0 and saved, and a
failure that leaves at once (a rank that raised must not leave the others waiting in a collective)."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def save_gathered(result: Any, path: Any) -> None:
    """All-gather ``result`` (any picklable object) from every rank; rank 0 saves the list to ``path``; all wait."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        torch.save(gathered, path)
    dist.barrier()


def quiet_hf_rank() -> int:
    """This ``torchrun`` process's rank, after making it a quiet Hugging Face worker: one intra-op thread (the
    ranks share the CPU), transformers' warnings and datasets' progress bars off."""
    import datasets
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return int(os.environ["RANK"])


def run_worker(main: Callable[[], None]) -> None:
    """Run ``main``; on any failure print the traceback and exit with status 1 at once."""
    try:
        main()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    end_process_group()


def end_process_group() -> None:
    """Destroy the default process group, if any, before the interpreter exits: gloo's threads left to the exit
    can abort the process ('terminate called without an active exception', -6; pytorch/pytorch#190489), which
    CI saw twice in session 47 after a rank had saved its results."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
