"""The set-up the TRL trainer tests share (test_dpo, test_reward, test_kto, test_grpo): the libraries they need
(a test module importing this is skipped when one is missing), no progress bars, and the tolerance of their
comparisons of a prepared trainer's step with TRL's own padded step (fp32 on CPU)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

os.environ.setdefault("TQDM_DISABLE", "1")

#: Loss, logged metrics and gradients of a prepared trainer agree with TRL's within this.
TOL = 1e-5
