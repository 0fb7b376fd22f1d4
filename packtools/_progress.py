"""Progress reporting for long CLI steps: tqdm when installed, else a line every few seconds, or nothing."""

from __future__ import annotations

import sys
import time
from typing import Any


class _Lines:
    def __init__(self, total: int | None, desc: str, unit: str) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = 0
        self.start = self.last = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= 5.0:
            self.last = now
            of = f"/{self.total:,}" if self.total else ""
            print(f"{self.desc}: {self.n:,}{of} {self.unit} ({now - self.start:.0f} s)", file=sys.stderr)

    def close(self) -> None:
        pass


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int | None, desc: str, unit: str = "rows", quiet: bool = False) -> Any:
    """An object with ``update(n)`` and ``close()``."""
    if quiet:
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Lines(total, desc, unit)
    return tqdm(total=total, desc=desc, unit=f" {unit}", unit_scale=True, leave=False, file=sys.stderr)
