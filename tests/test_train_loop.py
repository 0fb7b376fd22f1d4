"""The plain PyTorch loop of docs/training.md (benchmarks/train_loop.py) trains like the sequences run one by one."""

import copy
import math

import pytest
from _hf_models import PAD, Recorder, max_diff, params, reference_training, sequences, tiny_llama, torch
from _scripts import script

from packtools import pack_dataset
from packtools.batches.collate import PaddingFreeCollator

datasets = pytest.importorskip("datasets")


@pytest.mark.parametrize("accumulation", [1, 3])
def test_loop_matches_one_by_one(accumulation):
    loop = script("train_loop")
    packed = pack_dataset(datasets.Dataset.from_list(sequences(40, seed=7)), 32, "bfd_split")
    recorder = Recorder(PaddingFreeCollator(PAD))
    loader = torch.utils.data.DataLoader(packed, batch_size=2, shuffle=True, collate_fn=recorder)
    model = tiny_llama("sdpa")
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = loop.train(model, loader, optimizer, accumulation_steps=accumulation)
    assert len(losses) == math.ceil(len(recorder.batches) / accumulation)
    reference_training(reference, recorder.batches, accumulation, 0.5)
    assert max_diff(params(model), params(reference)) < 1e-5
    assert max_diff(params(model), params(tiny_llama("sdpa"))) > 1e-2


def test_bench_train_cases_see_the_same_tokens_and_packed_layouts_agree(capsys):
    bench = script("bench_train")
    padded, flat, two_d, per_seq = bench.main(["--sequences", "40", "--max-length", "128", "--repeats", "1"])
    assert padded["real"] == flat["real"] == two_d["real"] == per_seq["real"] == flat["processed"]
    assert padded["processed"] > padded["real"]
    # Flat padding-free and [B, T] packed batches, and the flat row under packtools' per-sequence sdpa, train
    # identically (same rows, same order, same math).
    assert flat["steps"] == two_d["steps"] == per_seq["steps"]
    assert (
        abs(flat["last_loss"] - two_d["last_loss"]) < 1e-4
        and abs(flat["last_loss"] - per_seq["last_loss"]) < 1e-4
    )
    assert "packed-seq" in capsys.readouterr().out
