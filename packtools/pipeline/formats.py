"""The raw input formats: which one a table is, the columns each reads and writes, and where a row is.

``text``, ``prompt_completion``, ``messages`` and ``preference`` are tokenized
(:class:`packtools.pipeline.tokenizer.batch.BatchTokenizer`); ``tokenized`` is taken as it is.  What each
format's rows become (ids, EOS, labels, a ``tools`` column) is in ``docs/pipeline.md``, "What goes in".  A
*row* in an error message is a row number, or a callable naming row ``i`` of a block
(:class:`packtools.io.files.Where`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..constants import INPUT_FORMATS
from ..errors import PackingError

FORMATS = INPUT_FORMATS


Row = Any  # a row number, or a callable naming row i of a block (packtools.io.files.Where)


def shift(first_row: Row, i: int) -> Row:
    """Row ``i`` of a block that starts at ``first_row``."""
    if callable(first_row):
        return lambda j=0: first_row(i + j)
    return first_row + i


def at(first_row: Row, i: int = 0) -> str:
    """Where row ``i`` of a block is, for error messages: ``input 'f.jsonl' line 7`` or ``row 7``."""
    return first_row(i) if callable(first_row) else f"row {first_row + i}"


def raw_format(columns: Sequence[str]) -> str | None:
    """The raw (to be tokenized) format that ``columns`` hold, whether or not an ``input_ids`` column stands
    beside them; None when they hold none.

    >>> raw_format(["messages", "input_ids", "labels"]), raw_format(["input_ids"])
    ('messages', None)
    """
    names = set(columns)
    if {"prompt", "chosen", "rejected"} <= names:
        return "preference"
    if {"prompt", "completion"} <= names:
        return "prompt_completion"
    if "messages" in names:
        return "messages"
    if "text" in names:
        return "text"
    return None


def detect_format(columns: Sequence[str]) -> str:
    """Guess the format from column names.  An ``input_ids`` column makes the data ``tokenized`` whatever raw
    columns stand beside it (a ``datasets.map`` that tokenized them keeps them), as TRL's trainers take a dataset
    with ``input_ids`` as already processed: the ids (and ``labels``) the user made are packed, not replaced by
    a new tokenization of the raw columns.  ``format=`` chooses the raw format instead.

    >>> detect_format(["prompt", "chosen", "rejected"]), detect_format(["text", "id"])
    ('preference', 'text')
    >>> detect_format(["messages", "input_ids", "labels"])
    'tokenized'

    A ``label`` beside ``prompt`` and ``completion`` (KTO's rows) is refused rather than guessed: packed for SFT,
    the completions marked undesirable would train like the others.
    """
    if "input_ids" in set(columns):
        return "tokenized"
    fmt = raw_format(columns)
    if fmt == "prompt_completion" and "label" in set(columns):
        raise PackingError(
            "the columns 'prompt', 'completion' and 'label' are TRL's unpaired preference (KTO) format: packed as "
            "prompt_completion, every completion would train, the undesirable ones (label false) too. For KTO, "
            "train with TRL's KTOTrainer and prepare_kto_trainer; to fine-tune on the desirable completions, keep "
            "the rows whose label is true and drop the column; to train on every completion as it is, pass "
            "format='prompt_completion'.",
            param="format",
        )
    if fmt is not None:
        return fmt
    raise PackingError(
        f"cannot tell the data format from the columns {sorted(set(columns))}; expected 'text', 'prompt'+'completion', "
        f"'messages', 'prompt'+'chosen'+'rejected' or 'input_ids'. Pass format={{{','.join(FORMATS)}}}.",
        param="format",
    )


def output_columns(fmt: str) -> list[str]:
    """The token columns that tokenizing ``fmt`` produces."""
    if fmt == "text":
        return ["input_ids"]
    if fmt == "preference":
        return ["prompt_input_ids", "chosen_input_ids", "rejected_input_ids"]
    return ["input_ids", "labels"]


#: Columns a chat format reads when the input has them: ``tools`` (TRL's conversational format, passed to the chat
#: template as ``tools=``, as TRL passes it to ``apply_chat_template``).
CHAT_OPTIONAL = ("tools",)


def optional_columns(fmt: str) -> list[str]:
    """The columns ``fmt`` reads when they are there (the template's ``tools``); never left out silently."""
    return list(CHAT_OPTIONAL) if fmt in ("messages", "prompt_completion", "preference") else []


def input_columns(fmt: str) -> list[str]:
    return {
        "text": ["text"],
        "prompt_completion": ["prompt", "completion"],
        "messages": ["messages"],
        "preference": ["prompt", "chosen", "rejected"],
    }[fmt]
