"""Which decoder architectures keep packed sequences apart, with which attention backend: the compatibility matrix.

Usage::

    python benchmarks/model_matrix.py                 # every architecture x sdpa, eager, flex_attention, packtools_sdpa
    python benchmarks/model_matrix.py --write docs/models.md
    python benchmarks/model_matrix.py --archs llama gpt2 --backends sdpa

Each architecture is a tiny model of :mod:`packtools.testing` (:data:`~packtools.testing.FAMILIES`: 2 or 3
layers, hidden size 32, random float32 weights; sliding windows and attention chunks of 4 tokens so they matter on short sequences), changed as
``prepare_trainer`` changes it (token-mixing layers per document, :mod:`packtools.integrations.attention.mixers`; the
guard).  Each cell runs
:func:`packtools.integrations.check_isolation` with ``backward=True``: four sequences (5, 9, 3 and 7 tokens) packed into
two rows by ``PaddingFreeCollator`` and passed as :func:`packtools.prepare_trainer` would (keys filtered to
the model's ``forward``, ``use_cache=False``, no ``attention_mask``), against each sequence run alone --
logits, summed loss and parameter gradients, tolerance 1e-5 -- plus a check that changing one sequence does
not move the others; then DPO's sequence log-probabilities and their gradients through the padding-free
forward of ``prepare_dpo_trainer`` (:func:`dpo_check`).  For the exact cells it then finds the fewest keys that keep them exact (``position_ids``
alone, then with ``cu_seq_lens``/``max_length``, then with ``seq_idx``).

A cell is one of: ``exact`` (logits, loss and gradients), ``exact (forward)`` (torch has no backward for
this kernel on CPU, and raises), ``refused`` (packtools raises PackingError before any training step: the
probe measured a leak, or transformers refused the packed batch), ``n/a`` (transformers itself does not
offer this backend for this architecture).  A cell that leaked without an error would be ``SILENT LEAK``;
the script exits with status 1 if any cell is.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packtools.testing import FAMILIES, Family, tiny_model

BACKENDS = ("sdpa", "eager", "flex_attention", "packtools_sdpa")
#: Relative tolerance of every comparison (logits, loss, gradients, DPO log-probabilities), float32.
TOLERANCE = 1e-5
FAST = ("Llama", "GPT-2", "Falcon-H1", "Qwen3.5", "GPT-OSS")  # the subset the default test run covers
#: Collator switches tried, fewest keys first, to find what an exact cell needs.
NEEDS = (
    ("position_ids", {"return_flash_attn_kwargs": False, "return_seq_idx": False}),
    ("position_ids, cu_seq_lens", {"return_seq_idx": False}),
    ("position_ids, cu_seq_lens, seq_idx", {}),
)


@dataclass(frozen=True)
class Cell:
    arch: str
    backend: str
    status: str
    needs: str
    max_diff: float | None
    detail: str
    dpo: str = ""
    dpo_diff: float | None = None

    @property
    def silent(self) -> bool:
        return self.status == "SILENT LEAK"


def default_backends() -> tuple[str, ...]:
    """The CPU backends, plus ``flash_attention_2`` when a GPU and flash-attn are there."""
    import importlib.util

    import torch

    gpu = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
    return BACKENDS + (("flash_attention_2",) if gpu else ())


def _short(err: Exception) -> str:
    text = str(err).split("\n")[0]
    return text if len(text) < 220 else text[:217] + "..."


def _refusal(arch: Family, backend: str, err: Exception) -> str:
    """Why a cell is refused; for layers that mix tokens outside attention, also what they leak unguarded."""
    from packtools import PaddingFreeCollator
    from packtools.integrations import check_isolation
    from packtools.integrations.attention.backends import token_mixing_layers

    model = tiny_model(arch, backend)
    mixers = token_mixing_layers(model)
    if not mixers:
        return _short(err)
    position_only = PaddingFreeCollator(0, return_seq_idx=False, return_flash_attn_kwargs=False)
    leak = check_isolation(model, position_only, raise_on_leak=False)
    return (
        f"layers {', '.join(mixers)} mix tokens outside attention. With seq_idx/cu_seq_lens transformers' "
        f"CPU fallback refuses the batch (it needs the CUDA kernels); without them they leak "
        f"({leak.max_diff:.0e} measured, unguarded) and packtools refuses."
    )


def prepared_model(arch: Family, backend: str, *, dpo: bool = False) -> Any:
    """A tiny model changed as ``prepare_trainer`` (``dpo=True``: ``prepare_dpo_trainer``) changes it: token-mixing
    layers per document (:mod:`packtools.integrations.attention.mixers`), the guard; for DPO, TRL's fused head and
    packtools' padding-free forward."""
    from packtools.integrations.attention.backends import check_attention_implementation
    from packtools.integrations.attention.mixers import run_mixers_per_document
    from packtools.integrations.trainers.guard import guard_model

    model = tiny_model(arch, backend)
    check_attention_implementation(model)
    if dpo:
        from trl.trainer.utils import add_fused_lm_head

        from packtools.integrations.preference.dpo import install_padding_free_forward

        add_fused_lm_head(model)
        run_mixers_per_document(model)
        install_padding_free_forward(model)
    else:
        run_mixers_per_document(model)
    guard_model(model, check_isolation=False)  # as prepare_trainer: the cells run the probe themselves
    return model


def dpo_check(
    arch: Family, backend: str, lengths: tuple[int, ...] = (5, 9, 3, 7)
) -> tuple[str, float | None]:
    """DPO's sequence log-probabilities through the padding-free forward ``prepare_dpo_trainer`` installs: the
    sequences as TRL's padded batch (flattened to one row by packtools) against each alone, the summed
    log-probabilities and their gradients (relative to ``max(1, largest |gradient|)``); ``("exact", diff)``
    when both are within :data:`TOLERANCE`, ``("refused: <why>", None)`` when packtools refuses (its DPO probe, as
    ``prepare_dpo_trainer`` runs it, or the fused head TRL cannot run), else ``("LEAKS", diff)``."""
    import torch

    from packtools import PackingError
    from packtools.integrations.attention.isolation import translate
    from packtools.integrations.preference.probe import check_padding_free_forward

    try:
        model = prepared_model(arch, backend, dpo=True)
        check_padding_free_forward(model)
    except PackingError as err:
        return f"refused: {_short(err)}", None
    except ValueError as err:  # transformers' own refusal of seq_idx / cu_seq_lens without the kernels
        if translate(err, arch.model, backend) is None:
            raise
        return "refused", None
    except AttributeError as err:  # TRL's fused LM head does not know the model's outputs (e.g. Llama 4)
        return f"n/a (TRL: {_short(err)})", None
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    params = [p for p in model.parameters() if p.requires_grad]
    model.eval()

    def run(i: Any, m: Any, lab: Any) -> tuple[Any, tuple[Any, ...]]:
        out = model(input_ids=i, attention_mask=m, labels=lab, fused_lm_head=True, use_cache=False)
        logps = (out.log_probs * m[:, 1:]).sum(-1)
        return logps.detach(), torch.autograd.grad(logps.sum(), params, allow_unused=True)

    packed, packed_grads = run(ids, mask, labels)
    alone_grads: list[Any] = [None] * len(params)
    worst = 0.0
    for i, n in enumerate(lengths):
        logps, grads = run(ids[i : i + 1, :n], mask[i : i + 1, :n], labels[i : i + 1, :n])
        worst = max(worst, abs(float(packed[i] - logps[0])) / max(1.0, abs(float(logps[0]))))
        alone_grads = [g if a is None else (a if g is None else a + g) for a, g in zip(alone_grads, grads)]
    diff, scale = 0.0, 1.0
    for a, b in zip(packed_grads, alone_grads):
        if a is None or b is None:
            continue
        diff, scale = max(diff, float((a - b).abs().max())), max(scale, float(b.abs().max()))
    worst = max(worst, diff / scale)
    return ("exact" if worst <= TOLERANCE else "LEAKS"), worst


def run_cell(arch: Family, backend: str) -> Cell:
    from packtools import PackingError, PaddingFreeCollator
    from packtools.integrations import check_isolation

    try:
        tiny_model(arch, backend)
    except (ValueError, ImportError, RuntimeError, AssertionError) as err:
        return Cell(arch.name, backend, "n/a", "", None, f"transformers: {_short(err)}")
    try:
        model = prepared_model(arch, backend)
        try:
            report = check_isolation(model, backward=True)
            status = "exact"
        except NotImplementedError as err:  # e.g. FlexAttention has no backward on CPU
            report = check_isolation(model, backward=False)
            status, detail = "exact (forward)", f"torch has no CPU backward here ({type(err).__name__})"
        else:
            detail = ""
    except PackingError as err:
        return Cell(arch.name, backend, "refused", "", None, _refusal(arch, backend, err))
    except (
        ValueError
    ) as err:  # transformers refuses the backend on this device (e.g. GPT-OSS's sinks in flex)
        if "CPU" not in str(err):
            raise
        return Cell(arch.name, backend, "n/a", "", None, f"transformers: {_short(err)}")
    # Not refused: it must really be exact, else it would be a silent leak.
    if report.leaks:
        return Cell(arch.name, backend, "SILENT LEAK", "", report.max_diff, str(report))
    needs = "all"
    for label, switches in NEEDS:
        try:
            fewer = check_isolation(model, PaddingFreeCollator(0, **switches), raise_on_leak=False)
        except PackingError:
            continue
        if not fewer.leaks:
            needs = label
            break
    dpo = dpo_check(arch, backend) if status == "exact" else ("", None)
    if dpo[0].startswith(("n/a", "refused")):  # the reason in the detail column
        detail, dpo = f"DPO {dpo[0]}", (dpo[0].split(" ")[0].rstrip(":"), None)
    if dpo[0] == "LEAKS":
        return Cell(arch.name, backend, "SILENT LEAK", needs, dpo[1], f"DPO log-probs differ by {dpo[1]:.1e}")
    return Cell(arch.name, backend, status, needs, report.max_diff, detail, *dpo)


def run_matrix(
    archs: list[Family], backends: tuple[str, ...], progress: Callable[[Cell, float], None] | None = None
) -> list[Cell]:
    cells = []
    for arch in archs:
        for backend in backends:
            start = time.perf_counter()
            cell = run_cell(arch, backend)
            if progress is not None:
                progress(cell, time.perf_counter() - start)
            cells.append(cell)
    return cells


def markdown(cells: list[Cell], archs: list[Family]) -> str:
    import torch
    import transformers

    notes = {a.name: a.note for a in archs}
    lines = [
        "# Model compatibility matrix",
        "",
        "<!-- Generated by `python benchmarks/model_matrix.py --write docs/models.md`; do not edit by hand. -->",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, float32"
        + ("; `flash_attention_2` cells: CUDA, bfloat16" if any("flash" in c.backend for c in cells) else "")
        + ".  Each architecture "
        "is built tiny from its config with random weights (`packtools.testing.tiny_model(name, backend)`: "
        "[build the same model](training.md#your-setup-on-a-tiny-model-of-your-family-first-packtoolstesting) to "
        "check your own setup); each cell runs `packtools.integrations.check_isolation(model, "
        "backward=True)`: four sequences packed into two rows by `PaddingFreeCollator`, passed as "
        "`prepare_trainer` passes them, against each sequence run alone (logits, summed loss and gradients, "
        "tolerance 1e-5), and a check that changing one sequence does not move the others.",
        "",
        "- **exact**: logits, loss and gradients of the packed batch equal the one-by-one run. *Needs* is the "
        "fewest batch keys that keep it exact (`PaddingFreeCollator` sends all of them by default).",
        "- **exact (forward)**: logits exact; torch has no CPU backward for this kernel and raises, so "
        "training needs a GPU.",
        "- **refused**: packtools raises `PackingError` before training (in `prepare_trainer` or "
        "`check_isolation`), naming the fix.",
        "- **n/a**: transformers itself does not offer this backend for this architecture (on the CPU).",
        "- `packtools_sdpa` is packtools' per-sequence sdpa, which `prepare_trainer` and `prepare_dpo_trainer` "
        "switch `sdpa` models to (text models, and Gemma 3 with images, docs/vision.md; other multimodal models "
        "stay on `sdpa`): on a padding-free row with `cu_seq_lens` each sequence runs on its own "
        "(attention cost sum(L_i^2) instead of (sum L_i)^2), each with its own block of sdpa's mask built alone "
        "(`document_mask`: no T x T mask); on a batch "
        "with `position_ids` only it is transformers' sdpa, hence *needs* `position_ids`.",
        "",
        "| architecture | what it tests | backend | result | needs | max diff | DPO log-probs | detail |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        diff = "" if c.max_diff is None else f"{c.max_diff:.0e}"
        detail = c.detail.replace("|", "\\|")
        dpo = c.dpo + ("" if c.dpo_diff is None else f" ({c.dpo_diff:.0e})")
        lines.append(
            f"| {c.arch} | {notes[c.arch]} | `{c.backend}` | {c.status} | {c.needs} | {diff} | {dpo} | {detail} |"
        )
    lines += [
        "",
        "Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Kimi Linear, LFM2, Nemotron-H, Bamba, Falcon-H1) have layers "
        "that mix tokens outside attention (gated DeltaNet / delta attention, short convolutions, Mamba-2). They "
        "ignore `position_ids`, and transformers' CPU fallback cannot separate packed documents. "
        "`prepare_trainer` and `prepare_dpo_trainer` run those layers document by document, each from a zero state "
        "as the model runs a document alone (`packtools.integrations.attention.mixers`; on CUDA with causal-conv1d, "
        "mamba-ssm or flash-linear-attention installed, their varlen kernels instead), and each cell here is "
        "checked with that in place. The recurrent models with no attention at all (Mamba, Falcon-Mamba, "
        "Mamba-2) are run the same way: every block per document (Mamba-1's blocks always, as they hand their "
        "mixer no `seq_idx`), their documents found from `position_ids` (MambaForCausalLM hands its backbone none: "
        "from its own forward's). RWKV and xLSTM, whose blocks return their state along with the hidden states, "
        "are refused by name. GPT-OSS builds its attention masks without `position_ids`; packtools hands "
        "it the masks built from them. The *DPO log-probs* column runs the same tiny model through the padding-free "
        "forward `prepare_dpo_trainer` installs: four sequences as TRL's padded batch, their summed log-probs and the "
        "gradients of those against each sequence alone (largest relative difference; tolerance 1e-5). The Whisper "
        "decoder's own loss does not shift its labels; `prepare_trainer` gives its Trainer packtools' "
        "next-token loss.",
        "",
    ]
    return "\n".join(lines)


def parse_table(text: str) -> dict[tuple[str, str], tuple[str, str, str]]:
    """``(architecture, backend) -> (result, needs, DPO result)`` from a generated document (for tests)."""
    out = {}
    for line in text.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) >= 7 and cols[2].startswith("`"):
            out[(cols[0], cols[2].strip("`"))] = (cols[3], cols[4], cols[6].split(" ")[0])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", nargs="*", help="architecture names (default: all)")
    parser.add_argument(
        "--backends",
        nargs="*",
        help="default: sdpa, eager, flex_attention, packtools_sdpa (+ flash_attention_2 on GPU)",
    )
    parser.add_argument("--write", type=Path, help="write the markdown table to this file")
    args = parser.parse_args(argv)
    archs = [a for a in FAMILIES if not args.archs or a.name in args.archs]
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    def progress(cell: Cell, seconds: float) -> None:
        diff = "" if cell.max_diff is None else f"{cell.max_diff:.1e}"
        dpo = "" if cell.dpo_diff is None else f"{cell.dpo} {cell.dpo_diff:.1e}"
        print(
            f"{cell.arch:11s} {cell.backend:15s} {cell.status:16s} {cell.needs:34s} {diff:8s} {dpo:16s} "
            f"{seconds:5.1f}s"
        )

    cells = run_matrix(archs, tuple(args.backends or default_backends()), progress)
    if args.write:
        args.write.write_text(markdown(cells, archs))
        print(f"wrote {args.write}")
    silent = [c for c in cells if c.silent]
    for c in silent:
        print(f"SILENT LEAK: {c.arch} {c.backend}\n{c.detail}", file=sys.stderr)
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
