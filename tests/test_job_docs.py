"""The job pages (docs/jobs/*.md) start with code that works: their first Python block runs as written, and the
multi-GPU page's script trains under ``accelerate launch`` with 2 CPU processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import _launch
import pytest

JOBS = Path(__file__).parents[1] / "docs" / "jobs"
PAGES = [
    "pack.md",
    "max-length.md",
    "train-sft.md",
    "train-dpo.md",
    "train-reward.md",
    "train-grpo.md",
    "multi-gpu.md",
]


def blocks(page: str, lang: str = "python") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (JOBS / page).read_text(), flags=re.S)


def test_every_job_page_starts_with_code():
    assert sorted(p.name for p in JOBS.glob("*.md")) == sorted(PAGES)
    for page in PAGES:
        text = (JOBS / page).read_text()
        first = text.split("\n", 2)[2].lstrip()  # after the title
        assert first.startswith("```python") or first.startswith("Save the training script"), page


@pytest.mark.parametrize("page", ["pack.md", "max-length.md"])
def test_first_block_runs(page, capsys):
    exec(compile(blocks(page)[0], page, "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    if page == "pack.md":
        assert out.strip() == "2 [[6, 2], [3, 1]]"


@pytest.mark.slow
@pytest.mark.parametrize("page", ["train-sft.md", "train-dpo.md", "train-reward.md"])
def test_training_pages_run(page, tmp_path, monkeypatch, capsys):
    """Every Python block of the page, in order, in one namespace, as written (a CPU machine: TRL's bf16
    default must not stop them). The DPO page's last block trains on a real ``packtools pack`` output."""
    pytest.importorskip("transformers")
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    for i, block in enumerate(blocks(page)):
        if 'load_from_disk("packed")' in block:
            pack_preference_file(namespace["tok"], tmp_path)
        exec(compile(block, f"{page} block {i}", "exec"), namespace)
        if i == 0:
            out = capsys.readouterr().out.strip().splitlines()[-1]
            if page == "train-reward.md":
                assert out == "[[7, 5, 5, 4], [3, 5, 4, 4]]"  # four pairs packed whole into two rows
                assert namespace["trainer"].state.global_step == 2  # and trained on, prepared
            else:
                assert out == "torch.Size([2, 2])" if page == "train-dpo.md" else 3.0 < float(out) < 5.0
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 2  # the last block trained
    if page == "train-reward.md":
        assert type(trainer).__name__ == "PackedRewardTrainer"
    assert len(blocks(page)) == {"train-sft.md": 2, "train-dpo.md": 3, "train-reward.md": 2}[page]


def pack_preference_file(tok, folder: Path) -> None:
    """``packtools pack prefs.jsonl --tokenizer DIR --out packed`` as the DPO page's "Prepare the data" says."""
    import json

    from packtools.cli.main import main

    tok.save_pretrained(folder / "tok")
    rows = [{"prompt": "w2 w3 w4", "chosen": " w7 w8", "rejected": " w12"}] * 4
    (folder / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["pack", "prefs.jsonl", "--tokenizer", "tok", "--out", "packed", "--max-length", "64"]
    assert main(argv) == 0


@pytest.mark.slow
def test_grpo_page_runs_and_trains_through_packtools(tmp_path, monkeypatch, capsys):
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "__main__"}
    exec(compile(blocks("train-grpo.md")[0], "train-grpo.md", "exec"), scope)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "PackedGRPOTrainer 3"
    assert any(line.startswith("prompt-shared rows") and "share_prompt='auto'" in line for line in out)
    assert all("loss" in log for log in scope["trainer"].state.log_history[:2])


@pytest.mark.slow
def test_multi_gpu_page_runs_under_accelerate_launch_on_two_cpu_processes(tmp_path):
    pytest.importorskip("accelerate")
    script = tmp_path / "train.py"
    script.write_text(blocks("multi-gpu.md")[0])
    import socket

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    # Known flake, not packtools': on the 2-core CI machine a gloo worker sometimes dies with SIGABRT
    # ("terminate called without an active exception", torch's C++ side) in this launch; seen in 3 of ~10 runs
    # of the whole slow set, never alone (twice in a row once, in CI). Up to three launches; a third failure fails the test.
    for _attempt in range(3):
        with (
            socket.socket() as sock
        ):  # a free port: another launch (a parallel test run) may hold the default
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        config = blocks("multi-gpu.md", "yaml")[0].replace("num_processes: 8", "num_processes: 2")
        config += f"use_cpu: true\nmain_process_port: {port}\n"
        assert "distributed_type: MULTI_GPU" in config
        (tmp_path / "accelerate.yaml").write_text(config)
        with _launch.launch_lock():  # never alongside another multi-process job of the run (tests/_launch.py)
            run = subprocess.run(
                [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                 str(tmp_path / "accelerate.yaml"), str(script), str(tmp_path / "out")],
                capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
            )  # fmt: skip
        if run.returncode == 0 or "terminate called without an active exception" not in run.stderr:
            break
    assert run.returncode == 0, run.stderr[-3000:]
    # each rank's line is one write; the two processes' writes may interleave with other output
    ranks = sorted(re.findall(r"rank (\d) losses (\[[^\]]*\])", run.stdout))
    assert [r for r, _ in ranks] == ["0", "1"], run.stdout
    assert ranks[0][1] == ranks[1][1]  # one loss for the step, on both ranks
