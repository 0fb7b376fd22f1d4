"""Finding the input files of the offline pipeline: files, folders (searched recursively, sorted) and
``datasets`` ``save_to_disk`` folders, with every entry of a folder either read or listed as skipped, and why.

>>> import os, tempfile, pyarrow as pa, pyarrow.parquet as pq
>>> d = tempfile.mkdtemp()
>>> pq.write_table(pa.table({"text": ["a"]}), os.path.join(d, "part.parquet"))
>>> open(os.path.join(d, "notes.txt"), "w").close()
>>> files, skipped = find_inputs([d])
>>> [os.path.basename(f.path) for f in files], [s.reason for s in skipped]
(['part.parquet'], ['not a data file (.txt)'])
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from ..compat.datasets import STATE_FILE, saved_data_files
from ..errors import PackingError

SUFFIX_KINDS = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}


@dataclass(frozen=True)
class InputFile:
    """One input file: its absolute path, reader kind (``json``, ``parquet``, ``arrow``), size, mtime, inode
    and ctime."""

    path: str
    kind: str
    size: int
    mtime_ns: int
    ino: int
    ctime_ns: int

    def fingerprint(self) -> dict[str, object]:
        """``{"path", "size", "mtime_ns", "ino", "ctime_ns"}`` of the file, taken when it was found.  The inode
        and the status-change time are there because size and mtime alone miss a file rewritten with its old
        mtime put back (``cp -p``, ``rsync -a``, ``tar x``, ``touch -d``: the same size after a one-byte fix
        or a swapped pair): the kernel sets ctime to now on every write and ``utime`` call, and a file moved
        into place has another inode, so such a file is a miss, never a stale hit."""
        return {
            "path": self.path,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ino": self.ino,
            "ctime_ns": self.ctime_ns,
        }


def input_file_of(path: str, kind: str, st: os.stat_result | None = None) -> InputFile:
    """The :class:`InputFile` of ``path`` (absolute path, every field taken) from its ``os.stat`` result, taken
    here when not given."""
    st = os.stat(path) if st is None else st
    return InputFile(os.path.abspath(path), kind, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def _input_file(path: str) -> InputFile:
    kind = SUFFIX_KINDS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise PackingError(
            f"input {path!r}: unknown file type; give .jsonl/.json, .parquet, .arrow/.feather files, "
            f"directories of them, or a datasets save_to_disk folder."
        )
    st = os.stat(path)
    # a folder here: one a save_to_disk folder's state.json names (find_inputs walks the folders it is given)
    if stat.S_ISDIR(st.st_mode):
        raise PackingError(
            f"input {path!r} is a folder, but its save_to_disk folder's {STATE_FILE} lists it as a data file; "
            f"the saved dataset is damaged: save it again, or pass its data files."
        )
    if not stat.S_ISREG(st.st_mode):
        raise PackingError(_not_a_file(path))
    return input_file_of(path, kind, st)


def _not_a_file(path: str) -> str:
    return (
        f"input {path!r} is not a regular file or folder (a pipe, socket or device); packtools needs a file it "
        f"can size, fingerprint by size and time, and read again (a resumed or restaged part), so write the "
        f"stream to a file and pass that file."
    )


#: Compression suffixes: a data file compressed with one is refused (packtools reads files uncompressed), never
#: skipped, since a folder of mixed plain and compressed shards would otherwise lose the compressed ones.
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip", ".br", ".snappy")
#: JSON files that a data folder often holds beside its data and that are not data (dataset cards, configs,
#: datasets' and packtools' own metadata): skipped in a folder (read when named as an input).
METADATA_JSON = frozenset(
    {
        "meta.json",
        "metadata.json",
        "info.json",
        "config.json",
        "manifest.json",
        "state.json",
        "dataset_info.json",
        "dataset_infos.json",
        "dataset_dict.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    }
)


@dataclass(frozen=True)
class Skipped:
    """A path under an input folder that the run does not read, and why (reported in the summary and the
    manifest: nothing in an input folder is left out without a word)."""

    path: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason}


def discover(inputs: Sequence[str | os.PathLike[str]]) -> list[InputFile]:
    """Expand inputs (files, directories, ``save_to_disk`` folders) into a sorted list of files."""
    return find_inputs(inputs)[0]


def find_inputs(inputs: Sequence[str | os.PathLike[str]]) -> tuple[list[InputFile], list[Skipped]]:
    """The input files (in order: inputs as given, each folder's files sorted, searched recursively) and what
    was skipped, with the reason.

    The rules, one way each: a folder's hidden entries (``.name``), files without a data suffix and known
    metadata JSON (:data:`METADATA_JSON`) are skipped and listed; a compressed data file (``x.jsonl.gz``) stops
    the run; symlinked sub-folders are followed (a folder reached twice, e.g. through a loop, is read once and
    the repeat listed); a file reached twice (named twice, a file and its folder, or through a symlink: the
    same real path) is read once and the repeat listed; a ``save_to_disk`` folder inside an input folder stops
    the run (pass one split); a cache folder (one holding ``CACHEDIR.TAG``, as packtools' stage cache does) is
    skipped and listed, or refused when named as the input.
    """
    files: list[InputFile] = []
    skipped: list[Skipped] = []
    for item in inputs:
        path = os.fspath(item)
        if not os.path.exists(path):
            raise FileNotFoundError(f"input {path!r} does not exist.")
        if os.path.isfile(path):
            _refuse_compressed(path)
            files.append(_input_file(path))
        elif not os.path.isdir(path):
            raise PackingError(_not_a_file(path))
        elif os.path.exists(os.path.join(path, "state.json")):
            files.extend(_input_file(os.path.join(path, name)) for name in saved_data_files(path))
        elif os.path.exists(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
            raise PackingError(
                f"input {path!r} is a saved DatasetDict with splits {splits}; pass one split folder, "
                f"e.g. {os.path.join(path, splits[0] if splits else 'train')!r}."
            )
        elif os.path.exists(os.path.join(path, CACHEDIR_TAG)):
            raise PackingError(
                f"input {path!r} is a cache folder ({CACHEDIR_TAG}, e.g. packtools' stage cache), not data; "
                f"pass the data files or their folder."
            )
        else:
            found = _walk(path, skipped)
            if not found:
                raise PackingError(
                    f"input directory {path!r} holds no .jsonl/.json/.parquet/.arrow/.feather file"
                    + (
                        f" (skipped: {', '.join(os.path.basename(s.path) for s in skipped[:5])})"
                        if skipped
                        else ""
                    )
                    + "."
                )
            files.extend(found)
    seen: dict[str, str] = {}
    unique = []
    for f in files:
        real = os.path.realpath(f.path)
        if real in seen:
            skipped.append(Skipped(f.path, f"the same file as {seen[real]!r} (read once)"))
            continue
        seen[real] = f.path
        unique.append(f)
    if not unique:
        raise PackingError("no input given; name files, directories or save_to_disk folders.")
    return unique, skipped


def skipped_notes(skipped: Sequence[Skipped]) -> list[str]:
    """One line telling the user what the run did not read, and why (empty when it read everything)."""
    if not skipped:
        return []
    shown = "; ".join(f"{s.path} ({s.reason})" for s in skipped[:10])
    more = (
        f"; and {len(skipped) - 10} more (all in manifest.json, inputs_skipped)" if len(skipped) > 10 else ""
    )
    return [f"not read: {len(skipped)} path(s) under the inputs: {shown}{more}."]


def _refuse_compressed(path: str) -> None:
    stem, last = os.path.splitext(path)
    if last.lower() in COMPRESSED and os.path.splitext(stem)[1].lower() in SUFFIX_KINDS:
        raise PackingError(
            f"input {path!r} is compressed ({last}), and packtools reads data files uncompressed; decompress it "
            f"(e.g. gunzip / zstd -d) and pass the result, or move it out of the input folder."
        )


#: the Cache Directory Tagging Specification's file: a folder holding it (the stage cache writes one) is a cache,
#: never read as input
CACHEDIR_TAG = "CACHEDIR.TAG"


def _walk(top: str, skipped: list[Skipped]) -> list[InputFile]:
    found: list[InputFile] = []
    visited = {os.path.realpath(top)}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        keep = []
        for d in sorted(dirnames):
            full = os.path.join(dirpath, d)
            real = os.path.realpath(full)
            if d.startswith("."):
                skipped.append(Skipped(full, "hidden folder"))
            elif real in visited:
                skipped.append(Skipped(full, f"a symlink to a folder already read ({real!r})"))
            elif os.path.exists(os.path.join(full, CACHEDIR_TAG)):
                skipped.append(Skipped(full, f"a cache folder ({CACHEDIR_TAG}), e.g. packtools' stage cache"))
            elif os.path.exists(os.path.join(full, "state.json")) or os.path.exists(
                os.path.join(full, "dataset_dict.json")
            ):
                raise PackingError(
                    f"input folder {top!r} holds the saved dataset {full!r} (a datasets save_to_disk folder, e.g. "
                    f"one split of a DatasetDict); pass that folder (one split) as the input, not the folder "
                    f"above it."
                )
            else:
                visited.add(real)
                keep.append(d)
        dirnames[:] = keep
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            suffix = os.path.splitext(name)[1].lower()
            if name.startswith("."):
                skipped.append(Skipped(full, "hidden file"))
            elif suffix not in SUFFIX_KINDS:
                _refuse_compressed(full)
                skipped.append(Skipped(full, f"not a data file ({suffix or 'no suffix'})"))
            elif name.lower() in METADATA_JSON:
                skipped.append(Skipped(full, "a metadata file, not data (name it as an input to read it)"))
            else:
                found.append(_input_file(full))
    return found
