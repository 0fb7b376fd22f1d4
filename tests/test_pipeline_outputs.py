"""Never delete what packtools did not write (issue 22 item 4; findings S10, S11, S12, T3, L2, U8).

Each case first shows the user's files survive (the run stops with one line naming the file and the fix), and
where the refusal rests on a check, the same run on packtools' own files goes through (the negative control:
the check is not a blanket refusal)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools import pack_files
from packtools.cli.main import main
from packtools.errors import PackingError
from packtools.pipeline import workspace

MARKER = getattr(workspace, "MARKER", "PACKTOOLS_WORK_FOLDER")  # getattr: the file also runs on old code


@pytest.fixture
def src(tmp_path):
    path = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2, 3], [4, 5], [6]], pa.list_(pa.int32()))}), path)
    return path


def fails(argv: list[str], capsys) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_someone_elses_manifest_json_is_not_ours(tmp_path, src, capsys):
    """S10: a web app's manifest.json does not make its folder a packtools output."""
    web = tmp_path / "webapp"
    web.mkdir()
    (web / "manifest.json").write_text(json.dumps({"name": "My PWA", "start_url": "/"}))
    (web / "index.html").write_text("<html></html>")
    err = fails(["pack", src, "--out", str(web), "--max-length", "8", "--quiet"], capsys)
    assert "(--out)" in err and "packtools did not write" in err and "choose another out" in err
    assert sorted(os.listdir(web)) == ["index.html", "manifest.json"]
    # control: packtools' own output is replaced by a run with other options
    out = str(tmp_path / "out")
    pack_files(src, out, max_length=8)
    assert pack_files(src, out, max_length=16).stats["max_length"] == 16


def test_user_files_inside_an_output_stop_the_rerun(tmp_path, src, capsys):
    """S11: notes and checkpoints put into a packtools output are never deleted by a replacing run."""
    out = tmp_path / "out"
    pack_files(src, str(out), max_length=8)
    before = sorted(os.listdir(out))
    (out / "my_notes.md").write_text("mine")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "step1.bin").write_bytes(b"\1")
    assert pack_files(src, str(out), max_length=8).cached  # a cached rerun deletes nothing: not refused
    err = fails(["pack", src, "--out", str(out), "--max-length", "128", "--quiet"], capsys)
    assert (
        "'checkpoints', 'my_notes.md'" in err and "packtools did not write" in err and "Move them out" in err
    )
    assert (out / "my_notes.md").read_text() == "mine" and (out / "checkpoints" / "step1.bin").exists()
    # control: once they are moved out, the rerun replaces the output
    (out / "my_notes.md").unlink()
    (out / "checkpoints" / "step1.bin").unlink()
    (out / "checkpoints").rmdir()
    assert pack_files(src, str(out), max_length=128).stats["max_length"] == 128
    assert sorted(os.listdir(out)) != [] and len(os.listdir(out)) == len(before)


def test_a_user_folder_named_like_the_work_folder_is_left_alone(tmp_path, src, capsys):
    """S12: only a work folder packtools marked as its own is emptied."""
    mine = tmp_path / ".out.packtools"
    (mine / "build").mkdir(parents=True)
    (mine / "build" / "mine.txt").write_text("mine")
    (mine / "notes.txt").write_text("notes")
    err = fails(["pack", src, "--out", str(tmp_path / "out"), "--max-length", "8", "--quiet"], capsys)
    assert "is not a packtools work folder" in err and MARKER in err and "move or rename it" in err
    assert (mine / "build" / "mine.txt").read_text() == "mine" and (mine / "notes.txt").exists()
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.packtools.lock").exists()
    # control: a work folder a dead packtools run left (marked) is taken over and removed
    (mine / "build" / "mine.txt").unlink()
    (mine / "notes.txt").unlink()
    (mine / MARKER).write_text("")
    (mine / "stage").mkdir()
    pack_files(src, str(tmp_path / "out"), max_length=8)
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "out"]


def test_a_user_file_in_a_marked_work_folder_survives(tmp_path, src):
    """Only what packtools puts in its work folder (stage/, build/, old/, the marker) is removed."""
    root = tmp_path / ".out.packtools"
    root.mkdir()
    (root / MARKER).write_text("")
    (root / "keep.txt").write_text("mine")
    pack_files(src, str(tmp_path / "out"), max_length=8)
    assert sorted(os.listdir(root)) == [MARKER, "keep.txt"]


@pytest.mark.parametrize("what", ["lock is a folder", "work folder is a file"])
def test_lock_or_work_folder_paths_taken_by_something_else(tmp_path, src, capsys, what):
    """T3: one line naming the path and the fix, not IsADirectoryError / NotADirectoryError."""
    if what == "lock is a folder":
        (tmp_path / ".out.packtools.lock").mkdir()
        words = "is a folder, but packtools keeps its lock file there"
    else:
        (tmp_path / ".out.packtools").write_text("x")
        words = "is a file, but packtools keeps its work folder there"
    err = fails(["pack", src, "--out", str(tmp_path / "out"), "--max-length", "8", "--quiet"], capsys)
    assert "(--out)" in err and words in err and "Error:" not in err


def test_an_undeletable_old_output_does_not_fail_the_installed_run(tmp_path, src, monkeypatch, capsys):
    """L2: removing the previous output fails after the new one is installed (``chattr +i``, NFS busy files):
    the run succeeds, says what was left and where; the next run (a cache hit) removes it once it can."""
    out = str(tmp_path / "out")
    pack_files(src, out, max_length=8)
    real_unlink = os.unlink

    def stuck(path, *args, **kwargs):
        if path == "state.json" and kwargs.get("dir_fd") is not None or str(path).endswith("old/state.json"):
            raise PermissionError(1, "Operation not permitted", path)
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", stuck)
    assert main(["pack", src, "--out", out, "--max-length", "16", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert (
        "note: the new output is installed" in err and "could not be deleted" in err and "state.json" in err
    )
    assert json.load(open(os.path.join(out, "manifest.json")))["stats"]["max_length"] == 16
    assert os.path.exists(tmp_path / ".out.packtools" / "old" / "state.json")
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert pack_files(src, out, max_length=16).cached  # the cached rerun tidies what was left
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "out"]


def test_out_inside_an_input_folder_through_a_symlink(tmp_path, capsys):
    """U8: paths are compared by real path."""
    folder = tmp_path / "in"
    folder.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), str(folder / "a.parquet"))
    os.symlink(folder, tmp_path / "link")
    err = fails(
        ["pack", str(folder), "--out", str(tmp_path / "link" / "packed"), "--max-length", "8"], capsys
    )
    assert "inside the input folder" in err and "through a symlink" in err
    assert sorted(os.listdir(folder)) == ["a.parquet"]
    with pytest.raises(PackingError, match="inside the input folder"):
        pack_files(str(folder), str(folder / "packed"), max_length=8)


def _rows(folder: str) -> int:
    return sum(
        pa.ipc.open_stream(os.path.join(folder, f["filename"])).read_all().num_rows for f in _state(folder)
    )


def _state(folder: str) -> list[dict]:
    return json.load(open(os.path.join(folder, "state.json")))["_data_files"]


def test_a_reader_holding_the_old_state_json_never_opens_new_shards(tmp_path):
    """S17: old and new outputs name their shards apart, so a reader that read the old ``state.json`` before a
    replacing run finds its files gone (an error it can retry) instead of reading the new ones (a mix)."""
    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": [[i] * (1 + i % 7) for i in range(400)]}), src)
    out = str(tmp_path / "out")
    pack_files(src, out, max_length=16, shard_tokens=200)
    stale = _state(out)  # what a reader read just before the replacement
    new = pack_files(src, out, max_length=32, shard_tokens=200)
    assert len(stale) == len(_state(out)) > 1  # the same number of shards, so the same names before the fix
    for f in stale:
        assert not os.path.exists(os.path.join(out, f["filename"])), f
    assert _rows(out) == new.stats["rows_out"]


def test_a_concurrent_load_from_disk_sees_the_old_or_the_new_output_whole(tmp_path):
    """S17 through ``datasets``: a thread loops ``load_from_disk`` while runs replace the output; every load
    gives the old or the new rows exactly, or fails (and a retry succeeds); none mixes them."""
    datasets = pytest.importorskip("datasets")
    import threading

    src = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": [[i] * (1 + i % 13) for i in range(3000)]}), src)
    out = str(tmp_path / "out")
    wants = {pack_files(src, out, max_length=m, shard_tokens=500).stats["rows_out"] for m in (16, 32)}
    assert len(wants) == 2
    seen: list[object] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                seen.append(datasets.load_from_disk(out).num_rows)
            except (FileNotFoundError, OSError):
                seen.append("gone")

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for m in (16, 32, 16, 32):
            pack_files(src, out, max_length=m, shard_tokens=500)
    finally:
        stop.set()
        reader.join()
    counts = [n for n in seen if n != "gone"]
    assert counts and set(counts) <= wants, sorted(set(counts) - wants)


@pytest.mark.parametrize("name", ["packed.jsonl", "packed.feather", "packed.json.gz", "train.parquet"])
def test_an_out_named_like_a_data_file_is_refused(tmp_path, src, capsys, name):
    """``packtools pack data/ --out packed.jsonl`` (or .feather, .json.gz; ``pack_files(..., 'train.parquet')``)
    used to write a folder under that file name without a word: the user asked for a file and got a
    save_to_disk folder named like one. Now the run stops naming the folder to give instead, writing nothing."""
    out = str(tmp_path / name)
    with pytest.raises(PackingError, match=r"is named like a \.\w+ file, but the output is a folder") as err:
        pack_files(src, out, max_length=8)
    assert err.value.param == "out"
    if not name.endswith(".parquet"):  # the command packs --out FILE.parquet in memory, as documented
        assert "(--out)" in fails(["pack", src, "--out", out, "--max-length", "8", "--quiet"], capsys)
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]
    # control: a folder name with a dot in it is still a folder name
    assert pack_files(src, str(tmp_path / "packed.v2"), max_length=8).stats["rows_in"] == 3


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_sequences_packed_counts_the_sequences_the_model_sees(tmp_path, strategy):
    """`sequences_packed` counted the input documents under every strategy: under wrapped the model sees each
    packed row as one sequence (no seq_lengths), and a bfd_split piece is a sequence of its own.  Now it counts
    those, and `documents_packed` the documents."""
    import datasets

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": list(range(5 + i))}) + "\n" for i in range(10)))
    out = tmp_path / strategy
    assert (
        main(["pack", str(src), "--out", str(out), "--max-length", "8", "--strategy", strategy, "--quiet"])
        == 0
    )
    stats = json.loads((out / "manifest.json").read_text())["stats"]
    table = datasets.load_from_disk(str(out)).data.table
    if strategy == "wrapped":
        assert "seq_lengths" not in table.column_names
        want = table.num_rows  # 95 tokens in rows of 8: 12 sequences
    else:
        want = len(pa.compute.list_flatten(table.column("seq_lengths")))
    assert stats["sequences_packed"] == want
    assert stats["documents_packed"] == 10
    assert (want > 10) == (strategy != "bfd")


@pytest.mark.parametrize("which", ["data", "dataset_info.json", "state.json"])
def test_a_rerun_rebuilds_an_output_missing_a_file(tmp_path, src, which):
    """A shard (or datasets' state/info file) deleted from an output: the rerun with the same inputs and options
    reported the output done, its stats counting rows that were no longer there; it packs again, and says so."""
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "out"
    first = pack_files(src, str(out), max_length=4, shard_tokens=2)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".arrow"))
    assert len(shards) > 1
    (out / (shards[0] if which == "data" else which)).unlink()
    again = pack_files(src, str(out), max_length=4, shard_tokens=2)
    assert not again.cached and any("packed again" in n for n in again.notes)
    ds = datasets.load_from_disk(str(out))
    assert ds.num_rows == first.stats["rows_out"] and sum(map(len, ds["input_ids"])) == 6
    assert pack_files(src, str(out), max_length=4, shard_tokens=2).cached  # whole again: a rerun does nothing


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, said",
    [
        ("state_garbage", "state.json is damaged"),
        ("state_shape", "state.json is damaged"),
        ("info_garbage", "dataset_info.json is damaged"),
        ("flipped_byte", "is not the bytes that were written (CRC-32 differs)"),
        ("cut_shard", "bytes where"),
    ],
)
def test_a_rerun_rebuilds_a_damaged_output(tmp_path, src, damage, said):
    """A corrupt (not missing) state.json or dataset_info.json, or a shard with a flipped byte or cut short,
    in an output: the rerun with the same inputs and options reported it done (a corrupt state.json counted as
    no data file to look for; shards carried no checksum).  Each shard's size and CRC-32 are recorded in the
    manifest as it is written; the rerun packs again and says why."""
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "out"
    first = pack_files(src, str(out), max_length=4, shard_tokens=2)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".arrow"))
    sums = first.manifest["shards"]
    assert sorted(sums) == shards and all(sums[n][0] == os.path.getsize(out / n) for n in shards)
    if damage == "state_garbage":
        (out / "state.json").write_text('{"_data_files": [')
    elif damage == "state_shape":
        (out / "state.json").write_text("{}")
    elif damage == "info_garbage":
        (out / "dataset_info.json").write_text("\x00" * 8)
    elif damage == "flipped_byte":
        _flip_a_byte(out / shards[1])
    else:
        with open(out / shards[1], "r+b") as fh:
            fh.truncate(os.path.getsize(out / shards[1]) - 3)
    again = pack_files(src, str(out), max_length=4, shard_tokens=2)
    assert not again.cached
    assert any(said in n and "packed again" in n for n in again.notes), again.notes
    ds = datasets.load_from_disk(str(out))
    assert ds.num_rows == first.stats["rows_out"] and sum(map(len, ds["input_ids"])) == 6
    assert again.manifest["shards"] == sums  # the same bytes as the first run wrote
    assert pack_files(src, str(out), max_length=4, shard_tokens=2).cached


def test_a_rerun_into_a_damaged_output_reads_its_shards_once(tmp_path, src, monkeypatch):
    """A rerun into an output with a flipped byte checked the output before taking the lock and again under
    it: every shard's CRC-32 was computed twice (the whole output read twice).  Under the lock it is checked
    again only where another run installed an output meanwhile (the manifest is another file); then a whole
    output installed by that run is taken as it is (cached), as before."""
    import shutil

    from packtools.pipeline import outcheck

    out = tmp_path / "out"
    pack_files(src, str(out), max_length=4, shard_tokens=2)
    shards = sorted(n for n in os.listdir(out) if n.endswith(".arrow"))
    shutil.copytree(out, tmp_path / "whole")
    _flip_a_byte(out / shards[1])
    read: list[str] = []
    real = outcheck.file_crc32
    monkeypatch.setattr(
        outcheck, "file_crc32", lambda path: read.append(os.path.basename(path)) or real(path)
    )
    again = pack_files(src, str(out), max_length=4, shard_tokens=2)
    assert not again.cached and any("CRC-32 differs" in n for n in again.notes), again.notes
    assert sorted(read) == shards, read  # each shard read once
    _flip_a_byte(
        out / shards[1]
    )  # damaged again; another run installs a whole output before the lock is taken
    real_acquire = workspace.Workspace.acquire

    def installed_meanwhile(self):
        shutil.copytree(tmp_path / "whole", tmp_path / "fresh")
        os.replace(out, tmp_path / "old")
        os.replace(tmp_path / "fresh", out)
        return real_acquire(self)

    monkeypatch.setattr(workspace.Workspace, "acquire", installed_meanwhile)
    assert pack_files(src, str(out), max_length=4, shard_tokens=2).cached


def test_shard_folder_records_each_shards_size_and_crc(tmp_path):
    """ShardFolder (the preference and vision writers' shards) records each shard's size and CRC-32 as written."""
    from packtools.pipeline.gather import ShardFolder

    folder = ShardFolder(str(tmp_path))
    table = pa.table({"input_ids": pa.array([[1, 2, 3]], pa.list_(pa.int32()))})
    folder.write(table)
    folder.write(table)
    names = folder.finish(table.schema, "f" * 64)
    import zlib

    for name in names:
        data = (tmp_path / name).read_bytes()
        assert folder.sums[name] == [len(data), zlib.crc32(data)]
