"""Offline packing of TRL-format vision samples (pack_vision_files): packed ids and pixels equal the
processor's per sample, crash-safe like text (a rerun after SIGKILL gives the same bytes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _vl_models import IMAGE, processor_folder, tiny_vl

from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError
from packtools.integrations.multimodal.processor import load_vision_processor, process_vision_sample
from packtools.pipeline.vision import pack_vision_files

datasets = pytest.importorskip("datasets")
Image = pytest.importorskip("PIL.Image")
ROOT = Path(__file__).resolve().parents[1]


def write_samples(folder: Path, n: int, seed: int = 0) -> Path:
    """``n`` JSON lines in TRL's vision format with 0-2 generated images each (relative paths)."""
    rng = np.random.default_rng(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        k = int(rng.integers(0, 3))
        images = []
        for j in range(k):
            h, w = (int(x) for x in rng.choice([28, 56, 84], 2))
            name = f"img/{i}-{j}.png"
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
            images.append(name)
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is this"}]
        messages = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "a " + "cat " * (i % 7)},
        ]
        lines.append(json.dumps({"messages": messages, "images": images}))
    path = folder / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def unpack(row: dict) -> list[dict]:
    out, start, patch, image = [], 0, 0, 0
    for n in row["seq_lengths"]:
        ids = np.asarray(row["input_ids"][start : start + n])
        k = int(np.sum((ids == IMAGE) & ~np.concatenate([[False], ids[:-1] == IMAGE])))
        grid = np.asarray(row["image_grid_thw"][image : image + k], np.int64).reshape(-1, 3)
        p = int(grid.prod(axis=1).sum())
        out.append(
            {
                "input_ids": ids,
                "image_grid_thw": grid,
                "pixel_values": np.asarray(row["pixel_values"][patch : patch + p], np.float32).reshape(
                    p, 1176
                ),
            }
        )
        start, patch, image = start + n, patch + p, image + k
    return out


def _bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_packed_ids_and_pixels_equal_the_processor_per_sample(tmp_path):
    proc = processor_folder(tmp_path / "proc")
    data = write_samples(tmp_path / "in", 40)
    result = pack_vision_files(
        data, tmp_path / "out", processor=proc, max_length=96, block_rows=8, shard_bytes=200_000
    )
    assert result.rows_in == 40 and result.rows_out < 40 and result.images > 0
    packed = datasets.load_from_disk(str(tmp_path / "out"))
    got = [s for row in packed for s in unpack(row)]
    vp = load_vision_processor(proc)
    expected = []
    for line in data.read_text().splitlines():
        row = json.loads(line)
        expected.append(
            process_vision_sample(vp, row["messages"], [str(data.parent / p) for p in row["images"]])
        )
    assert len(got) == len(expected)
    key = lambda s: s["input_ids"].tobytes() + s["pixel_values"].tobytes()  # noqa: E731
    for g, e in zip(sorted(got, key=key), sorted(expected, key=key)):
        assert np.array_equal(g["input_ids"], e["input_ids"])
        assert np.array_equal(g["image_grid_thw"], e["image_grid_thw"])
        assert np.array_equal(g["pixel_values"], e["pixel_values"])
    batch = MultimodalCollator(tiny_vl("qwen2_vl", patch=14), 0)([packed[0], packed[1]])
    assert batch["position_ids"].shape[0] == 4
    with pytest.raises(
        PackingError, match=r"\.jsonl:1: the sample has \d+ tokens .* > max_length=20 .*never truncated"
    ):
        pack_vision_files(data, tmp_path / "out2", processor=proc, max_length=20)
    assert not (tmp_path / "out2").exists()


KILLER = """
import os, signal, sys
from packtools.pipeline import workspace
from packtools.pipeline.vision import pack_vision_files
at = sys.argv[4]
workspace.CHECKPOINT_OBSERVERS.append(lambda name: os.kill(os.getpid(), signal.SIGKILL) if name == at else None)
pack_vision_files(sys.argv[1], sys.argv[2], processor=sys.argv[3], max_length=96, block_rows=8, shard_bytes=200_000)
"""


@pytest.mark.slow
@pytest.mark.parametrize("at", ["stage:3", "write:2", "installed"])
def test_rerun_after_sigkill_is_identical(tmp_path, at):
    proc = processor_folder(tmp_path / "proc")
    data = write_samples(tmp_path / "in", 40)
    clean = pack_vision_files(
        data, tmp_path / "clean", processor=proc, max_length=96, block_rows=8, shard_bytes=200_000
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", KILLER, str(data), str(tmp_path / "out"), proc, at],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    again = pack_vision_files(
        data, tmp_path / "out", processor=proc, max_length=96, block_rows=8, shard_bytes=200_000
    )
    assert _bytes(tmp_path / "out") == _bytes(tmp_path / "clean")
    assert again.rows_out == clean.rows_out
    if at != "installed":
        assert again.reused_blocks >= 3  # finished blocks staged before the kill were kept
    assert not (tmp_path / ".out.packtools").exists()


def test_cli_pack_processor(tmp_path, capsys):
    from packtools.cli.main import main

    proc = processor_folder(tmp_path / "proc")
    data = write_samples(tmp_path / "in", 12)
    assert (
        main(["pack", str(data), "--out", str(tmp_path / "out"), "--processor", proc, "--max-length", "96"])
        == 0
    )
    assert "packed 12 samples" in capsys.readouterr().out
    pack_vision_files(data, tmp_path / "direct", processor=proc, max_length=96)
    assert _bytes(tmp_path / "out") == _bytes(tmp_path / "direct")
    assert (
        main(["pack", str(data), "--out", str(tmp_path / "x"), "--processor", proc, "--strategy", "wrapped"])
        != 0
    )
