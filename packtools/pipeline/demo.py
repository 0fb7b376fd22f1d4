"""The whole pipeline on a corpus that needs no download: the running interpreter's standard library.

The corpus is every function, method and class of the standard library's ``.py`` files: each source file is
cut before every line that starts a ``def``/``class`` at the top level or one indent in, which gives tens of
thousands of sequences with a long tail (a few huge literals).  Ids are the UTF-8 bytes (a byte-level
vocabulary of 256), or come from a local tokenizer folder.

>>> texts = stdlib_definitions(limit=3)
>>> len(texts) > 3, all(isinstance(t, bytes) for t in texts)
(True, True)
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from .sample import byte_level_table, stdlib_files

_DEFINITION = re.compile(rb"^(?=(?:    )?(?:def |class |async def ))", re.M)


def stdlib_definitions(limit: int | None = None) -> list[bytes]:
    """The sources of the first ``limit`` standard-library files, cut before each top-level or method definition."""
    pieces = []
    for path in stdlib_files(limit):
        with open(path, "rb") as fh:
            data = fh.read()
        bounds = [0] + [m.start() for m in _DEFINITION.finditer(data)] + [len(data)]
        pieces.extend(data[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a)
    return pieces


def _corpus_name(tokenizer: str | None, limit: int | None) -> str:
    """The corpus file's name: what its ids depend on is in it, so a rerun into the same ``out`` after any of
    it changed builds the corpus again instead of packing the ids of the one before: the interpreter's standard
    library, ``limit`` and packtools' code (how the corpus is cut), and with a tokenizer what decides its ids in
    any run (:class:`~packtools.pipeline.tokenizer.spec.IdsSpec`: the tokenizer's files, the engine, the
    libraries' versions), as :func:`tokenized_table` tokenizes."""
    import hashlib
    import json
    import sysconfig

    from ..io.fingerprint import source_hash

    key = [sysconfig.get_paths()["stdlib"], sys.version, str(limit), source_hash()]
    if tokenizer is not None:
        from .tokenizer.fast import AUDIT_RATE
        from .tokenizer.folder import tokenizer_fingerprint
        from .tokenizer.spec import IdsSpec

        spec = IdsSpec.of(tokenizer_fingerprint(tokenizer), "text", True, "auto", "report", AUDIT_RATE)
        key.append(json.dumps(spec.key(), sort_keys=True))
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
    return f"stdlib-{'definitions' if tokenizer is None else 'tokenized'}-{digest}.parquet"


def tokenized_table(texts: list[bytes], tokenizer_dir: str, batch_rows: int = 1000) -> pa.Table:
    """Tokenize ``texts`` (decoded as UTF-8) with the pipeline's batch tokenizer, EOS appended."""
    from .tokenizer.batch import BatchTokenizer

    bt = BatchTokenizer(tokenizer_dir, "text")
    parts = []
    for start in range(0, len(texts), batch_rows):
        chunk = [t.decode("utf-8", errors="replace") for t in texts[start : start + batch_rows]]
        parts.append(bt(pa.table({"text": chunk}), start))
    return pa.concat_tables(parts).combine_chunks()


def run_demo(
    out: str,
    *,
    max_length: int | None = None,
    strategy: str = "bfd_split",
    keep: float = 0.99,
    tokenizer: str | None = None,
    quiet: bool = False,
    echo: Callable[[str], Any] = print,
    limit: int | None = None,
) -> dict[str, Any]:
    """Profile, recommend ``max_length``, compare strategies, plot and pack the stdlib corpus into ``out``.

    The recommendation follows the strategy the corpus is packed with (``bfd_split`` by default: no token is
    dropped): for ``bfd_split`` and ``wrapped`` the sequence rule (the library's default), the smallest
    ``max_length`` that holds ``keep`` of the sequences whole; for ``bfd`` the token rule, the smallest at which
    ``bfd`` keeps ``keep`` of the tokens; both rules are printed side by side.  With ``bfd`` the summary says
    how many tokens it dropped.  Strategies are timed after the kernels are compiled (the compile time is
    printed apart).

    Writes ``out/corpus/stdlib-*.parquet`` (kept between runs; named by what decides its ids: the interpreter,
    ``limit``, packtools' code, the tokenizer and the libraries that tokenize), ``out/lengths.png`` (with matplotlib) and ``out/packed`` (a ``datasets.load_from_disk`` folder).  Returns what it printed, as data.
    ``limit`` takes only the first source files (for quick checks).
    """
    from ..core.pack import warmup
    from ..core.plan import STRATEGIES, plan
    from ..io.files import write_table
    from ..profiling.profile import profile_lengths
    from .config import PipelineConfig
    from .run import run_pipeline
    from .summary import format_pipeline_summary, format_summary

    started = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    corpus = os.path.join(out, "corpus", _corpus_name(tokenizer, limit))
    what = "byte-level ids" if tokenizer is None else f"tokenizer {tokenizer}"
    if os.path.exists(corpus):  # kept from an earlier run with the same interpreter, tokenizer and limit
        import pyarrow.parquet as pq

        table = pq.read_table(corpus)
    else:
        texts = stdlib_definitions(limit)
        table = byte_level_table(texts) if tokenizer is None else tokenized_table(texts, tokenizer)
        write_table(table, corpus)
    name = f"standard library definitions ({what})"
    profile = profile_lengths(table, name=name)
    echo(profile.to_text())
    if strategy == "bfd":
        rec = profile.recommend(keep_tokens=keep)
    else:
        rec = profile.recommend(keep_sequences=keep)
    echo("\n" + rec.to_text())
    chosen = max_length if max_length is not None else rec.max_length
    if max_length is not None:
        echo(f"chosen: --max-length {chosen:,}")
    lengths = profile.lengths
    t0 = time.perf_counter()
    warmup()  # compile (or load) the kernels first, so the timings below are the strategies' own
    echo(f"\nkernels compiled or loaded in {time.perf_counter() - t0:.2f} s (not in the strategy timings)")
    results = []
    for s in STRATEGIES:
        t = time.perf_counter()
        p = plan(lengths, chosen, s)
        results.append((p, time.perf_counter() - t))
    echo("\n" + format_summary(results))
    plot_path = os.path.join(out, "lengths.png")
    try:
        from ..profiling.plot import profile_figure, save_figure

        # candidates around the bulk of the distribution rather than up to its longest outlier
        candidates = sorted({1 << k for k in range(8, 17)} | {chosen})
        save_figure(profile_figure(profile, candidates, max_length=chosen), plot_path)
        echo(f"\nwrote the length plot to {plot_path}")
    except ImportError as exc:
        plot_path = None
        echo(f"\nno plot: {exc}")
    import warnings

    from ..integrations.data.drops import TokensDroppedWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TokensDroppedWarning)  # the note below says it, in the demo's words
        res = run_pipeline(
            [corpus],
            os.path.join(out, "packed"),
            PipelineConfig(max_length=chosen, strategy=strategy),
            quiet=quiet,
        )
    echo("\n" + format_pipeline_summary(res.stats, res.out, res.cached, res.timings))
    if res.stats.get("tokens_dropped"):
        share = res.stats["tokens_dropped"] / max(1, res.stats["tokens_in"])
        echo(
            f"\nnote: {strategy} at max_length={chosen:,} dropped {res.stats['tokens_dropped']:,} tokens "
            f"({100 * share:.2f}% of the corpus, the ends of sequences longer than max_length); "
            f"--strategy bfd_split keeps every token."
        )
    echo(
        f"\ndemo done in {time.perf_counter() - started:.1f} s; load it with datasets.load_from_disk({res.out!r})"
    )
    return {
        "profile": profile,
        "recommendation": rec,
        "max_length": chosen,
        "plans": [p for p, _ in results],
        "plot": plot_path,
        "packed": res,
    }
