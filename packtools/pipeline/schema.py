"""The input's format and token columns, decided from **every** input file before any work.

:func:`data_format` detects the format of each file (or checks ``config.format`` against each).
:func:`token_schema` chooses the token columns of tokenized input and the columns left out.  Every file's
columns are read (Parquet and Arrow from their schemas, JSON from its first block; the JSON blocks after it
are checked as they are staged, see ``known_columns`` of :func:`packtools.io.files.iter_part`), so a column
that only a later file holds is never dropped without a word (:func:`token_schema` says how).  Already packed
input (``seq_lengths`` or a boundary column in any file) is refused whatever ``columns`` says, since packing
it again merges its sequences.

>>> import os, tempfile, pyarrow.parquet as pq
>>> from packtools.io.discover import discover
>>> from packtools.pipeline.config import PipelineConfig
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"input_ids": [[1, 2]], "id": ["x"]}), os.path.join(d, "a.parquet"))
>>> pq.write_table(pa.table({"input_ids": [[3]], "labels": [[3]]}), os.path.join(d, "b.parquet"))
>>> token_schema(discover([d]), PipelineConfig(max_length=8))
Traceback (most recent call last):
    ...
packtools.errors.PackingError: '.../b.parquet' has the token column(s) ['labels'] that the first file ...
>>> token_schema(discover([d]), PipelineConfig(max_length=8, columns=("input_ids",)))
(['input_ids'], ['int64'], ['id', 'labels'])
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..constants import IMAGE_COLUMNS, SEQ_LENGTHS
from ..core.arrow import is_list_type
from ..core.pack import BOUNDARY_COLUMNS, refuse_unpacked_media
from ..errors import PackingError
from ..io.discover import InputFile
from ..io.files import Part, iter_part, read_schema, reading
from .formats import VISION_PARTS, detect_format, input_columns, non_text_error

if TYPE_CHECKING:
    from .config import PipelineConfig


def data_format(files: Sequence[InputFile], config: PipelineConfig, command: str = "pack") -> str:
    """The input format, the same for every file: ``config.format`` (checked against each file's columns) or
    detected per file from its columns; mixed formats are refused naming the files (and ``command``, the one
    that runs: ``pack`` or ``profile``)."""
    seen: dict[str, str] = {}
    schemas = [read_schema(f) for f in files]
    if not any(s.names for s in schemas):
        raise PackingError(no_rows_message(files))
    for f, schema in zip(files, schemas):
        names = schema.names
        if not names:  # a JSON file with no rows (a shard left empty): it says nothing of the format
            continue
        if config.format is not None:
            needed = (
                input_columns(config.format)
                if config.format != "tokenized"
                else (list(config.columns) if config.columns else ["input_ids"])
            )
            missing = [c for c in needed if c not in names]
            if missing:
                raise PackingError(
                    f"input {f.path!r} lacks the columns {missing} that format={config.format!r} needs (it has "
                    f"{names}); fix the file or leave it out."
                )
            continue
        try:
            fmt = detect_format(names)
        except PackingError as exc:
            raise PackingError(f"input {f.path!r}: {exc}", param=exc.param) from None
        if seen and fmt not in seen:
            other, first = next(iter(seen.items()))
            raise PackingError(
                f"mixed input formats: {f.path!r} is {fmt} data but {first!r} is {other}; {command} them in separate "
                f"runs (or convert them to one format)."
            )
        seen.setdefault(fmt, f.path)
    fmt = config.format or next(iter(seen))
    if fmt != "tokenized":
        _refuse_images(files, [s.names for s in schemas], config.tokenizer)
    if fmt in ("messages", "prompt_completion", "preference"):
        _refuse_template_kwargs(files, [s.names for s in schemas])
    return fmt


#: TRL's per-row chat template arguments (``SFTTrainer``/``DPOTrainer`` pass a row's dict to
#: ``apply_chat_template``, e.g. Qwen 3's ``enable_thinking``).
TEMPLATE_KWARGS = "chat_template_kwargs"


def _refuse_template_kwargs(files: Sequence[InputFile], columns: Sequence[list[str]]) -> None:
    """A ``chat_template_kwargs`` column with a value on some row is refused naming the file: TRL renders each
    row with those arguments, which change the ids or what is trained (Qwen 3's ``enable_thinking=False`` puts
    the empty think block in the prompt, untrained), and packtools does not pass them, so leaving the column
    out would train other tokens without a word.  Null or empty on every row, it changes nothing."""
    for f, names in zip(files, columns):
        if TEMPLATE_KWARGS in names and _column_set(f, TEMPLATE_KWARGS, empty_struct=False):
            raise PackingError(
                f"input {f.path!r} has a {TEMPLATE_KWARGS!r} column: TRL passes each row's to the chat template "
                f"(apply_chat_template(..., **chat_template_kwargs), e.g. enable_thinking), which changes the ids "
                f"and the trained tokens, and packtools does not; write those settings into the tokenizer "
                f"folder's chat template (or pack the rows of each setting with its own template), then drop the "
                f"column."
            )


def _refuse_images(files: Sequence[InputFile], columns: Sequence[list[str]], tokenizer: str | None) -> None:
    """Rows with images tokenized as text lose the images without a word: refused with the fix.  Images are
    an ``images``/``image`` column with a value on some row (TRL's vision format; empty on every row, it holds
    none).  A JSON file's chat columns (JSON lines or a JSON array) are read for any content part but text
    (:func:`~packtools.pipeline.formats.non_text_part`: images, ``image_url``, audio, files, a part without a
    type), whatever the tokenizer: a vision model's processor folder would keep one placeholder token per
    image, and a text tokenizer's chat template drops such a part or writes it as text.  (Other inputs meet
    the same rule row by row as they are tokenized: ``clean_messages``.)"""
    from ..io.json import is_json_array
    from .vision import first_non_text_part

    processor = tokenizer is not None and os.path.isfile(os.path.join(tokenizer, "preprocessor_config.json"))
    for f, names in zip(files, columns):  # the columns data_format read (each file's schema read once)
        found = next((c for c in ("images", "image") if c in names and _column_set(f, c)), None)
        if found is None and f.kind == "json":
            part = first_non_text_part(f.path)
            if part is not None:
                why = non_text_error(f"input {f.path!r} {part[0]}", *part[1:])
                if is_json_array(f.path) and part[-1] in VISION_PARTS:
                    why += " (pack --processor reads JSON lines: write these rows as .jsonl first.)"
                raise PackingError(why)
        if found is None:
            continue
        if f.kind == "json" and not is_json_array(f.path):
            how = (
                "Pack vision-language rows with their processor folder: packtools pack --processor DIR "
                "(pack_dataset(..., processor=DIR)); profile them with packtools profile PATH --tokenizer DIR "
                "(the processor folder)."
            )
        else:  # pack --processor and profile's vision lengths read JSON lines only
            how = (
                "packtools pack --processor and packtools profile read vision-language rows from JSON lines "
                "(.jsonl): write these rows as JSON lines, or pack them in Python with "
                "pack_dataset(datasets.load_dataset(...), processor=DIR)."
            )
        lost = (
            "each image would become a placeholder token"
            if processor
            else "the text tokenizer's chat template writes each image part as it likes (most drop it)"
        )
        raise PackingError(
            f"input {f.path!r} holds images ({found}): tokenized as text, {lost} and the images would be lost. "
            f"{how} To train on the text alone, drop the images first. If column {found!r} holds no images (a "
            f"caption, a name), rename or drop that column: packtools reads a column named {found!r} as images."
        )


def _column_set(file: InputFile, column: str, empty_struct: bool = True) -> bool:
    """Whether a row of ``file`` has a value in ``column`` (not null, not an empty list; with
    ``empty_struct=False`` not an object without keys either, but an object of null values is a value, as
    it is in a JSON file: TRL passes ``key=None``): text-only rows of a
    vision dataset (``images: []``) lose nothing as text.  Parquet says it in its footer (:func:`_parquet_set`);
    otherwise read up to the first such row, that column alone (a JSON file whose rows have no image is parsed
    whole)."""
    import pyarrow.compute as pc

    if file.kind == "parquet" and empty_struct:  # a footer counts a null leaf of a set struct as a null
        told = _parquet_set(file.path, column)
        if told is not None:
            return told
    for _, table in iter_part(Part(file), 4096, columns=[column]):
        col = table.column(column)
        if is_list_type(col.type):
            if pc.any(pc.greater(pc.fill_null(pc.list_value_length(col), 0), 0)).as_py():
                return True
        elif pa.types.is_struct(col.type) and col.type.num_fields == 0 and not empty_struct:
            continue  # {} on every row (null or not): no key, nothing to pass
        elif col.null_count < len(col):
            return True
    return False


def _parquet_set(path: str, column: str) -> bool | None:
    """:func:`_column_set` from the footer's statistics: a leaf of ``column`` whose null count (an empty list
    or a null counts as one) is below its number of values holds one (image bytes are never read); None where a
    row group has no null count."""
    import pyarrow.parquet as pq

    with reading(path, "parquet"):
        md = pq.ParquetFile(path).metadata
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for i in range(rg.num_columns):
            leaf = rg.column(i)
            if leaf.path_in_schema != column and not leaf.path_in_schema.startswith(column + "."):
                continue
            stats = leaf.statistics if leaf.is_stats_set else None
            if stats is None or not stats.has_null_count:
                return None
            if stats.null_count < leaf.num_values:
                return True
    return False


def no_rows_message(files: Sequence[InputFile]) -> str:
    """The refusal of an input in which no file holds a row (a pack of nothing is a mistake upstream; an empty
    file beside others that hold rows is not refused: sharding often leaves one)."""
    named = ", ".join(repr(f.path) for f in files[:3]) + (
        f" and {len(files) - 3} more" if len(files) > 3 else ""
    )
    return (
        f"the input holds no rows: {named} {'is' if len(files) == 1 else 'are all'} empty (an empty file, only "
        f"whitespace, an empty JSON array, or a Parquet/Arrow file of 0 rows); give files that hold rows."
    )


def empty_inputs_notes(files: Sequence[InputFile], jobs: Sequence[Any], staged: Sequence[Any]) -> list[str]:
    """A note naming the input files that held no rows (a shard left empty adds nothing and drops nothing, so
    the run goes on and says so); an input of no rows at all is refused (:func:`no_rows_message`); ``jobs``: the stage jobs, ``staged``: what staging them returned."""
    rows = dict.fromkeys((f.path for f in files), 0)
    for job, s in zip(jobs, staged):
        rows[job.part.file.path] += int(s["rows"])
    empty = [path for path, n in rows.items() if n == 0]
    if len(empty) == len(rows):
        raise PackingError(no_rows_message(files))
    if not empty:
        return []
    return [f"{len(empty)} input file(s) held no rows and added nothing: {', '.join(map(repr, empty))}"]


def _is_token_field(f: pa.Field) -> bool:
    return is_list_type(f.type) or pa.types.is_null(f.type) or f.name in ("input_ids", "labels")


def _first_float(file: InputFile, name: str) -> str:
    """Where ``file`` first writes a float in column ``name``: the line, for JSON lines (Arrow reads the first
    block's floats as the column's type, the line that writes one tells which row to fix, as staging names later
    blocks: :func:`~packtools.pipeline.stage.first_float_row`); the file alone otherwise (its type is the
    column's, on every row)."""
    from ..io.files import Where
    from ..io.json import is_json_array

    if file.kind != "json" or is_json_array(file.path):
        return repr(file.path)
    from .stage import first_float_row

    where = Where(file.path, 1, "line")
    return where(first_float_row(None, name, where))


def _refuse_packed(schemas: Sequence[pa.Schema], files: Sequence[InputFile]) -> None:
    for schema, f in zip(schemas, files):
        found = [c for c in (SEQ_LENGTHS, *BOUNDARY_COLUMNS) if c in schema.names]
        if found:
            raise PackingError(
                f"{f.path!r} has {found}, so it is already packed; packing it again would merge its sequences "
                f"(whichever columns are chosen). Unpack it first (packtools.core.unpack) and pack the result, or "
                f"pack the original unpacked data."
            )


def refuse_image_columns(files: Sequence[InputFile], config: PipelineConfig) -> None:
    """Refuse tokenized input holding processed vision-language rows (:data:`~packtools.constants.PIXEL_COLUMNS`)
    in a pack run, whatever its columns: the text pipeline packs token columns only, so the images would be left
    out (said only in the summary, or by ``columns=[...]`` naming the token columns) and each image's placeholder
    tokens would train without its pixels, as ``pack_table`` and ``pack_dataset`` refuse; ``profile`` reads them
    (their ``input_ids`` count the image tokens)."""
    for f in files:
        names = read_schema(f).names
        refuse_unpacked_media(names, repr(f.path), "columns")
        images = [c for c in IMAGE_COLUMNS if c in names]
        if images:
            named = f" (columns={list(config.columns)} would leave them out)" if config.columns else ""
            raise PackingError(
                f"{f.path!r} holds processed vision-language rows ({images}){named}: the text pipeline packs "
                f"token columns only and would leave the images out, keeping their placeholder tokens in "
                f"input_ids with no pixels. Pack processed rows in memory with "
                f"packtools.pack_dataset(datasets.Dataset, max_length) (each sample whole, its images in row "
                f"order), or rows in TRL's vision format offline with packtools pack --processor DIR "
                f"(docs/vision.md); or, to train the text alone, remove {images} and their placeholder tokens "
                f"from the rows first.",
                param="columns",
            )


def token_schema(
    files: Sequence[InputFile], config: PipelineConfig
) -> tuple[list[str], list[str], list[str]]:
    """For tokenized input: the token columns, their value types and the columns left out.

    The column policy: ``config.columns`` if given, else every list column of the first file, which every
    other file must hold too; other columns (ids, strings) are left out and reported, those of every file.
    Token columns hold integer lists: floats are refused with the fix.  Each keeps the first file's integer
    type (``int32`` when the first file is JSON); other files are cast to it, and a value that does not fit is
    an error naming the file and column.
    """
    schemas = [read_schema(f) for f in files]
    _refuse_packed(schemas, files)
    # JSON files with no rows have no columns (data_format refuses an input of only those)
    kept = [(s, f) for s, f in zip(schemas, files) if s.names]
    schemas, files = [s for s, _ in kept], [f for _, f in kept]
    schema = schemas[0]
    path = files[0].path
    if config.columns:
        missing = [c for c in config.columns if c not in schema.names]
        if missing:
            raise PackingError(
                f"columns={missing} are not in {path!r}; it has {schema.names}.", param="columns"
            )
        names = list(config.columns)
    else:
        names = [f.name for f in schema if _is_token_field(f)]
        for other, f in zip(schemas[1:], files[1:]):
            extra = [x.name for x in other if _is_token_field(x) and x.name not in names]
            if extra:
                raise PackingError(
                    f"{f.path!r} has the token column(s) {extra} that the first file {path!r} lacks, so they "
                    f"would be dropped from {f.path!r}; give every file the same token columns, or pass "
                    f"columns=[...] to choose them (the others are then left out, and listed).",
                    param="columns",
                )
    types = []
    for name in list(names):
        t = schema.field(name).type
        vt = t.value_type if is_list_type(t) else None
        if vt is None or not pa.types.is_integer(vt):
            if vt is not None and pa.types.is_floating(vt):
                fix = (
                    f"token ids must be integers: cast the column to list<int32> (e.g. "
                    f"table.cast(...), or in datasets: ds.cast_column({name!r}, Sequence(Value('int32'))))"
                )
                if files[0].kind == "json":
                    fix += (
                        "; in JSON, integers beyond the int64 range (|id| >= 2**63) are read as floats too: "
                        "no tokenizer has such ids, so the file is likely wrong"
                    )
                if not config.columns and name not in ("input_ids", "labels"):
                    token_names = [n for n in names if n != name]
                    fix += (
                        f"; if {name!r} is not a token column, leave it out by naming the token columns: "
                        f"columns={token_names} (--columns {','.join(token_names)})"
                    )
            elif vt is not None and pa.types.is_boolean(vt) and name in ("input_ids", "labels"):
                fix = "token ids must be integers, not booleans: fix the column in the source"
            elif vt is not None and pa.types.is_boolean(vt):
                # a per-token mask (completion_mask, assistant_masks, ...): left out, the loss it decides would
                # change without a word (pack_dataset refuses it too)
                fix = (
                    f"it holds a per-token mask of booleans, which packtools packs as integers: cast it to "
                    f"list<int8> (in datasets: ds.cast_column({name!r}, Sequence(Value('int8'))))"
                )
                if not config.columns:
                    token_names = [n for n in names if n != name]
                    fix += (
                        f", or if it is not a mask of the tokens, leave it out by naming the token columns: "
                        f"columns={token_names} (--columns {','.join(token_names)})"
                    )
            elif name == "input_ids" and pa.types.is_string(t):
                fix = "it holds text, not token ids: pass format='text' and tokenizer=DIR to tokenize it"
            else:
                fix = "token columns hold lists of integers: cast it, or choose the token columns with columns=[...]"
            if (
                config.columns
                or name in ("input_ids", "labels")
                or (vt is not None and (pa.types.is_floating(vt) or pa.types.is_boolean(vt)))
            ):
                floats = vt is not None and pa.types.is_floating(vt)
                raise PackingError(
                    f"{_first_float(files[0], name) if floats else repr(path)}: column {name!r} has type {t}; "
                    f"{fix}.",
                    param="columns" if config.columns else None,
                )
            names = [n for n in names if n != name]
            continue
        types.append("int32" if files[0].kind == "json" else str(vt))
    if "input_ids" not in names and not config.columns:
        raise PackingError(
            f"{path!r} has no token column 'input_ids' (columns: "
            f"{', '.join(f'{f.name} ({f.type})' for f in schema)}); pass format= and tokenizer= for text, or "
            f"columns= naming the token columns.",
            param="columns",
        )
    left_out: list[str] = []
    for s in schemas:
        left_out += [n for n in s.names if n not in names and n not in left_out]
    return names, types, left_out


def known_columns(columns: Sequence[str], left_out: Sequence[str]) -> tuple[str, ...]:
    """Every column the schema step saw (kept or left out): a JSON block with any other column is refused."""
    return tuple(columns) + tuple(left_out)
