"""Resuming a prepared trainer under the process layout its checkpoint was saved under, or a refusal.

packtools' training batches depend on the number of data-parallel processes (each rank's share of an epoch's
shuffle, or of its token-budget batches), and with one process and no ``max_tokens`` ``Trainer``'s own sampler is
kept; a change of the process count alone (the processes of a context-parallel group read one batch) is
accepted where both runs use packtools' sampler.  ``Trainer`` resumes by the step count alone: it skips
``global_step`` optimizer steps of the epochs it lays out for the *current* processes.  Under another process count those are other batches, so rows of the
interrupted epoch would be trained twice and others skipped, without an error.

The run's layout (:func:`run_layout`) is recorded in ``Trainer``'s own ``trainer_state.json``
(``stateful_callbacks["packtools_layout"]``, set by :func:`layout_record` when training begins): the file
``Trainer`` reads the step count it skips from, written by ``Trainer._save_checkpoint`` into every checkpoint it
saves (``run-N/checkpoint-K`` of a hyperparameter search too), so a checkpoint that has a step count to skip has
the layout beside it -- no window between the checkpoint and a record of its own (a kill there left a
checkpoint resumed unchecked).  :func:`check_resume` compares it with the resuming run's when training begins
(after a hyperparameter trial set its arguments, before the first step) and refuses a change, naming both and
the fix.  The token budget, the rows per batch (the size ``Trainer`` trains with, ``auto_find_batch_size``'s
included, where its own sampler is kept) and the accumulation steps are recorded and compared too: a change of
any of them moves the batches ``Trainer`` skips in the same way, and so does the seed of the epoch shuffle
(packtools' or ``Trainer``'s own), and with ``Trainer``'s own sampler its sampling strategy and ``drop_last``.
``packtools_layout.json`` in the checkpoint folder (what earlier packtools wrote, or written by hand with
:func:`save_layout`) is read where ``trainer_state.json`` holds no record.  A checkpoint with a
``trainer_state.json`` and no record anywhere (saved without ``prepare_*``, or by a packtools before the record)
is refused, and so is one whose record names another step than its own (carried over by a run without
packtools resumed from a prepared run's checkpoint: ``Trainer`` writes the state it loaded back), the message
giving the record to write if the run is known to have the checkpoint's layout; one
without ``trainer_state.json``, or whose ``global_step`` is 0, is resumed from step 0 by ``Trainer`` (nothing
skipped) and not checked.  With ``Trainer``'s own sampler taking the rows in the dataset's order
(``train_sampling_strategy="sequential"``, or a ``datasets.IterableDataset``; not a stream of one's own, which
may shuffle with the random state ``Trainer`` seeds), the seed is recorded as ``None`` and not compared.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ...compat.transformers import found_train_batch_size
from ...errors import PackingError

#: the file in a checkpoint folder that records the process layout of the run that saved it (earlier packtools;
#: now the fallback and the record a user writes by hand, :func:`save_layout`)
LAYOUT_FILE = "packtools_layout.json"
#: ``Trainer``'s state file in a checkpoint (``transformers.trainer.TRAINER_STATE_NAME``)
STATE_FILE = "trainer_state.json"
#: the key of the layout record in ``trainer_state.json``'s ``stateful_callbacks``
STATE_KEY = "packtools_layout"


def run_layout(trainer: Any, layout: Any, max_tokens: int | None) -> dict[str, Any]:
    """What the training batches and ``Trainer``'s step-count skip depend on: the processes, the data-parallel
    processes, the token budget (or the rows per batch without one) and the accumulation steps.

    >>> from types import SimpleNamespace as N
    >>> args = N(world_size=4, per_device_train_batch_size=2, gradient_accumulation_steps=1, seed=42)
    >>> r = run_layout(N(args=args, train_dataset=range(10)), N(dp_size=2), None)
    >>> r["processes"], r["data_parallel"], r["max_tokens"], r["rows_per_batch"], r["accumulation"]
    (4, 2, None, 2, 1)
    >>> r["shuffle_seed"], r["dataset_rows"]
    (42, 10)

    ``dataset_rows``: the training dataset's row count (``None`` for a stream).  ``shuffle_seed``: the seed of
    the epoch shuffle (``data_seed``, else ``seed``): packtools' sampler, and
    ``Trainer``'s own where it is kept (one process without ``max_tokens``: accelerate's seedable sampler
    shuffles each epoch by it).  There, ``rows_per_batch`` is the size ``Trainer``'s loader is built with
    (``_train_batch_size``: lowered by ``auto_find_batch_size`` after an out-of-memory error, or restored from
    the resumed checkpoint's state), which its own sampler follows, and ``sampling``
    (``train_sampling_strategy``) and ``drop_last`` (``dataloader_drop_last``: the batches of an epoch) are
    recorded too (packtools' sampler refuses the first and does not apply the second).
    """
    args = trainer.args
    processes = max(int(args.world_size), 1)
    ours = max_tokens is not None or processes > 1
    seed = getattr(args, "data_seed", None)
    rows = int(args.per_device_train_batch_size)
    if not ours:
        rows = found_train_batch_size(trainer) or rows
    record = {
        "processes": processes,
        "data_parallel": int(layout.dp_size),
        "max_tokens": None if max_tokens is None else int(max_tokens),  # a numpy int too (json writes ints)
        "rows_per_batch": rows if max_tokens is None else None,
        "accumulation": int(args.gradient_accumulation_steps),
        "shuffle_seed": int(args.seed) if seed is None else int(seed),
        "dataset_rows": _rows(getattr(trainer, "train_dataset", None)),
    }
    left_out = getattr(trainer, "_packtools_rows_left_out", None)  # set by the loader built before this
    if max_tokens is not None and left_out is not None:
        # rows the token-budget batches leave out of each epoch rather than repeat (repeat_rows=False); a record
        # without it (an earlier packtools) repeated them, in epochs of other batches
        record["rows_left_out"] = int(left_out)
    if not ours:  # Trainer's own sampler: its order and its batches per epoch follow these too
        record["sampling"] = _sampling(args)
        record["drop_last"] = bool(getattr(args, "dataloader_drop_last", False))
        dataset = getattr(trainer, "train_dataset", None)
        if not _shuffled_by_seed(trainer, record["sampling"], record["dataset_rows"], dataset):
            record["shuffle_seed"] = None  # the order is the dataset's: another seed skips the same batches
    return record


def _datasets_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.IterableDataset``: its shuffles draw from generators of its own (its
    ``shuffle(seed)`` + the epoch ``Trainer`` sets), never from the process's random state."""
    return any(
        c.__name__ == "IterableDataset" and c.__module__.startswith("datasets.")
        for c in type(dataset).__mro__
    )


def _shuffled_by_seed(trainer: Any, sampling: str, rows: int | None, dataset: Any = None) -> bool:
    """Whether the training rows' order may follow the seed: not where ``transformers.Trainer``'s own
    ``_get_train_sampler`` (no subclass's) takes them in the dataset's order -- ``train_sampling_strategy=
    "sequential"``, or a ``datasets.IterableDataset`` (no sampler at all, and shuffled by its own generators).
    A stream of one's own (a ``torch`` ``IterableDataset``) may shuffle with ``random`` / ``numpy`` / ``torch``,
    which ``Trainer`` seeds with ``seed`` before the resumed epoch's iterator starts (its checkpoint's random state
    is loaded only after the skipped batches): its seed is still compared."""
    for cls in type(trainer).__mro__:
        if "_get_train_sampler" in vars(cls) and not cls.__module__.startswith("packtools."):
            ordered = sampling == "sequential" or (rows is None and _datasets_stream(dataset))
            return not (ordered and f"{cls.__module__}.{cls.__qualname__}" == "transformers.trainer.Trainer")
    return True  # no sampler of transformers' own: assume it shuffles


def _rows(dataset: Any) -> int | None:
    """The training dataset's row count (``None``: a stream): another (a dataset packed again with another
    ``max_length``, filtered otherwise) is laid out in other batches, whose saved step count ``Trainer`` skips."""
    try:
        return None if dataset is None else int(len(dataset))
    except (TypeError, NotImplementedError):  # no __len__ (an IterableDataset)
        return None


def _sampling(args: Any) -> str:
    """``Trainer``'s training sampler (``train_sampling_strategy``; ``group_by_length`` before it existed)."""
    if getattr(args, "group_by_length", False) is True:
        return "group_by_length"
    return str(getattr(args, "train_sampling_strategy", "random"))


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


def saved_layout(folder: str) -> dict[str, Any] | None:
    """The layout checkpoint ``folder`` recorded: ``trainer_state.json``'s record, else ``packtools_layout.json``;
    ``None`` where it has neither.  A file that cannot be read as a record is refused by name."""
    state = _read(folder, STATE_FILE)
    if state is not None:
        record = state.get("stateful_callbacks") if isinstance(state, dict) else None
        if isinstance(record, dict) and STATE_KEY in record:
            layout = _checked(folder, STATE_FILE, record[STATE_KEY])
            # a record stamped at another step than the checkpoint's was carried over by a run without
            # packtools resumed from a prepared run's checkpoint (Trainer writes the loaded state back): not this
            # checkpoint's layout
            if "step" not in layout or layout["step"] == state.get("global_step"):
                return layout
            return _fallback(folder)
        if not isinstance(state, dict):
            _checked(folder, STATE_FILE, state)
    return _fallback(folder)


def _fallback(folder: str) -> dict[str, Any] | None:
    """``packtools_layout.json`` of checkpoint ``folder`` (earlier packtools' record, or one written by hand)."""
    record = _read(folder, LAYOUT_FILE)
    return None if record is None else _checked(folder, LAYOUT_FILE, record)


def _read(folder: str, name: str) -> Any:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        return error


def _checked(folder: str, name: str, saved: Any) -> dict[str, Any]:
    if isinstance(saved, dict):
        return saved
    raise PackingError(
        f"resume_from_checkpoint={folder!r}: its {name} cannot be read as the layout record packtools "
        f"writes ({saved!r}), so whether the run is resumed under the layout it was saved under is unknown. "
        f"Resume from another checkpoint, or, if this run's processes, max_tokens, per_device_train_batch_size "
        f"and gradient_accumulation_steps are those of the saved run, delete the file to resume unchecked"
        f"{'' if name == LAYOUT_FILE else ' (Trainer then resumes from step 0)'}.",
        param="resume_from_checkpoint",
    )


def check_resume(folder: str | None, current: dict[str, Any]) -> None:
    """Refuse to resume from checkpoint ``folder`` if the layout it recorded differs from ``current``, or if it
    records none while ``Trainer`` would skip its saved step count (see the module docstring)."""
    if not folder or not os.path.isdir(folder):
        return
    state = _read(folder, STATE_FILE)
    if isinstance(state, dict) and state.get("global_step") == 0:
        return  # Trainer skips no batch of a checkpoint at step 0, under any layout
    saved = saved_layout(folder)
    if saved is None:
        if not os.path.isfile(os.path.join(folder, STATE_FILE)):
            return  # Trainer starts at step 0: it skips nothing
        raise PackingError(
            f"resume_from_checkpoint={folder!r} records no data layout (saved without prepare_*, or by a "
            f"packtools before the record): Trainer would skip its saved step count of batches laid out for "
            f"this run, and if the processes, max_tokens, per_device_train_batch_size, "
            f"gradient_accumulation_steps, data_seed/seed (or, with Trainer's own sampler, train_sampling_strategy or "
            f"dataloader_drop_last) differ from the saved run's, rows of the "
            f"interrupted epoch would be trained twice and others never, without an error. If the checkpoint was "
            f"saved under this run's layout, record it and resume: write {json.dumps(current)} to "
            f"{os.path.join(folder, LAYOUT_FILE)} (packtools.integrations.trainers.resume.save_layout); "
            f"otherwise start a new run from the checkpoint's weights (from_pretrained of the folder, without "
            f"resume_from_checkpoint).",
            param="resume_from_checkpoint",
        )
    # a key the record lacks (written before packtools recorded it) is not compared, nor a seed it held as None
    # (Trainer's own sampler, before packtools recorded its seed)
    changed = {
        k: (saved[k], value)
        for k, value in current.items()
        if k in saved and saved[k] != value and not (k == "shuffle_seed" and None in (saved[k], value))
    }
    if current.get("rows_left_out") and "rows_left_out" not in saved and saved.get("max_tokens") is not None:
        changed["rows_left_out"] = ("repeated", current["rows_left_out"])
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
    names["sampling"] = "train_sampling_strategy"
    names["drop_last"] = "dataloader_drop_last"
    names["dataset_rows"] = "the training dataset's rows"
    names["rows_left_out"] = "rows left out of each epoch"
    said = ", ".join(
        f"token-budget batches that repeated row(s) of each epoch to give every process as many batches "
        f"(packtools before repeat_rows=False; now {new} row(s) of each epoch sit it out instead)"
        if k == "rows_left_out" and old == "repeated"
        else f"{names.get(k, k)}={old} (now {new})"
        for k, (old, new) in changed.items()
    )
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


def layout_record(current: Any, folder: str | None) -> Any:
    """A ``TrainerCallback`` that, when training begins (after ``Trainer`` built or loaded its state, on every
    ``auto_find_batch_size`` retry too), checks the resume from ``folder`` against ``current()`` (the run's
    :func:`run_layout`) and records that layout in the state ``Trainer`` saves into each checkpoint."""
    from transformers import TrainerCallback

    class LayoutRecord(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            layout = current()
            check_resume(folder, layout)
            state.stateful_callbacks[STATE_KEY] = layout

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # the step a checkpoint saved now holds (saved after on_step_end): a plain run resumed from it writes
            # the loaded record into checkpoints of later steps, which saved_layout then reads as no record
            record = state.stateful_callbacks.get(STATE_KEY)
            if isinstance(record, dict):
                record["step"] = int(state.global_step)

    return LayoutRecord()
