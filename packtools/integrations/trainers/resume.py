"""Resuming a prepared trainer under the process layout its checkpoint was saved under, or a refusal.

packtools' training batches depend on the number of data-parallel processes (each rank's share of an epoch's
shuffle, or of its token-budget batches), and with one process and no ``max_tokens`` ``Trainer``'s own sampler is
kept; a change of the process count alone (the processes of a context-parallel group read one batch) is
accepted where both runs use packtools' sampler.  ``Trainer`` resumes by the step count alone: it skips
``global_step`` optimizer steps of the epochs it lays out for the *current* processes.  Under another process count those are other batches, so rows of the
interrupted epoch would be trained twice and others skipped, without an error.

:func:`save_layout` writes the layout of the run into every checkpoint (``packtools_layout.json``, by the
processes that save); :func:`check_resume` compares it with the resuming run's before ``Trainer`` loads
anything and refuses a change, naming both and the fix.  The token budget, the rows per batch and the
accumulation steps are recorded and compared too: a change of any of them moves the batches ``Trainer`` skips
in the same way, and so does the seed of packtools' epoch shuffle.  A checkpoint without the file (not saved
by a prepared trainer) is not checked.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ...errors import PackingError

#: the file in a checkpoint folder that records the process layout of the run that saved it
LAYOUT_FILE = "packtools_layout.json"


def run_layout(trainer: Any, layout: Any, max_tokens: int | None) -> dict[str, Any]:
    """What the training batches and ``Trainer``'s step-count skip depend on: the processes, the data-parallel
    processes, the token budget (or the rows per batch without one) and the accumulation steps.

    >>> from types import SimpleNamespace as N
    >>> args = N(world_size=4, per_device_train_batch_size=2, gradient_accumulation_steps=1, seed=42)
    >>> run_layout(N(args=args), N(dp_size=2), None)
    {'processes': 4, 'data_parallel': 2, 'max_tokens': None, 'rows_per_batch': 2, 'accumulation': 1, 'shuffle_seed': 42}

    ``shuffle_seed``: the seed of packtools' epoch shuffle (``data_seed``, else ``seed``; ``None`` where
    ``Trainer``'s own sampler is kept, one process without ``max_tokens``).
    """
    args = trainer.args
    processes = max(int(args.world_size), 1)
    ours = max_tokens is not None or processes > 1
    seed = getattr(args, "data_seed", None)
    return {
        "processes": processes,
        "data_parallel": int(layout.dp_size),
        "max_tokens": None if max_tokens is None else int(max_tokens),  # a numpy int too (json writes ints)
        "rows_per_batch": int(args.per_device_train_batch_size) if max_tokens is None else None,
        "accumulation": int(args.gradient_accumulation_steps),
        "shuffle_seed": (int(args.seed) if seed is None else int(seed)) if ours else None,
    }


def save_layout(folder: str, layout: dict[str, Any]) -> None:
    """Write ``layout`` into checkpoint ``folder`` (a temporary file renamed, so a reader sees all or none)."""
    if not os.path.isdir(folder):
        return
    path = os.path.join(folder, LAYOUT_FILE)
    # one per process: nodes saving into one shared folder (save_on_each_node) do not collide
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(layout, f)
    os.replace(temporary, path)


def checkpoint_folder(trainer: Any, resume_from_checkpoint: Any) -> str | None:
    """The checkpoint ``Trainer.train(resume_from_checkpoint=...)`` resumes from (``True``: the last one in
    ``output_dir``), or ``None``."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        folder = trainer.args.output_dir
        return get_last_checkpoint(folder) if folder and os.path.isdir(folder) else None
    return str(resume_from_checkpoint)


def check_resume(folder: str | None, current: dict[str, Any]) -> None:
    """Refuse to resume from checkpoint ``folder`` if the layout it recorded differs from ``current``."""
    path = os.path.join(folder, LAYOUT_FILE) if folder else None
    if path is None or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        saved = error
    if not isinstance(saved, dict):
        raise PackingError(
            f"resume_from_checkpoint={folder!r}: its {LAYOUT_FILE} cannot be read as the layout record packtools "
            f"writes ({saved!r}), so whether the run is resumed under the layout it was saved under is unknown. "
            f"Resume from another checkpoint, or, if this run's processes, max_tokens, per_device_train_batch_size "
            f"and gradient_accumulation_steps are those of the saved run, delete the file to resume unchecked.",
            param="resume_from_checkpoint",
        )
    # a key the record lacks (written before packtools recorded it) is not compared
    changed = {k: (saved[k], value) for k, value in current.items() if k in saved and saved[k] != value}
    if "processes" in changed and _trainers_sampler(saved) == _trainers_sampler(current):
        # the batches follow the data-parallel processes (compared on their own), not the process count: the
        # processes of a context- or tensor-parallel group read one batch, so CP=2 on 2 processes resumed on 1
        # (one data-parallel process both times, packtools' sampler both times) trains the same batches
        del changed["processes"]
    if not changed:
        return
    fix = (
        "start a new run from the checkpoint's weights (from_pretrained of the checkpoint folder, without "
        "resume_from_checkpoint). ignore_data_skip=True does not make the change safe: Trainer still counts "
        "the epochs trained as global_step // the new layout's steps per epoch, and the steps left by the new "
        "layout, so whole epochs' rows would be trained again or never."
    )
    if "processes" in changed or "data_parallel" in changed:
        raise PackingError(
            f"resume_from_checkpoint={folder!r} was saved under {_processes(saved)} and is resumed under "
            f"{_processes(current)}: packtools' batches of an epoch depend on the number of data-parallel "
            f"processes, and Trainer skips the saved number of steps of the epoch laid out for the new count, so "
            f"rows of the interrupted epoch would be trained twice and others never (and the epoch count would "
            f"be off). Resume under {saved.get('processes')} process(es) with the same parallel layout (torchrun "
            f"--nproc_per_node {saved.get('processes')}); to go on under another count, " + fix,
            param="resume_from_checkpoint",
        )
    names = {"max_tokens": "max_tokens", "rows_per_batch": "per_device_train_batch_size"}
    names["accumulation"] = "gradient_accumulation_steps"
    names["shuffle_seed"] = "data_seed (or seed)"
    said = ", ".join(f"{names.get(k, k)}={old} (now {new})" for k, (old, new) in changed.items())
    raise PackingError(
        f"resume_from_checkpoint={folder!r} was saved with {said}: Trainer skips the saved number of steps of "
        f"batches laid out with the new setting, so rows of the interrupted epoch would be trained twice and "
        f"others never. Resume with the saved setting, or " + fix,
        param="resume_from_checkpoint",
    )


def _trainers_sampler(layout: dict[str, Any]) -> bool:
    """Whether the run kept ``Trainer``'s own sampler (one process, no ``max_tokens``), not packtools'."""
    return layout.get("processes") == 1 and layout.get("max_tokens") is None


def _processes(layout: dict[str, Any]) -> str:
    return f"{layout.get('processes')} process(es) ({layout.get('data_parallel')} data-parallel)"


def layout_saver(layout: dict[str, Any]) -> Any:
    """A ``TrainerCallback`` that writes ``layout`` into each checkpoint folder ``Trainer`` saves."""
    from transformers import TrainerCallback

    class SaveLayout(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if args.should_save:
                save_layout(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), layout)

    return SaveLayout()
