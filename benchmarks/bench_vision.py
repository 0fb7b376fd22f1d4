"""``bench_vision.py``: offline packing of generated vision-language samples, peak memory and time.

Usage: ``python benchmarks/bench_vision.py [--samples 10000] [--max-length 2048] [--work DIR]``

Generates ``--samples`` JSON lines in TRL's vision format (0-3 PNG images of 28-224 pixels a side each, random
text) and a Qwen2-VL processor folder built offline (the PIL image processor from its defaults, a word-level
tokenizer with the vision tokens; ``packtools.testing.tiny_processor``), then runs ``packtools pack --processor`` on them in
a fresh process and prints its wall time, its peak RSS (``ru_maxrss`` of the child), the staged and packed
sizes on disk, and the same for an in-memory ``datasets`` pipeline (``process_vision_dataset`` +
``pack_dataset``) on the same samples, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def generate(folder: Path, n: int, seed: int = 0) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    with open(folder / "data.jsonl", "w") as fh:
        for i in range(n):
            images = []
            for j in range(int(rng.integers(0, 4))):
                h, w = (int(x) for x in rng.integers(28, 225, 2))
                name = f"img/{i}-{j}.png"
                Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
                images.append(name)
            words = " ".join(f"w{int(t)}" for t in rng.integers(0, 100, int(rng.integers(5, 200))))
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": words}]
            messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "a cat"}]
            fh.write(json.dumps({"messages": messages, "images": images}) + "\n")
    return folder / "data.jsonl"


PEAK = "import atexit, resource; atexit.register(lambda: print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))\n"


def child(code: str, *argv: str) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB, the child's own ``ru_maxrss``) of ``python -c code argv...``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", PEAK + code, *argv], env=env, check=True, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    peak = next(int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("PEAK_KB"))
    return wall, peak / 1024


OFFLINE = """
import sys
from packtools.cli.main import main
sys.exit(main(["pack", sys.argv[1], "--out", sys.argv[2], "--processor", sys.argv[3], "--max-length", sys.argv[4]]))
"""
IN_MEMORY = """
import sys, datasets
from packtools import pack_dataset
rows = datasets.load_dataset("json", data_files=sys.argv[1], split="train", keep_in_memory=True)
base = sys.argv[1].rsplit("/", 1)[0]
rows = rows.map(lambda r: {"images": [base + "/" + p for p in r["images"]]}, keep_in_memory=True)
packed = pack_dataset(rows, int(sys.argv[4]), processor=sys.argv[3])
packed.save_to_disk(sys.argv[2])
print(len(packed), "rows")
"""


def size(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--work", default=None)
    ap.add_argument("--skip-in-memory", action="store_true")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-vision-"))
    from packtools.testing import tiny_processor

    proc = tiny_processor(str(work / "proc"))
    data = generate(work / "in", a.samples)
    rows = [("packtools pack --processor (out of core)", OFFLINE, work / "out")]
    if not a.skip_in_memory:
        rows.append(("process_vision_dataset + pack_dataset (in memory)", IN_MEMORY, work / "mem"))
    print(
        f"{a.samples} samples, images {size(work / 'in' / 'img'):.0f} MiB of PNG, max_length {a.max_length}"
    )
    print(f"{'run':52s} {'wall s':>8s} {'peak RSS MiB':>13s} {'output MiB':>11s}")
    for name, code, out in rows:
        wall, peak = child(code, str(data), str(out), proc, str(a.max_length))
        print(f"{name:52s} {wall:8.1f} {peak:13.0f} {size(out):11.0f}")


if __name__ == "__main__":
    main()
