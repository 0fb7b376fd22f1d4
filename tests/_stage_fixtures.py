"""Fixtures of the stage-cache tests (imported by name into a test module, where pytest finds them): the tiny
tokenizer folder, a stage cache of the test's own, a JSONL file of 300 texts."""

from __future__ import annotations

import json

import pytest
from _pipeline_data import CORPUS, build_tokenizer

from packtools.pipeline import stage_cache


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok") / "tok"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = str(tmp_path / "stage-cache")
    monkeypatch.setenv(stage_cache.CACHE_ENV, folder)
    return folder


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"text": f"{CORPUS[i % 5]} {i}"}) + "\n" for i in range(300))
    return str(path)
