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


#: Content part types that hold an image or a video (OpenAI's among them): ``--processor`` packs those.
VISION_PARTS = ("image", "video", "image_url", "input_image")


def non_text_part(conv: Any) -> tuple[int, int, str] | None:
    """The first content part of conversation ``conv`` that a text tokenizer's chat template would lose:
    ``(turn, part, type)`` (None: every part is ``{"type": "text", ...}``, or every content a string).
    transformers hands a text tokenizer's template the parts as they are (only a processor's
    ``apply_chat_template`` reads ``image``/``video``/``audio`` parts, and turns OpenAI's ``image_url`` into
    ``image``); the template then drops a part it does not know (most select ``type == 'text'``) or writes the
    whole list as text.  So any other part is lost: an image, ``image_url``, ``input_image``, ``input_audio``,
    ``audio``, ``file``, OpenAI's ``input_text``, a part without a ``type`` (named ``None``), a part that is no
    object (a bare string: named ``<str>``), or a content that is one part object, not a list (``<one part>``).

    >>> non_text_part([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}])
    (0, 1, 'image_url')
    >>> non_text_part([{"role": "user", "content": "hi"}]) is None
    True
    """
    for turn, message in enumerate(conv if isinstance(conv, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, dict):  # one part where a list of them belongs: templates drop or print it
            return turn, 0, ONE_PART
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            if not isinstance(part, dict):  # a bare string among the parts: dropped, or printed as a list
                return turn, k, f"<{type(part).__name__}>"
            if part.get("type") != "text":
                kind = part.get("type")
                return turn, k, kind if isinstance(kind, str) else repr(kind)
    return None


#: :func:`non_text_part`'s kind for a content that is one part object rather than a list of parts.
ONE_PART = "<one part>"


def part_kind(kind: str) -> str:
    """A content part's type (:func:`non_text_part`) in words."""
    if kind == "None":
        return "has no 'type'"
    if kind == ONE_PART:
        return "is one part object where content holds a string or a list of parts"
    if kind.startswith("<"):
        return f"is a {kind[1:-1]}, not a part object ({{'type': 'text', 'text': ...}})"
    return f"is of type {kind!r}"


def non_text_error(where: str, column: str, turn: int, part: int, kind: str) -> str:
    """The refusal of a content part a text tokenizer would lose (:func:`non_text_part`), at ``where``."""
    fix = part_fix(kind)
    return (
        f"{where}: column {column!r} turn {turn} part {part} {part_kind(kind)}: content a text tokenizer cannot "
        f"read: tokenized as text, the chat template drops such a part or writes it as text, and what it holds "
        f"would be lost. {fix[0].upper()}{fix[1:]}."
    )


def part_fix(kind: str) -> str:
    """How to keep what a content part of type ``kind`` (:func:`non_text_part`) holds."""
    if kind in VISION_PARTS:
        return (
            "pack images with the model's processor folder: packtools pack --processor DIR (pack_dataset(..., "
            "processor=DIR)), the rows in TRL's vision format ({'type': 'image'} parts, the images in an 'images' "
            "column); to train on the text alone, drop the part"
        )
    if kind in ("input_text", "output_text"):
        return "write the part as {'type': 'text', 'text': ...}, the type chat templates read"
    if kind == "None":
        return "give the part its 'type' ('text' for text)"
    if kind == ONE_PART:
        return "give the content as a string, or as a list of parts ([{'type': 'text', 'text': ...}])"
    if kind.startswith("<"):
        return "write each part as {'type': 'text', 'text': ...}"
    return (
        "a text tokenizer cannot train on it (packtools packs images only, through --processor); to train on "
        "the text alone, drop the part, or write what it says as a {'type': 'text'} part"
    )
