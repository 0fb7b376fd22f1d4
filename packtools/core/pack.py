"""Pack, unpack and truncate Arrow tables with a :class:`PackPlan`."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..constants import AUDIO_COLUMNS, IMAGE_COLUMNS, SEQ_LENGTHS, VIDEO_COLUMNS
from ..errors import EmptyRowsWarning, PackingError, TokensDroppedWarning, empty_rows_message
from . import buffers
from .arrow import (
    ListColumn,
    as_table,
    check_aligned,
    check_row_counts,
    column_lengths,
    copy_segments,
    is_list_type,
    list_array,
    read_list_column,
)
from .plan import STRATEGIES, PackPlan, Strategy, check_max_length, kernels  # kernels: imported on first use
from .plan import plan as make_plan
from .ragged import offsets_of

#: Columns that only packed (or already collated) data carries: their presence means the rows are packed.
BOUNDARY_COLUMNS = ("cu_seq_lens", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")


def _first_restart(col: ListColumn) -> int | None:
    """The first row whose values do not step by exactly +1 (position ids restarting inside it), or None."""
    for chunk in col.chunks:
        base = int(chunk.offsets[0])
        vals = chunk.values[base : int(chunk.offsets[-1])]
        if vals.shape[0] < 2:
            continue
        broken = np.diff(vals.astype(np.int64)) != 1
        crossings = chunk.offsets[1:-1] - base - 1  # steps from one row's last value to the next row's first
        broken[crossings[(crossings >= 0) & (crossings < broken.shape[0])]] = False
        bad = np.flatnonzero(broken)
        if bad.size:
            local = int(np.searchsorted(chunk.offsets - base, bad[0], side="right")) - 1
            return chunk.row_start + local
    return None


def check_not_packed(table: pa.Table) -> None:
    """Refuse a table that is already packed: packing it again would merge the sequences inside its rows.

    What it can tell: a ``seq_lengths`` column, a boundary column (``cu_seq_lens*``, ``cu_seqlens``,
    ``seq_idx``), or a ``position_ids`` list column that restarts inside a row.  What it cannot: rows that
    were concatenated with no such column left (documents joined with EOS separators, ``wrapped`` chunks
    whose ``position_ids`` were dropped) look exactly like long single sequences.
    """
    names = table.column_names
    if SEQ_LENGTHS in names:
        raise PackingError(
            f"the table already has a {SEQ_LENGTHS!r} column, so it is packed; packing it again would "
            f"merge its sequences. Unpack it first (packtools.core.unpack) and pack the result."
        )
    found = [c for c in BOUNDARY_COLUMNS if c in names]
    if found:
        raise PackingError(
            f"the table has {found}, columns that only packed or collated rows carry; packing it again would "
            f"merge the sequences inside its rows. Pack the original unpacked rows instead."
        )
    if "position_ids" in names and is_list_type(table.schema.field("position_ids").type):
        row = _first_restart(read_list_column(table.column("position_ids"), "position_ids"))
        if row is not None:
            raise PackingError(
                f"row {row}: 'position_ids' restart inside the row, so the rows are already packed (several "
                f"sequences each) though there is no {SEQ_LENGTHS!r} column; packing them again would merge those "
                f"sequences. Pack the original unpacked rows, or rebuild {SEQ_LENGTHS!r} from the restarts and "
                f"unpack (packtools.core.unpack) first."
            )


def check_columns_unique(columns: Sequence[str]) -> None:
    """Refuse a column named twice in ``columns=`` (``--columns``): it would be packed twice into two output
    columns of one name, which Arrow keeps and ``datasets`` cannot open.

    >>> check_columns_unique(["input_ids", "labels", "input_ids"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: columns=['input_ids', 'labels', 'input_ids'] names 'input_ids' more than once...
    """
    twice = [c for c in dict.fromkeys(columns) if list(columns).count(c) > 1]
    if twice:
        raise PackingError(
            f"columns={list(columns)} names {', '.join(map(repr, twice))} more than once; name each column to "
            f"pack once.",
            param="columns",
        )


def _select_columns(table: pa.Table, columns: Sequence[str] | None) -> list[str]:
    if columns is None:
        names = list(table.column_names)
        if not names:
            raise PackingError("the table has no columns to pack.")
        return names
    if isinstance(columns, str):
        columns = [columns]
    check_columns_unique(columns)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise PackingError(f"columns {missing} are not in the table; it has {table.column_names}.")
    if not columns:
        raise PackingError("columns=[] names nothing to pack; name at least one list column.")
    return list(columns)


def read_columns(
    table: pa.Table, columns: Sequence[str] | None = None, *, unpacked: bool = True
) -> tuple[list[ListColumn], np.ndarray]:
    """Read the columns to pack and their shared row lengths, validating everything.

    With ``unpacked=True`` (for packing) a table that is already packed is refused (:func:`check_not_packed`).
    """
    if unpacked:
        check_not_packed(table)
    names = _select_columns(table, columns)
    non_list = [n for n in names if not is_list_type(table.schema.field(n).type)]
    if non_list and columns is None:
        raise PackingError(
            f"columns {non_list} are not list columns, so they cannot be packed; packed rows hold many "
            f"sequences. Pass columns=[...] with the list columns to pack (the others are then left out), "
            f"or remove {non_list} first.",
            param="columns",
        )
    cols = [read_list_column(table.column(n), n) for n in names]
    lengths = check_aligned(cols)
    if unpacked:
        check_no_padding(cols)
        check_ids_not_negative(cols)
    return cols, lengths


def check_ids_not_negative(cols: Sequence[ListColumn]) -> None:
    """Refuse a negative value in ``input_ids``: no tokenizer has one (``-100`` belongs in ``labels``), and
    packed as given it reaches the model's embedding lookup.

    >>> import pyarrow as pa
    >>> from packtools.core.arrow import read_list_column
    >>> ids = pa.array([[1, 2], [3, -100]])
    >>> check_ids_not_negative([read_list_column(ids, "input_ids")])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: column 'input_ids' holds -100 (first negative in row 1, position 1): token ids...
    """
    for col in cols:
        if col.name != "input_ids" or not np.issubdtype(
            col.type.value_type.to_pandas_dtype(), np.signedinteger
        ):
            continue
        for chunk in col.chunks:
            values = chunk.values[chunk.offsets[0] : chunk.offsets[-1]]
            if not values.size or values.min() >= 0:
                continue
            at = int(np.argmax(values < 0)) + int(chunk.offsets[0])
            row = int(np.searchsorted(chunk.offsets, at, side="right")) - 1
            raise PackingError(
                f"column 'input_ids' holds {int(chunk.values[at])} (first negative in row {chunk.row_start + row}, "
                f"position {at - int(chunk.offsets[row])}): token ids are never negative (-100, the ignore index, "
                f"belongs in 'labels'), and the model would look it up as an embedding. Fix the ids in the source "
                f"(tokenize the row again)."
            )


def check_no_padding(cols: Sequence[ListColumn]) -> None:
    """Refuse an ``attention_mask`` column with 0s: the rows hold padding, which packing would keep as tokens.

    >>> import pyarrow as pa
    >>> from packtools.core.arrow import read_list_column
    >>> mask = pa.array([[1, 1], [1, 1, 0]])
    >>> check_no_padding([read_list_column(mask, "attention_mask")])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: column 'attention_mask' has 0s (first in row 1, position 2): the rows hold padding...
    """
    for col in cols:
        if col.name != "attention_mask":
            continue
        for chunk in col.chunks:
            values = chunk.values[chunk.offsets[0] : chunk.offsets[-1]]
            zeros = np.flatnonzero(values == 0)
            if zeros.size:
                at = int(zeros[0]) + int(chunk.offsets[0])
                row = int(np.searchsorted(chunk.offsets, at, side="right")) - 1
                raise PackingError(
                    f"column 'attention_mask' has 0s (first in row {chunk.row_start + row}, position "
                    f"{at - int(chunk.offsets[row])}): the rows hold padding, which packing would keep as tokens "
                    f"of the packed rows (attended to, and trained on unless labels are -100 there). Tokenize "
                    f"without padding=..., or strip the padded positions from every column first. An all-ones "
                    f"attention_mask packs as is, and can be dropped: PaddingFreeCollator needs none."
                )


Segments = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def segments_in_input_order(p: PackPlan, row_indices: np.ndarray | None = None) -> Segments:
    """The plan's segments as ``(source row, start, length, destination)``, sorted by source row.

    Copying in this order reads each column front to back and groups the segments by chunk.  It depends only on
    the plan, so every column of a table shares it.
    """
    source = p.seg_source if row_indices is None else row_indices[p.seg_source]
    order = np.argsort(source)
    return source[order], p.seg_start[order], p.seg_length[order], p.seg_dest[order]


def gather_column(
    col: ListColumn,
    p: PackPlan,
    row_indices: np.ndarray | None = None,
    release: Callable[[np.ndarray], object] | None = None,
    out: np.ndarray | None = None,
    segments: Segments | None = None,
) -> np.ndarray:
    """Copy the planned segments of one column into a contiguous values buffer.

    ``row_indices`` maps the plan's sources to rows of ``col`` (a dataset's select/shuffle mapping).
    ``release`` is called on each chunk's values once they have been copied from (to drop mapped pages).
    ``out``, if given, is a buffer of at least ``p.tokens_kept`` values to fill (its first part is returned).
    ``segments`` is :func:`segments_in_input_order` of the same plan and indices, if already computed.
    """
    dtype = col.chunks[0].values.dtype if col.chunks else col.type.value_type.to_pandas_dtype()
    if out is None or out.dtype != dtype or out.shape[0] < p.tokens_kept:
        out = buffers.empty(p.tokens_kept, dtype)  # not NumPy's huge-page memory: packtools.core.buffers
    else:
        out = out[: p.tokens_kept]
    if p.num_segments == 0:
        return out
    segments = segments if segments is not None else segments_in_input_order(p, row_indices)
    copy_segments(col, *segments, out, by_source=True, release=release)
    return out


def pack_columns(
    cols: list[ListColumn],
    p: PackPlan,
    row_indices: np.ndarray | None = None,
    release: Callable[[np.ndarray], object] | None = None,
    scratch: dict[str, np.ndarray] | None = None,
) -> pa.Table:
    """Materialize packed list columns (and ``seq_lengths`` for bfd strategies) from a plan.

    With ``scratch`` (column name -> buffer, filled in on first use), values are gathered into those
    buffers instead of new memory: for writers that consume each table before the next call.
    """
    token_offsets = p.token_offsets
    segments = segments_in_input_order(p, row_indices) if p.num_segments else None
    arrays, names = [], []
    for col in cols:
        buffer = scratch.get(col.name) if scratch is not None else None
        values = gather_column(col, p, row_indices, release, buffer, segments)
        if scratch is not None and (buffer is None or buffer.shape[0] < values.shape[0]):
            scratch[col.name] = values
        arrays.append(
            list_array(token_offsets, values, pa.types.is_large_list(col.type), col.type.value_type)
        )
        names.append(col.name)
    if p.strategy != "wrapped":
        arrays.append(p.seq_lengths)
        names.append(SEQ_LENGTHS)
    return pa.Table.from_arrays(arrays, names=names)


def refuse_unpacked_media(names: Sequence[str], what: str, param: str) -> None:
    """Refuse rows holding video or audio columns (:data:`~packtools.constants.VIDEO_COLUMNS`,
    :data:`~packtools.constants.AUDIO_COLUMNS`; ``names``: the rows' column names) in ``what``, which packs token
    columns (or images) only, whatever ``columns=`` says.

    >>> refuse_unpacked_media(["input_ids", "labels"], "pack_table", "table")
    """
    if videos := [c for c in VIDEO_COLUMNS if c in names]:
        raise PackingError(
            f"{what}: the rows hold video column(s) {videos}, and packtools packs images only (video positions "
            f"are not verified): packed without them (whatever columns= names), each video's placeholder tokens "
            f"would stay in input_ids with no pixels. Remove the video samples (their columns and placeholder "
            f"tokens) first, or train them unpacked.",
            param=param,
        )
    if audio := [c for c in AUDIO_COLUMNS if c in names]:
        raise PackingError(
            f"{what}: the rows hold audio column(s) {audio}, and packtools packs no audio: packed without them "
            f"(whatever columns= names), each clip's audio placeholder tokens would stay in input_ids with no "
            f"audio features. Remove the audio samples (their columns and placeholder tokens) first, or train "
            f"them unpacked.",
            param=param,
        )


def refuse_pixel_columns(names: Sequence[str], what: str, param: str = "table") -> None:
    """Refuse processed vision-language rows (:data:`~packtools.constants.PIXEL_COLUMNS`: images, and videos, which
    no path packs, as audio (:data:`~packtools.constants.AUDIO_COLUMNS`) is not; ``names``: the rows' column names) in ``what``, a path that packs or plans its token columns
    alone: left out, as ``columns=[...]`` naming the token columns would leave them, each image's placeholder
    tokens would stay in ``input_ids`` with no pixels and the training data would change with no error.  Refused
    whatever ``columns=`` says (``pack_dataset`` packs such rows whole with their images).

    >>> refuse_pixel_columns(["input_ids"], "pack_ray_dataset", "ds")
    """
    refuse_unpacked_media(names, what, param)
    found = [c for c in IMAGE_COLUMNS if c in names]
    if found:
        raise PackingError(
            f"{what} plans token columns only, and this table holds vision-language rows ({found}): packed "
            f"without them (whatever columns= names), each image's placeholder tokens would stay in input_ids "
            f"with no pixels. Pack them with packtools.pack_dataset(datasets.Dataset(table), max_length) (each "
            f"sample whole, its images in row order; docs/vision.md), or, to train the text alone, remove the "
            f"images and their placeholder tokens from the rows first.",
            param=param,
        )


def check_no_images(table: pa.Table, what: str) -> None:
    """:func:`refuse_pixel_columns` of a table (``what``: ``pack_table``, ``packed_view``, whose ``materialize()``
    must equal ``pack_dataset``'s).

    >>> check_no_images(pa.table({"input_ids": [[1, 2]]}), "packed_view")
    """
    refuse_pixel_columns(table.column_names, what, "table")


def pack_table(
    table: pa.Table,
    max_length: int,
    strategy: Strategy | str = "bfd",
    columns: Sequence[str] | None = None,
    *,
    shuffle: bool = False,
    seed: int = 0,
    plan: PackPlan | None = None,
) -> pa.Table:
    """Pack the list columns of ``table`` into rows of at most ``max_length`` tokens.

    All packed columns must share row lengths (e.g. ``input_ids``, ``labels``, ``attention_mask``).  With
    ``columns=None`` every column is packed and all must be lists; otherwise only the named ones are, and
    the rest are left out.  Processed vision-language rows (:data:`~packtools.constants.IMAGE_COLUMNS`) are
    refused, whatever ``columns`` says (:func:`check_no_images`; ``pack_dataset`` packs them).  ``bfd``/``bfd_split`` add ``seq_lengths`` (``list<int32>``), the lengths of the
    sequences inside each row.  ``shuffle=True`` reorders packed rows deterministically for ``seed``.

    >>> import pyarrow as pa
    >>> t = pa.table({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
    >>> pack_table(t, 4).to_pydict()
    {'input_ids': [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]], 'seq_lengths': [[4], [3, 1], [2]]}
    """
    if not isinstance(table, pa.Table):
        raise PackingError(f"table must be a pyarrow.Table, got {type(table).__name__}.")
    max_length = check_max_length(max_length)
    check_no_images(table, "pack_table")
    cols, lengths = read_columns(table, columns)
    if plan is None:
        p = make_plan(lengths, max_length, strategy)
        _warn_left_out(p)
        if shuffle:
            p = p.shuffled(seed)
        return pack_columns(cols, p)
    if p_mismatch := _plan_mismatch(plan, max_length, strategy):
        raise PackingError(
            f"plan= was made with {p_mismatch}; pass the same values or re-plan with packtools.plan()."
        )
    if plan.num_sequences != len(lengths) or not np.array_equal(plan.source_lengths, lengths):
        raise PackingError(
            "the plan was made for other lengths than this table's; re-plan with packtools.plan()."
        )
    if shuffle:
        raise PackingError(
            "shuffle=True with plan=...: shuffle the plan itself (plan.shuffled(seed)) and pass that, so the "
            "plan you keep is the one that made the rows (unpack needs it)."
        )
    return pack_columns(cols, plan)


def _warn_left_out(p: PackPlan) -> None:
    """What a plan ``pack_table`` made itself left out, said (a caller with its own ``plan=`` has the numbers):
    a :class:`~packtools.errors.TokensDroppedWarning` for tokens ``bfd`` cut, an
    :class:`~packtools.errors.EmptyRowsWarning` for rows of no token."""
    if p.tokens_kept < p.tokens_in:
        cut = int(np.count_nonzero(p.source_lengths > p.max_length))
        warnings.warn(
            f"pack_table: strategy={p.strategy!r} at max_length={p.max_length:,} dropped "
            f"{p.tokens_in - p.tokens_kept:,} of {p.tokens_in:,} tokens (the ends of {cut:,} of {p.num_sequences:,} "
            f"sequences longer than max_length). strategy='bfd_split' keeps every token (it splits long "
            f"sequences); or choose max_length with packtools.profile_lengths(...).recommend(). packtools.plan() "
            f"gives the counts (tokens_in, tokens_kept).",
            TokensDroppedWarning,
            stacklevel=3,
        )
    if p.num_empty:
        warnings.warn(
            empty_rows_message(p.num_empty, p.num_sequences, "pack_table", "they are not in the packed rows"),
            EmptyRowsWarning,
            stacklevel=3,
        )


def _plan_mismatch(p: PackPlan, max_length: int, strategy: str) -> str:
    parts = []
    if p.max_length != max_length:
        parts.append(f"max_length={p.max_length} (not {max_length})")
    if p.strategy != strategy:
        parts.append(f"strategy={p.strategy!r} (not {strategy!r})")
    return " and ".join(parts)


def unpack(
    table: pa.Table,
    columns: Sequence[str] | None = None,
    plan: PackPlan | None = None,
) -> pa.Table:
    """Recover the sequences from packed rows (a ``pyarrow.Table``, or a ``datasets.Dataset``: a table comes back).

    Without a plan, every entry of ``seq_lengths`` becomes one row, in packed order.  With the plan that
    packed the table, rows come back in the original order, one per input sequence (the kept part; chunks
    of ``bfd_split`` and pieces of ``wrapped`` are joined again; empty sequences come back empty).  A plan
    whose row or sequence lengths differ from the table's is refused; a plan knows only lengths, so keep the
    one that made the rows (with shuffling, the shuffled plan).

    >>> import pyarrow as pa
    >>> t = pa.table({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
    >>> p = make_plan([5, 2, 3, 1], 4, "bfd_split")
    >>> unpack(pack_table(t, 4, "bfd_split", plan=p), plan=p).to_pydict()
    {'input_ids': [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]}
    """
    table = as_table(table)
    chosen = table.column_names if columns is None else _select_columns(table, columns)
    names = [n for n in chosen if n != SEQ_LENGTHS]
    cols, lengths = read_columns(table, names, unpacked=False)
    if plan is None:
        if SEQ_LENGTHS not in table.column_names:
            raise PackingError(
                "unpack needs the 'seq_lengths' column (bfd/bfd_split output) or the plan (plan=...)."
            )
        seq = read_list_column(table.column(SEQ_LENGTHS), SEQ_LENGTHS)
        seg_lengths = seq.flat_values().astype(np.int64)
        offsets = np.concatenate(([0], np.cumsum(seg_lengths)))
        holds = "column {name} holds {} values"
        fix = "seq_lengths must describe each packed row exactly."
        check_row_counts(
            lengths, seq.row_sums(), holds, "its seq_lengths sum to {}", fix, fields={"name": repr(names[0])}
        )
        arrays = [
            list_array(offsets, col.flat_values(), pa.types.is_large_list(col.type), col.type.value_type)
            for col in cols
        ]
        return pa.Table.from_arrays(arrays, names=names)
    p = plan
    if p.num_rows != table.num_rows:
        raise PackingError(f"the plan has {p.num_rows} rows but the table has {table.num_rows}.")
    bad = np.flatnonzero(lengths != p.row_lengths)
    if bad.size:
        raise PackingError(
            f"row {int(bad[0])} of column {names[0]!r} does not have the length the plan gives it: this plan "
            f"did not make these rows (with shuffle, pass the shuffled plan)."
        )
    if SEQ_LENGTHS in table.column_names:
        column = table.column(SEQ_LENGTHS)
        if not column.equals(pa.chunked_array([p.seq_lengths]).cast(column.type)):
            raise PackingError(
                "the table's seq_lengths differ from the plan's: this plan did not make these rows."
            )
    # Segment k of the packed stream sits at seg_dest[k]; sort segments back by (source, start).
    order = np.lexsort((p.seg_start, p.seg_source))
    kept = np.bincount(p.seg_source, weights=p.seg_length, minlength=p.num_sequences).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(kept)))
    src, size = p.seg_dest[order], p.seg_length[order]
    dest = offsets_of(size)[:-1]
    arrays = []
    for col in cols:
        flat = col.flat_values()
        out = buffers.empty(int(offsets[-1]), flat.dtype)
        kernels.copy_all_segments(flat, src, size, dest, out)
        arrays.append(list_array(offsets, out, pa.types.is_large_list(col.type), col.type.value_type))
    return pa.Table.from_arrays(arrays, names=names)


def truncate_table(table: pa.Table, max_length: int, columns: Sequence[str] | None = None) -> pa.Table:
    """Keep the first ``max_length`` values of each row of the list columns (all of them, or those named).

    >>> import pyarrow as pa
    >>> truncate_table(pa.table({"input_ids": [[1, 2, 3], [4]], "id": [0, 1]}), 2).to_pydict()
    {'input_ids': [[1, 2], [4]], 'id': [0, 1]}
    """
    max_length = check_max_length(max_length)
    if media := [c for c in (*VIDEO_COLUMNS, *AUDIO_COLUMNS) if c in table.column_names]:
        raise PackingError(
            f"truncate_table (truncate_dataset): the rows hold video or audio column(s) {media}, which truncation "
            f"cannot keep with their samples: cut to max_length={max_length} values they lose frames or feature-mask positions (and "
            f"named out of columns=, their placeholder tokens are cut apart from them), with no error. packtools "
            f"packs images only: remove the video or audio samples (their columns and placeholder tokens) first.",
            param="columns",
        )
    if SEQ_LENGTHS in table.column_names:
        raise PackingError(
            f"the table has a {SEQ_LENGTHS!r} column, so its rows are packed: truncating them would cut "
            f"sequences and leave seq_lengths wrong. Truncate before packing (pack_table/pack_dataset keep "
            f"the first max_length tokens of each sequence with strategy='bfd')."
        )
    if columns is None:
        names = [f.name for f in table.schema if is_list_type(f.type)]
    else:
        names = _select_columns(table, columns)
        bad = [n for n in names if not is_list_type(table.schema.field(n).type)]
        if bad:
            raise PackingError(
                f"columns {bad} are not list columns and cannot be truncated.", param="columns"
            )
    names = _vision_safe_truncation(table, names, max_length, named=columns is not None)
    for n in names:
        i = table.column_names.index(n)
        table = table.set_column(i, table.schema.field(n), pc.list_slice(table.column(n), 0, max_length))
    return table


def _vision_safe_truncation(table: pa.Table, names: list[str], max_length: int, named: bool) -> list[str]:
    """The columns to truncate in a table of processed vision-language rows: never the per-sample image columns
    (:data:`~packtools.constants.IMAGE_COLUMNS`: cut to ``max_length`` patches or grids, their pixels no longer
    match their grids), and nothing at all where a token column is longer than ``max_length`` (the cut would part
    images from their placeholder tokens): a vision sample is never truncated, as ``pack_dataset`` never does."""
    images = [c for c in IMAGE_COLUMNS if c in table.column_names]
    if not images:
        return names
    if named and (cut := [n for n in names if n in IMAGE_COLUMNS]):
        raise PackingError(
            f"columns={names} names the per-sample image column(s) {cut}: they hold patches or grids, not one "
            f"value per token, and cut to max_length={max_length} they no longer match their images. Name the "
            f"token columns only.",
            param="columns",
        )
    names = [n for n in names if n not in IMAGE_COLUMNS]
    for n in names:
        lengths = column_lengths(table.column(n))
        over = np.flatnonzero(lengths > max_length)
        if over.size:
            row = int(over[0])
            raise PackingError(
                f"row {row} holds {int(lengths[row])} values in {n!r}, over max_length={max_length}, and these are "
                f"vision-language rows ({images}): truncated, a sample would keep images whose placeholder "
                f"tokens were cut (or the reverse). Vision samples are never truncated: filter out the samples "
                f"longer than max_length (ds.filter(lambda r: len(r['input_ids']) <= {max_length})), or raise "
                f"max_length (packtools.profile_lengths counts image tokens; docs/vision.md).",
                param="max_length",
            )
    return names


def warmup() -> None:
    """Compile (or load from the on-disk cache) every kernel on a tiny input."""
    table = pa.table({"input_ids": pa.array([[1, 2, 3], [], [4]], pa.list_(pa.int32()))})
    with warnings.catch_warnings():  # its row cut short and its empty row are on purpose
        warnings.simplefilter("ignore", TokensDroppedWarning)
        warnings.simplefilter("ignore", EmptyRowsWarning)
        for strategy in STRATEGIES:
            pack_table(table, 2, strategy)
    # The plan check and the packed-view kernels, with the argument types their callers pass.
    p = make_plan(np.array([3, 0, 1], np.int64), 2, "bfd_split")
    kernels.plan_violation(p.seg_source, p.seg_start, p.seg_length, p.row_offsets, p.source_lengths, 2)
    one = np.zeros(1, np.int64)
    rows = np.array([0], np.int64)
    kernels.view_segments(
        rows, p.row_offsets, p.seg_source, p.seg_start, p.seg_length, False, one, one, one, one, one, 1
    )
    for source, out in ((np.int32, np.int32), (np.int32, np.int64), (np.int64, np.int64)):
        kernels.gather_scattered(np.ones(4, source), one, one + 1, one, np.empty(1, out))
    kernels.balance_pairs(np.ones((1, 2), np.int64), np.array([0, 1], np.int64))  # the CP layout's
