"""What decides the token ids of a run, as one frozen value: :class:`IdsSpec`.

The stage key of every part (:func:`packtools.pipeline.stage.stage_key`), the output's fingerprint
(:func:`packtools.pipeline.config.fingerprint`) and the run's engine verdict
(:func:`packtools.pipeline.tokenizer.verdict.basis`) all derive from it, so an option, a library or a code change
that can change the ids has one place to be named, and changes all three.  It travels as that one value from the
driver to every stage job (:class:`packtools.pipeline.stage.StageJob`), whose process builds its tokenizer from it.

>>> spec = IdsSpec.of(None, "tokenized", True, "auto", "report", 0.001)
>>> spec.key()["format"], spec.key()["tokenizer"]
('tokenized', None)
>>> IdsSpec.of("0" * 64, "text", True, "fast", "report", 0.001).requested_engine
'fast'
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ...io.fingerprint import source_hash

#: libraries whose versions can change the ids of a tokenizer folder
ID_LIBRARIES = ("transformers", "tokenizers", "jinja2")


@functools.cache
def library_versions() -> tuple[tuple[str, str], ...]:
    out = []
    for name in ID_LIBRARIES:
        try:
            out.append((name, version(name)))
        except PackageNotFoundError:
            out.append((name, "absent"))
    return tuple(out)


@dataclass(frozen=True)
class IdsSpec:
    """Everything that decides a run's token ids (see the module docstring); tokenized input has no tokenizer
    and its ids are the input's own (only the format and the code count)."""

    tokenizer: str | None  # tokenizer_fingerprint: the SHA-256 of the files' contents
    format: str
    add_eos: bool | None
    engine: str | None  # tokenizer.fast.engine_key of the requested engine
    on_unencodable: str | None
    audit_rate: float | None  # which rows are compared decides which runs stop
    libraries: tuple[tuple[str, str], ...] | None
    code: str  # packtools' sources: a development checkout changes them without a new version

    @classmethod
    def of(
        cls,
        tokenizer_fp: str | None,
        fmt: str,
        add_eos: bool,
        engine: str,
        on_unencodable: str,
        audit_rate: float,
    ) -> IdsSpec:
        if fmt == "tokenized":
            return cls(None, fmt, None, None, None, None, None, source_hash())
        from .fast import engine_key

        return cls(
            tokenizer_fp,
            fmt,
            add_eos,
            engine_key(engine),
            on_unencodable,
            float(audit_rate),
            library_versions(),
            source_hash(),
        )

    @property
    def requested_engine(self) -> str | None:
        """The engine asked for (``auto``, ``fast``, ``transformers``): :attr:`engine` is it, followed by the
        installed fast engine's version unless it is ``transformers``; None for tokenized input."""
        return None if self.engine is None else self.engine.split(" ", 1)[0]

    def key(self) -> dict[str, Any]:
        """The spec as plain JSON values (a part of cache keys and of the manifest's fingerprint)."""
        out = asdict(self)
        out["libraries"] = dict(self.libraries) if self.libraries is not None else None
        return out
