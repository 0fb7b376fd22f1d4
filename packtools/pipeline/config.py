"""What decides a pipeline run's output: :class:`PipelineConfig` (checked when built), its :func:`fingerprint`
(the key the manifest compares), and :class:`PipelineResult`, what a run returns.

>>> config = PipelineConfig(max_length=8, strategy="bfd_split")
>>> config.overlong_policy
'split'
>>> PipelineConfig(max_length=8, plan="everything")
Traceback (most recent call last):
    ...
packtools.errors.PackingError: plan='everything' is unknown; use one of global, shards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..constants import __version__
from ..core.cp_budget import check_context_parallel
from ..core.pack import check_columns_unique
from ..core.plan import check_max_length, check_strategy
from ..errors import PackingError, check_choice
from ..io.discover import InputFile
from ..io.files import read_schema
from ..io.fingerprint import cache_key
from ..io.manifest import MANIFEST_FORMAT
from .formats import FORMATS, input_columns, raw_format
from .tokenizer.char_drops import check_on_unencodable
from .tokenizer.fast import check_audit_rate, check_engine, engine_key
from .tokenizer.folder import tokenizer_fingerprint
from .tokenizer.spec import IdsSpec
from .turn_split import SPLIT_AT

OVERLONG = ("truncate", "drop", "split")
#: ``global``: one plan over every row (the default; fewest rows).  ``shards``: each part planned on its own
#: and the plans put one after the other, a few rows more per part (``docs/pipeline.md``).
PLANS = ("global", "shards")


@dataclass(frozen=True)
class PipelineConfig:
    """Everything that decides the output.  Where it runs (executor, workers) and ``quiet`` do not, and are not
    fingerprinted."""

    max_length: int
    strategy: str = "bfd"
    format: str | None = None
    tokenizer: str | None = None
    overlong: str | None = None
    columns: tuple[str, ...] | None = None
    add_eos: bool = True
    max_prompt_length: int | None = None
    shuffle: bool = False
    seed: int = 0
    shard_tokens: int = 1 << 24
    plan: str = "global"
    # rows without a trained token: True drops them; None (default) keeps them but drops the pieces of split rows
    # that hold none (pieces exist only because of the cut); False keeps both (every token)
    drop_unlabeled: bool | None = None
    split_at: str = "turns"  # bfd_split on rows with labels: turns | tokens (packtools.pipeline.turn_split)
    part_rows: int = 1 << 17
    part_bytes: int = 1 << 26
    # auto | fast | transformers: the same ids either way (proven); fingerprinted with the engine's version
    tokenizer_engine: str = "auto"
    tokenizer_audit: float = 0.001  # share of rows compared with transformers after the proof
    on_unencodable: str = "report"  # characters the tokenizer cannot encode: report | error
    # CP size the rows are budgeted for, documents planned at their CP-padded length (1: none; core.cp_budget)
    context_parallel: int = 1

    def __post_init__(self) -> None:
        check_max_length(self.max_length)
        if self.columns is not None:  # one name as a string is one column (as pack_table takes it)
            names = (self.columns,) if isinstance(self.columns, str) else tuple(self.columns)
            check_columns_unique(names)
            object.__setattr__(self, "columns", names)
        check_engine(self.tokenizer_engine)
        check_audit_rate(self.tokenizer_audit)
        check_on_unencodable(self.on_unencodable)
        check_strategy(self.strategy)
        check_choice("split_at", self.split_at, SPLIT_AT)
        object.__setattr__(
            self,
            "context_parallel",
            check_context_parallel(self.context_parallel, self.max_length),
        )
        if self.drop_unlabeled not in (None, True, False):
            raise PackingError(
                f"drop_unlabeled={self.drop_unlabeled!r} must be None, True or False.", param="drop_unlabeled"
            )
        if self.format is not None:
            check_choice("format", self.format, FORMATS)
        if self.overlong is not None:
            check_choice("overlong", self.overlong, OVERLONG)
        if self.overlong == "split" and self.strategy == "bfd":
            raise PackingError(
                "overlong='split' needs strategy='bfd_split' (or 'wrapped'); bfd keeps one piece per sequence.",
                param="overlong",
            )
        if self.max_prompt_length is not None and not 0 < self.max_prompt_length < self.max_length:
            raise PackingError(
                f"max_prompt_length={self.max_prompt_length} must be in [1, max_length={self.max_length}).",
                param="max_prompt_length",
            )
        if self.split_at != "turns" and self.strategy != "bfd_split":
            raise PackingError(
                f"split_at={self.split_at!r} with strategy={self.strategy!r}: only bfd_split cuts rows into pieces "
                f"at turns or tokens, so it would change nothing. Use strategy='bfd_split', or leave split_at out.",
                param="split_at",
            )
        if self.seed != 0 and not self.shuffle:
            raise PackingError(
                f"seed={self.seed} without shuffle=True: the seed only orders the shuffled rows, so it would "
                f"change nothing. Add shuffle=True, or leave seed out.",
                param="seed",
            )
        check_choice("plan", self.plan, PLANS)
        for name in ("shard_tokens", "part_rows", "part_bytes"):
            if getattr(self, name) < 1:
                raise PackingError(f"{name} must be >= 1, got {getattr(self, name)}.", param=name)

    def ids(self, fmt: str, tokenizer_fp: str | None) -> IdsSpec:
        """What decides the ids of this run on ``fmt`` data with the tokenizer whose files hash to
        ``tokenizer_fp`` (:class:`~packtools.pipeline.tokenizer.spec.IdsSpec`): built once by the driver, handed to
        every stage job."""
        return IdsSpec.of(
            tokenizer_fp, fmt, self.add_eos, self.tokenizer_engine, self.on_unencodable, self.tokenizer_audit
        )

    @property
    def overlong_policy(self) -> str:
        """``overlong`` or its default: ``truncate`` for bfd, ``split`` for bfd_split and wrapped."""
        return self.overlong or ("truncate" if self.strategy == "bfd" else "split")


@dataclass
class PipelineResult:
    """What a run did: the output folder, its statistics (also in the manifest), whether the manifest made it
    a no-op, and how long each stage took where (``timings``: not in the manifest, which must not depend on
    where the run went)."""

    out: str
    stats: dict[str, Any]
    cached: bool = False
    manifest: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    #: Things to tell the user that did not fail the run (e.g. files of the old output that could not be removed).
    notes: list[str] = field(default_factory=list)


# -- the manifest's key --------------------------------------------------------------------------------------
def fingerprint(files: Sequence[InputFile], config: PipelineConfig) -> dict[str, Any]:
    """What the manifest compares: config, input files (path, size, mtime), tokenizer files, versions."""
    cfg = asdict(config)
    cfg["columns"] = list(config.columns) if config.columns else None
    cfg["overlong"] = config.overlong_policy
    cfg["tokenizer_engine"] = engine_key(config.tokenizer_engine)  # S15: another engine is another output
    tok = tokenizer_fingerprint(config.tokenizer) if config.tokenizer else None
    # what decides the ids (tokenizer content, engine, library versions, code: packtools.pipeline.tokenizer.spec)
    cfg["ids"] = config.ids(config.format or "auto", tok).key()
    body = {
        "manifest_format": MANIFEST_FORMAT,
        "packtools_version": __version__,
        "config": cfg,
        "inputs": [f.fingerprint() for f in files],
        "tokenizer_sha256": tok,
    }
    digest = cache_key("pack_files", MANIFEST_FORMAT, config=cfg, inputs=body["inputs"], tokenizer=tok)
    return {"fingerprint": digest, **body}


def check_options_used(config: PipelineConfig, fmt: str, files: Sequence[InputFile] = ()) -> None:
    """Refuse, by name, an option that cannot change anything for data of format ``fmt`` (a user who gave it
    expected an effect; the vision path refuses its unused options the same way).  ``files``: the inputs; the
    first one's columns are read only to refuse a tokenizer given with tokenized data, which is told the format
    that tokenizes its raw columns where it also holds them."""
    if fmt == "text" and config.drop_unlabeled is not None:
        flag = "drop_unlabeled=True" if config.drop_unlabeled else "drop_unlabeled=False (keep unlabeled)"
        raise PackingError(
            f"{flag} on text data: text rows have no labels (every token trains), so no row or piece is "
            f"without a trained token and it would change nothing. Leave it out.",
            param="drop_unlabeled",
        )
    if fmt != "preference" and config.max_prompt_length is not None:
        raise PackingError(
            f"max_prompt_length={config.max_prompt_length} on {fmt} data: it applies to preference pairs "
            f"(prompt + chosen + rejected) only, so it would change nothing. Leave it out.",
            param="max_prompt_length",
        )
    if fmt == "tokenized" and config.tokenizer is not None:
        raw = raw_format(read_schema(files[0]).names) if config.format is None and files else None
        fix = (
            f"Leave it out to pack the input's 'input_ids' as they are, or pass format={raw!r} to tokenize its "
            f"{input_columns(raw)} columns instead (the input holds both)."
            if raw
            else "Leave it out (or give text, chat or preference data to tokenize)."
        )
        raise PackingError(
            f"tokenizer={config.tokenizer!r} with tokenized data: token ids are packed as they are and the "
            f"tokenizer is never used. {fix}",
            param="tokenizer",
        )
