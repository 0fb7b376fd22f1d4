"""Docs that stated what the code refuses or no longer does (review 2026-12c C3, C4): the pages now say what the
code does, checked here against the code."""

import re
import types
from pathlib import Path

import numpy as np
import pytest

from packtools.batches.context_parallel import pair_holders
from packtools.errors import PackingError

DOCS = Path(__file__).parents[1] / "docs"


def test_multi_gpu_page_states_the_stream_refusal_not_a_workaround():
    # C3: the page gave remove_unused_columns=False + dispatch_batches=False as a workaround; the code refuses
    # a stream under several processes whatever the arguments
    datasets = pytest.importorskip("datasets")
    from packtools.integrations.trainers.loader import check_train_loader

    stream = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 8}).to_iterable_dataset()
    args = types.SimpleNamespace(
        world_size=2,
        process_index=0,
        remove_unused_columns=False,
        accelerator_config={"dispatch_batches": False},
    )
    trainer = types.SimpleNamespace(args=args, train_dataset=stream, get_train_dataloader=None)
    with pytest.raises(PackingError, match="is a stream") as err:
        check_train_loader(trainer, None)
    page = (DOCS / "jobs" / "multi-gpu.md").read_text()
    assert "dispatch_batches" not in page
    streaming = page[page.index("**Streaming") :].split("\n\n")[0]
    assert "refused" in streaming
    assert "datasets.Dataset.from_generator(lambda: iter(packed_stream))" in str(err.value)
    assert "datasets.Dataset.from_generator(lambda: iter(packed_stream))" in streaming


def test_training_page_states_the_balanced_pairs_not_the_rotation():
    # C4: training.md said k = (r + i) mod N (the rotation d8351ea replaced); balance=True pairs per document
    text = (DOCS / "training.md").read_text()
    assert "(r + i) mod N" not in text
    assert "balance_pairs" in text
    lengths = [13, 5, 30, 2, 7, 9]
    held = np.argsort(pair_holders(lengths, 4), axis=1)  # [document, rank] -> the pair k that rank holds
    rotation = np.array([[(r + i) % 4 for r in range(4)] for i in range(len(lengths))])
    assert held.tolist() == [
        [0, 1, 2, 3],
        [3, 2, 0, 1],
        [3, 2, 1, 0],
        [0, 3, 2, 1],
        [2, 1, 0, 3],
        [2, 1, 0, 3],
    ]
    assert not np.array_equal(held, rotation)
    # the page's other claim: a batch without padding (every length a multiple of 2N) keeps k = r throughout
    assert pair_holders([8, 16, 24], 4).tolist() == [[0, 1, 2, 3]] * 3
    assert (
        pair_holders([8, 16, 24], 4).tolist() != pair_holders([8, 15, 24], 4).tolist()
    )  # padding moves pairs
    assert re.search(r"batch without padding keeps\s+`k = r` throughout", text)
