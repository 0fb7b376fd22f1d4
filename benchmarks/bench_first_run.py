"""One first run of ``run_pipeline`` (empty ``PACKTOOLS_CACHE_DIR``), in this process, and what it cost.

Usage::

    PYTHONPATH=TREE python benchmarks/bench_first_run.py DOCS.jsonl TOKENIZER_DIR

Prints one JSON line: the wall time from the process start, the run's ``tokenizer_load_s``, the CPU seconds of this
process and of its waited-for children, the peak RSS of each (GiB), and whether torch was imported here.  Run it
alternately for two trees (``PYTHONPATH``) to compare a first run's fixed costs (docs/tokenize.md, issue 42).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
import warnings

T0 = time.perf_counter()


def main() -> None:
    warnings.simplefilter("ignore")
    os.environ["PACKTOOLS_CACHE_DIR"] = cache = tempfile.mkdtemp(prefix="packtools-first-cache-")
    out = os.path.join(tempfile.mkdtemp(prefix="packtools-first-out-"), "out")
    from packtools.pipeline.config import PipelineConfig
    from packtools.pipeline.run import run_pipeline

    try:
        res = run_pipeline([sys.argv[1]], out, PipelineConfig(max_length=2048, tokenizer=sys.argv[2]))
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        print(json.dumps({"wall_s": round(time.perf_counter() - T0, 2), "tokenizer_load_s": res.timings["tokenizer_load_s"],
                          "cpu_s": round(me.ru_utime + me.ru_stime, 2), "cpu_children_s": round(kids.ru_utime + kids.ru_stime, 2),
                          "rss_gib": round(me.ru_maxrss / 2**20, 3), "children_rss_gib": round(kids.ru_maxrss / 2**20, 3),
                          "torch_imported": "torch" in sys.modules}))  # fmt: skip
    finally:
        shutil.rmtree(os.path.dirname(out), ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
