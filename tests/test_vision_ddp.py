"""Packed vision-language training under 2 processes (torchrun, gloo, CPU) equals the samples run one by one."""

from __future__ import annotations

from pathlib import Path

import _launch
import numpy as np
import pytest
from _vl_models import IMAGE, tiny_vl, torch
from test_vision_refusals import IMAGE as GEMMA3_IMAGE

pytest.importorskip("datasets")
ROOT = Path(__file__).resolve().parents[1]


def _split(row: dict) -> list[dict]:
    """A packed row back into its samples (images in row order), with plain Python."""
    out, start, patch, image = [], 0, 0, 0
    for n in row["seq_lengths"]:
        ids = row["input_ids"][start : start + n]
        k = sum(1 for i in range(n) if ids[i] == IMAGE and (i == 0 or ids[i - 1] != IMAGE))
        grid = np.asarray(row["image_grid_thw"][image : image + k], np.int64).reshape(-1, 3)
        p = int(grid.prod(axis=1).sum())
        sample = {"input_ids": ids}
        if k:
            sample["pixel_values"] = np.asarray(row["pixel_values"][patch : patch + p], np.float32)
            sample["image_grid_thw"] = grid
        out.append(sample)
        start, patch, image = start + n, patch + p, image + k
    return out


def _split_flat(row: dict) -> list[dict]:
    """A packed Gemma 3 row back into its samples: each run of image tokens is one image (4 tokens, between
    <boi> and <eoi>), its pixels the next of the row's images."""
    out, start, image = [], 0, 0
    for n in row["seq_lengths"]:
        ids = row["input_ids"][start : start + n]
        k = sum(1 for i in range(n) if ids[i] == GEMMA3_IMAGE and (i == 0 or ids[i - 1] != GEMMA3_IMAGE))
        sample = {"input_ids": ids}
        if k:
            sample["pixel_values"] = np.asarray(row["pixel_values"][image : image + k], np.float32).tolist()
        out.append(sample)
        start, image = start + n, image + k
    return out


# Every family's 2-process run, one after the other in one torchrun launch (each a new model and Trainer): the
# launch's start (two interpreters importing torch and transformers) is paid once for the module's five cases.
# packtools_sdpa last: it registers an attention implementation in the processes.
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3-sdpa", "gemma3-packtools_sdpa"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vision-ddp")
    _launch.torchrun(
        2, "_vision_ddp_worker.py", str(out), ",".join(FAMILIES), log=out / "torchrun.log", timeout=900
    )
    return out


def _run_workers(family: str, runs: Path) -> list[dict]:
    return [torch.load(runs / family / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _first_rows(ranks: list[dict]) -> list[dict]:
    rows = [row for res in ranks for row in res["batches"][0]]  # the first step's micro-batch of each rank
    assert len(rows) >= 2 and len({str(r["input_ids"]) for r in rows}) == len(rows)  # no row repeated
    return rows


@pytest.mark.slow
@pytest.mark.xdist_group("vision_ddp")  # one worker: the module's one launch serves the five cases
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_two_processes_equal_one_by_one(family, ddp_runs):
    from test_vision_train import one_by_one

    ranks = _run_workers(family, ddp_runs)
    samples = [s for row in _first_rows(ranks) for s in _split(row)]
    assert sum("pixel_values" in s for s in samples) >= 2 and any("pixel_values" not in s for s in samples)
    _, grads = one_by_one(tiny_vl(family, "sdpa"), samples)
    for res in ranks:
        diff = max(float((res["delta"][k] - g).abs().max()) for k, g in grads.items())
        assert diff < 1e-5


@pytest.mark.slow
@pytest.mark.xdist_group("vision_ddp")
@pytest.mark.parametrize("impl", ["sdpa", "packtools_sdpa"])
def test_gemma3_two_processes_equal_one_by_one(impl, ddp_runs):
    # Gemma 3 (flat image runs, bidirectional image blocks, a sliding layer shorter than the documents) under
    # DDP: dense masks on sdpa, per-document masks on packtools_sdpa; each rank's step equals one process running
    # both ranks' samples one by one
    from test_vision_gemma3 import one_by_one
    from test_vision_refusals import tiny_gemma3

    ranks = _run_workers(f"gemma3-{impl}", ddp_runs)
    rows = _first_rows(ranks)
    samples = [s for row in rows for s in _split_flat(row)]
    assert sum("pixel_values" in s for s in samples) >= 2 and any(len(r["seq_lengths"]) > 1 for r in rows)
    _, grads = one_by_one(tiny_gemma3("sdpa"), samples)
    assert any("vision_tower" in k and float(g.abs().max()) > 0 for k, g in grads.items())
    for res in ranks:
        diff = max(float((res["delta"][k] - g).abs().max()) for k, g in grads.items())
        assert diff < 1e-5
