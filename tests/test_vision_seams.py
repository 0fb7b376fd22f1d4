"""Vision-language seams that dropped data silently (review of issues 30 and 33): every column reaches the
model or stops the run, on the multimodal collator, the Arrow loader, ``pack --processor`` and the offline
vision pipeline."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from packtools.batches.mrope import MropeSpec
from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError

SPEC = MropeSpec("qwen2_vl", image_token_id=9, video_token_id=8, spatial_merge_size=2)


def _row(**extra):
    row = {
        "input_ids": [1, 9, 2, 3, 4],
        "seq_lengths": [3, 2],
        "image_grid_thw": [[1, 2, 2]],
        "pixel_values": np.zeros((4, 6), np.float32),
    }
    return {**row, **extra}


@pytest.mark.parametrize("column", ["pixel_values_videos", "video_grid_thw", "second_per_grid_ts"])
def test_multimodal_collator_refuses_video_columns_by_name(column):
    collator = MultimodalCollator(SPEC, 0, return_tensors="np")
    with pytest.raises(PackingError, match=rf"video column\(s\) \['{column}'\]"):
        collator([_row(**{column: [[1.0]]})])
    # listed in leave_out, a video is still refused: its tokens would train without its frames
    with pytest.raises(PackingError, match="video column"):
        collator.replace(leave_out=[column])([_row(**{column: [[1.0]]})])


def test_multimodal_collator_refuses_video_tokens_by_name():
    with pytest.raises(PackingError, match=r"row 0: document 0 holds video tokens \(id 8\)"):
        MultimodalCollator(SPEC, 0, return_tensors="np")([_row(input_ids=[1, 8, 2, 3, 9], seq_lengths=[5])])


def test_multimodal_collator_refuses_a_column_it_does_not_carry():
    collator = MultimodalCollator(SPEC, 0, return_tensors="np")
    with pytest.raises(PackingError, match=r"\['id'\], which MultimodalCollator.*leave_out=\['id'\]") as err:
        collator([_row(id=7)])
    assert err.value.param == "leave_out"
    told = collator.replace(leave_out=["id"])
    assert told.options()["leave_out"] == frozenset({"id"})
    got, plain = told([_row(id=7)]), collator([_row()])
    assert set(got) == set(plain) and all(np.array_equal(got[k], plain[k]) for k in got)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_multimodal_collator_refuses_pixels_of_another_patch_size(family):
    # rows processed with a 14-pixel-patch processor (1176 values per patch) trained on a model whose vision
    # tower reads another patch size: transformers crashed deep in its vision tower ("The size of tensor a
    # (6272) must match ...") with no word of the cause; the collator names it
    pytest.importorskip("transformers")
    from packtools.testing import IMAGE, tiny_vl_config

    config = tiny_vl_config(family)
    vision = config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    row = {"input_ids": [1, IMAGE, 2], "seq_lengths": [3], "image_grid_thw": [[1, 2, 2]]}
    collator = MultimodalCollator(config, 0, return_tensors="np")
    batch = collator([{**row, "pixel_values": np.zeros((4, width), np.float32)}])
    assert batch["pixel_values"].shape == (4, width)
    with pytest.raises(
        PackingError, match=rf"row 0: 'pixel_values' has 1176 values per patch but .* reads {width}"
    ):
        collator([{**row, "pixel_values": np.zeros((4, 3 * 2 * 14 * 14), np.float32)}])
    # kept through options() / replace()
    with pytest.raises(PackingError, match="values per patch"):
        collator.replace(leave_out=["id"])([{**row, "pixel_values": np.zeros((4, 1176), np.float32)}])


# -- the Arrow loader: PackedRows / ArrowCollator ------------------------------------------------------------


def test_packed_rows_refuses_image_columns_and_names_the_multimodal_collator():
    import pyarrow as pa

    from packtools import PaddingFreeCollator
    from packtools.batches.loader import ArrowCollator, PackedRows

    table = pa.table(
        {
            "input_ids": [[1, 9, 2, 3, 4]],
            "seq_lengths": [[3, 2]],
            "pixel_values": [[[0.0] * 6] * 4],
            "image_grid_thw": [[[1, 2, 2]]],
        }
    )
    with pytest.raises(
        PackingError, match=r"image column\(s\) \['image_grid_thw', 'pixel_values'\].*Multimodal"
    ):
        PackedRows(table)
    # named in leave_out they were dropped, the image placeholder tokens kept with no pixels, no error
    with pytest.raises(PackingError, match=r"image column\(s\).*even with leave_out=.*placeholder tokens"):
        PackedRows(table, leave_out=["pixel_values", "image_grid_thw"])
    # an ordinary extra column: refused by name unless left out, then the batch is that of the token columns
    ids = table.select(["input_ids", "seq_lengths"]).append_column("id", pa.array([7]))
    with pytest.raises(PackingError, match=r"\['id'\].*PackedRows\(\.\.\., leave_out=\['id'\]\)") as err:
        PackedRows(ids)
    assert err.value.param == "leave_out"
    collator = PaddingFreeCollator(0, return_tensors="np")
    got = ArrowCollator(PackedRows(ids, leave_out=["id"]), collator)([0])
    want = collator([{"input_ids": [1, 9, 2, 3, 4], "seq_lengths": [3, 2]}])
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)


def test_packed_rows_refuses_a_padding_attention_mask():
    import pyarrow as pa

    from packtools.batches.loader import PackedRows

    PackedRows(pa.table({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}))
    with pytest.raises(PackingError, match="'attention_mask' has values other than 1"):
        PackedRows(pa.table({"input_ids": [[1, 2], [3, 0]], "attention_mask": [[1, 1], [1, 0]]}))


def test_arrow_collator_refuses_a_view_column_the_batch_does_not_carry():
    import pyarrow as pa

    from packtools import PaddingFreeCollator
    from packtools.batches.loader import ArrowCollator
    from packtools.batches.view import PackedView

    table = pa.table({"input_ids": [[1, 2], [3, 4, 5]], "token_type_ids": [[0, 0], [1, 1, 1]]})
    view = PackedView.from_table(table, 8)
    with pytest.raises(PackingError, match=r"\['token_type_ids'\].*leave_out=\['token_type_ids'\]"):
        ArrowCollator(view, PaddingFreeCollator(0, return_tensors="np"))
    told = ArrowCollator(view, PaddingFreeCollator(0, return_tensors="np", leave_out=["token_type_ids"]))
    plain = PackedView.from_table(table.select(["input_ids"]), 8)
    got, want = told(view.__getitems__([0])), ArrowCollator(plain, told.collator)(plain.__getitems__([0]))
    assert all(np.array_equal(got[k], want[k]) for k in want)


# -- the offline vision pipeline: pack_vision_files ------------------------------------------------------------


def _files(tmp_path, n=12):
    pytest.importorskip("PIL.Image")
    from _vl_models import processor_folder
    from test_vision_files import write_samples

    return processor_folder(tmp_path / "proc"), write_samples(tmp_path / "in", n)


def test_pack_vision_files_never_deletes_a_folder_it_did_not_write(tmp_path):
    from packtools.pipeline.vision import pack_vision_files

    proc, data = _files(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(PackingError, match="is not a packtools output"):
        pack_vision_files(data, theirs, processor=proc, max_length=96)
    assert (theirs / "notes.txt").read_text() == "mine"
    # an output folder that holds its input: refused, the input untouched
    with pytest.raises(PackingError, match="contains the input"):
        pack_vision_files(data, data.parent, processor=proc, max_length=96)
    assert data.exists() and (data.parent / "img").is_dir()
    # a packtools output with a file added to it: not replaced by a run with another configuration
    out = tmp_path / "out"
    pack_vision_files(data, out, processor=proc, max_length=96)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(PackingError, match="'notes.txt', which packtools did not write"):
        pack_vision_files(data, out, processor=proc, max_length=64)
    assert (out / "notes.txt").read_text() == "mine"


def test_pack_vision_files_fingerprints_the_whole_configuration(tmp_path):
    import json

    from packtools.pipeline.vision import pack_vision_files

    proc, data = _files(tmp_path, 24)
    out = tmp_path / "out"
    first = pack_vision_files(data, out, processor=proc, max_length=96, block_rows=8)
    seen = {json.loads((out / "manifest.json").read_text())["fingerprint"]}
    for change in (
        {"max_length": 128},
        {"shuffle": True},
        {"shuffle": True, "seed": 1},
        {"shard_bytes": 1000},
    ):
        args = {"max_length": 96, "block_rows": 8, **change}
        result = pack_vision_files(data, out, processor=proc, **args)
        m = json.loads((out / "manifest.json").read_text())
        assert m["fingerprint"] not in seen, change
        assert all(m["config"][k] == v for k, v in change.items())
        assert not result.cached, change
        seen.add(m["fingerprint"])
    assert (
        pack_vision_files(data, out, processor=proc, max_length=128, block_rows=8).rows_out < first.rows_out
    )
    # the same configuration again: the output is kept as it is
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = pack_vision_files(data, out, processor=proc, max_length=128, block_rows=8)
    assert again.cached and not first.cached and again.staged_blocks == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_stage_key_follows_the_processor_content_and_the_code(tmp_path, monkeypatch):
    from packtools.pipeline import vision_stage

    proc, data = _files(tmp_path, 2)
    key = vision_stage.stage_key(proc, [str(data)], 8, 1176)
    assert vision_stage.stage_key(proc, [str(data)], 8, 1176) == key
    config = tmp_path / "proc" / "preprocessor_config.json"
    stat = config.stat()
    body = json.loads(config.read_text())
    config.write_text(json.dumps({**body, "max_pixels": int(body.get("max_pixels", 1 << 20)) + 1}))
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same mtime: the content decides
    changed = vision_stage.stage_key(proc, [str(data)], 8, 1176)
    assert changed != key
    (tmp_path / "proc" / "model.safetensors").write_bytes(b"weights do not decide the pixels")
    assert vision_stage.stage_key(proc, [str(data)], 8, 1176) == changed
    # a block staged with a row key left out is never reused by a run that would refuse that key
    assert vision_stage.stage_key(proc, [str(data)], 8, 1176, ["tools"]) != changed
    monkeypatch.setattr(vision_stage, "source_hash", lambda: "other code")
    assert vision_stage.stage_key(proc, [str(data)], 8, 1176) != changed
    monkeypatch.undo()
    monkeypatch.setattr(vision_stage, "_pixel_versions", lambda: {"transformers": "0"})
    assert vision_stage.stage_key(proc, [str(data)], 8, 1176) != changed


def test_a_damaged_staged_block_is_staged_again(tmp_path):
    import pyarrow as pa

    from packtools.pipeline import vision_stage

    target = str(tmp_path / "vision-x-00000-000000.arrow")
    table = pa.table({"input_ids": pa.array([[1, 2, 3]], pa.list_(pa.int32()))})
    vision_stage.write_block(target, table)
    assert vision_stage.block_damage(target) is None
    raw = bytearray(open(target, "rb").read())
    raw[-12] ^= 0xFF  # same size, other bytes
    open(target, "wb").write(bytes(raw))
    assert "checksum differs" in vision_stage.block_damage(target)
    open(target, "wb").write(bytes(raw[:-8]))
    assert "cut" in vision_stage.block_damage(target)
    os.unlink(vision_stage.sidecar(target))
    assert "no readable sidecar" in vision_stage.block_damage(target)


KILL_AT_STAGE = """
import os, signal, sys
from packtools.pipeline import workspace
from packtools.pipeline.vision import pack_vision_files
workspace.CHECKPOINT_OBSERVERS.append(lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == "stage:3" else None)
pack_vision_files(sys.argv[1], sys.argv[2], processor=sys.argv[3], max_length=96, block_rows=8)
"""


@pytest.mark.slow
def test_rerun_after_a_kill_restages_a_damaged_block(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from packtools.pipeline.vision import pack_vision_files

    proc, data = _files(tmp_path, 40)
    clean = pack_vision_files(data, tmp_path / "clean", processor=proc, max_length=96, block_rows=8)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    args = [sys.executable, "-c", KILL_AT_STAGE, str(data), str(tmp_path / "out"), proc]
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    stage = tmp_path / ".out.packtools" / "stage"
    blocks = sorted(stage.glob("vision-*.arrow"))
    assert len(blocks) == 3
    raw = bytearray(blocks[1].read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a bit flipped inside the second block's data
    blocks[1].write_bytes(bytes(raw))
    again = pack_vision_files(data, tmp_path / "out", processor=proc, max_length=96, block_rows=8)
    assert again.reused_blocks == 2 and again.staged_blocks == clean.staged_blocks
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()
    }


def test_unknown_row_keys_are_refused_by_name(tmp_path):
    from packtools.pipeline.vision import pack_vision_files

    proc, data = _files(tmp_path, 4)
    lines = data.read_text().splitlines()
    row = json.loads(lines[2])
    lines[2] = json.dumps({**row, "tools": [{"type": "function", "function": {"name": "f"}}]})
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(PackingError, match=r"data.jsonl:3: the row has the key\(s\) \['tools'\]") as err:
        pack_vision_files(data, tmp_path / "out", processor=proc, max_length=96)
    assert err.value.param == "leave_out"
    assert not (tmp_path / "out").exists()
    told = pack_vision_files(data, tmp_path / "out", processor=proc, max_length=96, leave_out=["tools"])
    assert told.rows_in == 4


def test_process_vision_dataset_refuses_other_columns_by_name(tmp_path):
    datasets = pytest.importorskip("datasets")
    from packtools.integrations.multimodal.processor import process_vision_dataset

    proc, data = _files(tmp_path, 3)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for r in rows:
        r["images"] = [str(data.parent / p) for p in r["images"]]
        r["id"] = "x"
        for m in r["messages"]:  # one content type per column (Arrow)
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    ds = datasets.Dataset.from_list(rows)
    with pytest.raises(PackingError, match=r"column\(s\) \['id'\].*leave_out=\['id'\]"):
        process_vision_dataset(ds, proc)
    done = process_vision_dataset(ds, proc, leave_out=["id"])
    assert "id" not in done.column_names and len(done) == 3


# -- the CLI: pack --processor -----------------------------------------------------------------------------------

TEXT_ONLY = [
    (["--tokenizer", "tok"], "--tokenizer"),
    (["--format", "messages"], "--format"),
    (["--no-eos"], "--no-eos"),
    (["--columns", "input_ids"], "--columns"),
    (["--overlong", "drop"], "--overlong"),
    (["--drop-unlabeled"], "--drop-unlabeled"),
    (["--keep-unlabeled"], "--keep-unlabeled"),
    (["--split-at", "tokens"], "--split-at"),
    (["--plan", "shards"], "--plan"),
    (["--part-rows", "10"], "--part-rows"),
    (["--shard-tokens", "10"], "--shard-tokens"),
    (["--max-prompt-length", "10"], "--max-prompt-length"),
    (["--tokenizer-engine", "fast"], "--tokenizer-engine"),
    (["--tokenizer-audit", "1"], "--tokenizer-audit"),
    (["--on-unencodable", "error"], "--on-unencodable"),
    (["--executor", "pool"], "--executor"),
    (["--workers", "2"], "--workers"),
    (["--num-proc", "2"], "--num-proc"),
    (["--address", "ray://x"], "--address"),
    (["--retries", "0"], "--retries"),
]


@pytest.mark.parametrize("flags, name", TEXT_ONLY, ids=[n for _, n in TEXT_ONLY])
def test_pack_processor_refuses_text_only_options_by_name(tmp_path, capsys, monkeypatch, flags, name):
    from packtools.cli.main import main
    from packtools.pipeline import vision

    called = []
    monkeypatch.setattr(vision, "pack_vision_files", lambda *a, **k: called.append(1))
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    argv = ["pack", str(data), "--out", str(tmp_path / "out"), "--processor", str(tmp_path)]
    assert main([*argv, *flags]) != 0
    err = capsys.readouterr().err
    assert f"{name}: not used with --processor" in err, err
    assert not called
    # the options --processor reads pass the check (and reach pack_vision_files)
    done = vision.VisionPackResult(str(tmp_path / "out"), 1, 1, 0, 5, 1, 0)
    monkeypatch.setattr(vision, "pack_vision_files", lambda *a, **k: called.append(k) or done)
    assert main([*argv, "--max-length", "64", "--shuffle", "--seed", "3", "--executor", "local"]) == 0
    assert called == [{"processor": str(tmp_path), "max_length": 64, "shuffle": True, "seed": 3}]


def _processed_rows():
    """Processed vision-language samples (token ids with image placeholders, patches, grids), as a table."""
    pa = pytest.importorskip("pyarrow")
    rows = [
        {"input_ids": [1, 9, 2, 3], "pixel_values": np.ones((4, 6)).tolist(), "image_grid_thw": [[1, 2, 2]]},
        {"input_ids": [4, 5, 6], "pixel_values": [], "image_grid_thw": []},
        {"input_ids": [7, 9, 9, 8], "pixel_values": np.ones((8, 6)).tolist(), "image_grid_thw": [[1, 2, 4]]},
    ]
    return pa.Table.from_pylist(rows)


def test_token_column_paths_refuse_vision_rows_whatever_columns_say():
    """packed_view(columns=['input_ids']) planned the token column alone, and its materialize() went through
    pack_split(plan=...), which skipped the vision path: rows whose image placeholders kept no pixels, no error
    (pack_dataset refuses the same columns=; docs/vision.md says packed_view refuses multimodal rows)."""
    datasets = pytest.importorskip("datasets")
    from packtools import packed_view, plan
    from packtools.integrations.data.datasets import pack_split

    table = _processed_rows()
    ds = datasets.Dataset(table)
    with pytest.raises(
        PackingError, match=r"packed_view plans token columns only.*\['pixel_values', 'image_grid_thw'\]"
    ):
        packed_view(ds, 16, columns=["input_ids"])
    with pytest.raises(PackingError, match="packed_view plans token columns only"):
        packed_view(table, 16, columns=["input_ids"])
    p = plan([4, 3, 4], 16)
    with pytest.raises(PackingError, match=r"pack_split\(plan=...\)"):
        pack_split(ds, 16, "bfd", ["input_ids"], shuffle=False, seed=0, keep_in_memory=True, plan=p)


@pytest.mark.parametrize("columns", [None, ["input_ids"]])
def test_pack_files_refuses_processed_vision_rows(tmp_path, columns):
    """The text pipeline left pixel_values / image_grid_thw out as 'other columns' (listed in the summary only):
    packed rows with image placeholder tokens and no pixels. Named token columns (columns=['input_ids'],
    --columns) left them out with no error either ('knowingly'), the same change to the training data;
    pack_dataset and packed_view refuse it. Now refused whatever columns= says, naming the columns and the fix."""
    pq = pytest.importorskip("pyarrow.parquet")
    from packtools import pack_files

    path = str(tmp_path / "rows.parquet")
    pq.write_table(_processed_rows(), path)
    match = r"rows.parquet' holds processed vision-language rows \(\['pixel_values', 'image_grid_thw'\]\).*"
    match += r"pack_dataset.*remove .* and their placeholder tokens"
    with pytest.raises(PackingError, match=match):
        pack_files([path], str(tmp_path / "out"), max_length=16, columns=columns)
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_cli_pack_columns_refuses_processed_vision_rows(tmp_path, capsys):
    """packtools pack --columns input_ids on processed vision rows wrote packed rows without their images (the
    placeholder tokens kept, no pixels), exit 0; in memory (--out FILE) and to a folder alike."""
    pq = pytest.importorskip("pyarrow.parquet")
    from packtools.cli.main import main

    path = str(tmp_path / "rows.parquet")
    pq.write_table(_processed_rows(), path)
    for out in (str(tmp_path / "packed.parquet"), str(tmp_path / "out")):
        argv = ["pack", path, "--format", "tokenized", "--max-length", "16", "--columns", "input_ids"]
        assert main([*argv, "--out", out]) != 0
        assert "vision-language rows" in capsys.readouterr().err
        assert not os.path.isfile(out) and not os.path.exists(os.path.join(out, "manifest.json"))


@pytest.mark.parametrize("columns", [None, ["input_ids"]])
def test_pack_table_refuses_processed_vision_rows(columns):
    """pack_table(columns=['input_ids']) packed the token column and left pixel_values / image_grid_thw out, no
    error: each image's placeholder tokens in input_ids with no pixels. (columns=None was refused, advising to
    name the token columns.) Refused now, naming the columns and the fix."""
    from packtools import pack_table

    with pytest.raises(
        PackingError,
        match=r"pack_table plans token columns only.*\['pixel_values', 'image_grid_thw'\].*pack_dataset.*"
        r"placeholder tokens",
    ):
        pack_table(_processed_rows(), 16, columns=columns)


@pytest.mark.parametrize("columns", [None, ["input_ids"]])
def test_streamed_vision_rows_of_unknown_features_are_refused(columns):
    """An IterableDataset whose features are unknown (from_generator, or after map) has no column names to check
    up front: pack_dataset(columns=['input_ids']) packed its tokens window by window and left pixel_values /
    image_grid_thw out, image placeholders without pixels, no error (the error for columns=None even advised
    naming the token columns). A Dataset, or an IterableDataset with known features, is refused."""
    datasets = pytest.importorskip("datasets")
    from packtools import pack_dataset

    rows = [r for r in _processed_rows().to_pylist() if r["image_grid_thw"]]  # (an empty list infers no type)
    ds = datasets.IterableDataset.from_generator(lambda: iter(rows))
    assert ds.column_names is None  # the case: nothing to check before the first window
    with pytest.raises(PackingError, match="IterableDataset with image columns"):
        list(pack_dataset(ds, 16, columns=columns))


def test_truncate_dataset_never_cuts_vision_samples():
    """truncate_dataset cut every list column: pixel_values to max_length patches while image_grid_thw still
    announced them all (no warning when input_ids fit: no token was dropped), and input_ids through an image's
    placeholder tokens while its pixels stayed. Image columns are never cut; a token column over max_length is
    refused by row."""
    datasets = pytest.importorskip("datasets")
    from packtools.integrations import truncate_dataset

    ds = datasets.Dataset(_processed_rows())  # 4, 3, 4 tokens; 4, 0, 8 patches
    kept = truncate_dataset(ds, 5)
    assert kept["pixel_values"] == ds["pixel_values"] and kept["image_grid_thw"] == ds["image_grid_thw"]
    assert kept["input_ids"] == ds["input_ids"]
    for columns in (None, ["input_ids"]):
        with pytest.raises(PackingError, match=r"row 0 holds 4 values in 'input_ids', over max_length=3"):
            truncate_dataset(ds, 3, columns=columns)
    with pytest.raises(PackingError, match=r"names the per-sample image column\(s\) \['pixel_values'\]"):
        truncate_dataset(ds, 5, columns=["input_ids", "pixel_values"])


def _video_rows():
    """Processed video rows (a Qwen2-VL processor's video columns) beside their token columns."""
    import pyarrow as pa

    return pa.table(
        {
            "input_ids": [[1, 9, 9, 2], [3, 9, 4]],
            "labels": [[1, 9, 9, 2], [3, 9, 4]],
            "pixel_values_videos": [[[0.1, 0.2]] * 4, [[0.3, 0.4]] * 4],
            "video_grid_thw": [[[1, 2, 2]], [[1, 2, 2]]],
        }
    )


_VIDEO = r"video column\(s\) \['pixel_values_videos', 'video_grid_thw'\].*placeholder tokens.*pixels"


def test_text_collators_refuse_video_columns_even_in_leave_out():
    """leave_out=['pixel_values_videos', 'video_grid_thw'] on PaddingFreeCollator / PackedRows dropped the videos
    with no error, each video's placeholder tokens training without pixels (img49 refused this for images only)."""
    from packtools import PaddingFreeCollator
    from packtools.batches import PackedRows

    table = _video_rows()
    video = ["pixel_values_videos", "video_grid_thw"]
    rows = [dict(r, seq_lengths=[len(r["input_ids"])]) for r in table.to_pylist()]
    with pytest.raises(PackingError, match="row 0 has the " + _VIDEO):
        PaddingFreeCollator(0, leave_out=video)(rows)
    with pytest.raises(PackingError, match="the data has the " + _VIDEO):
        PackedRows(table, leave_out=video)
    # a non-pixel column listed in leave_out is still left out knowingly (a text dataset's own video_metadata too)
    text = {"input_ids": [1, 9, 9, 2], "seq_lengths": [4], "source": "web", "video_metadata": "yt:1"}
    kept = PaddingFreeCollator(0, leave_out=["source", "video_metadata"])([text])
    assert kept["input_ids"].tolist() == [[1, 9, 9, 2]]


@pytest.mark.parametrize("columns", [None, ["input_ids", "labels"]])
def test_packing_paths_refuse_video_columns(tmp_path, columns):
    """Named token columns (columns=['input_ids', ...]) packed the tokens and left pixel_values_videos /
    video_grid_thw out with no error in pack_table, pack_dataset, packed_view and a streamed IterableDataset:
    the videos' placeholder tokens kept without pixels. Refused now whatever columns= says."""
    datasets = pytest.importorskip("datasets")
    from packtools import pack_dataset, pack_table
    from packtools.integrations.data.views import packed_view

    table = _video_rows()
    ds = datasets.Dataset(table)
    with pytest.raises(PackingError, match="pack_table: the rows hold " + _VIDEO):
        pack_table(table, 8, columns=columns)
    with pytest.raises(PackingError, match="pack_dataset: the rows hold " + _VIDEO):
        pack_dataset(ds, 8, columns=columns)
    with pytest.raises(PackingError, match="packed_view: the rows hold " + _VIDEO):
        packed_view(ds, 8, columns=columns)
    stream = datasets.IterableDataset.from_generator(lambda: iter(table.to_pylist()))
    with pytest.raises(PackingError, match=_VIDEO):
        list(pack_dataset(stream, 8, columns=columns))
    # images and videos in one row: the image path (columns naming the image columns) dropped the videos
    both = table.append_column("pixel_values", pa_list([[[0.5, 0.6]] * 4] * 2))
    both = both.append_column("image_grid_thw", pa_list([[[1, 2, 2]]] * 2))
    names = ["input_ids", "labels", "pixel_values", "image_grid_thw"]
    with pytest.raises(PackingError, match=_VIDEO):
        pack_dataset(datasets.Dataset(both), 8, columns=names)


def pa_list(values):
    import pyarrow as pa

    return pa.array(values)


@pytest.mark.parametrize("columns", [None, ["input_ids"]])
def test_pack_files_refuses_video_columns(tmp_path, columns):
    """pack_files(columns=['input_ids']) / packtools pack --columns packed tokenized video rows without their
    videos (placeholder tokens kept, no pixels), no error."""
    pq = pytest.importorskip("pyarrow.parquet")
    from packtools import pack_files

    path = str(tmp_path / "rows.parquet")
    pq.write_table(_video_rows(), path)
    with pytest.raises(PackingError, match="rows.parquet'.*" + _VIDEO):
        pack_files([path], str(tmp_path / "out"), max_length=16, columns=columns)
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


@pytest.mark.parametrize(
    "pixels",
    [("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")],
    ids=["images", "videos"],
)
@pytest.mark.parametrize("where", ["train", "eval"])
def test_prepare_trainer_refuses_pixel_columns_for_a_text_model(tmp_path, pixels, where):
    """A text model's Trainer (remove_unused_columns=True, the default) dropped pixel_values / image_grid_thw (or the
    video columns) before PaddingFreeCollator saw the rows: prepare_trainer passed and the batches trained the
    placeholder tokens without pixels, no error. Refused by name now; the same rows without them still pass."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    from _hf_models import tiny_llama

    from packtools import PaddingFreeCollator, prepare_trainer

    text = {"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "seq_lengths": [[4], [3]]}
    rows = {**text, pixels[0]: [[[0.1]], [[0.2]]], pixels[1]: [[[1, 1, 1]], [[1, 1, 1]]]}

    def trainer(train, evaluation=None):
        args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
        return transformers.Trainer(
            tiny_llama(), args=args, train_dataset=datasets.Dataset.from_dict(train),
            eval_dataset=None if evaluation is None else datasets.Dataset.from_dict(evaluation),
            data_collator=PaddingFreeCollator(0),
        )  # fmt: skip

    given = trainer(rows) if where == "train" else trainer(text, rows)
    with pytest.raises(
        PackingError, match=rf"the {where}_dataset holds the image/video column\(s\) \['{pixels[0]}'"
    ):
        prepare_trainer(given)
    prepare_trainer(trainer(text, text))
