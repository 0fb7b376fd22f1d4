"""Offline packing for context parallelism (``pack_files(..., context_parallel=N)``, ``packtools pack
--context-parallel N``; :mod:`packtools.core.cp_budget`): rows planned at their documents' CP-padded length
still fit ``max_length`` once the collator pads them, the padding is reported, the CP size is in the manifest
and its key, the collator cuts offline-packed rows as it cuts the same documents packed at batch time, and rows
packed for another CP size fit exactly or are refused by row."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools import PaddingFreeCollator
from packtools.batches.context_parallel import (
    ContextParallelCollator,
    CPLayout,
    check_rows_fit,
    cp_padded_lengths,
    rank_work,
    work_imbalance,
)
from packtools.cli.main import main
from packtools.errors import PackingError
from packtools.pipeline import pack_files
from packtools.pipeline.config import PipelineConfig

datasets = pytest.importorskip("datasets")

MAX = 256


def long_tailed(seed: int = 0, n: int = 400) -> np.ndarray:
    """Lengths with many documents shorter than 2N (1..7 tokens), a lognormal body and a few over MAX."""
    rng = np.random.default_rng(seed)
    short = rng.integers(1, 8, n // 4)
    body = np.minimum(rng.lognormal(3.5, 1.0, n - n // 4 - 6).astype(np.int64) + 1, MAX)
    return rng.permutation(np.concatenate([short, body, [MAX, MAX - 1, MAX + 1, 3 * MAX + 5, 1, 2]]))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("cp")
    lengths = long_tailed()
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = [list(range(int(s) + 1, int(s + n) + 1)) for s, n in zip(start, lengths)]  # every token unique
    path = str(d / "in.parquet")
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int32()))}), path)
    return d, path, lengths, rows


def packed_rows(out):
    table = datasets.load_from_disk(str(out)).data.table
    return table.column("input_ids").to_pylist(), table.column("seq_lengths").to_pylist()


def manifest(out):
    with open(os.path.join(out, "manifest.json")) as fh:
        return json.load(fh)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_rows_fit_max_length_after_cp_padding(corpus, strategy, n):
    d, path, lengths, rows = corpus
    res = pack_files(path, str(d / f"o-{strategy}-{n}"), MAX, strategy, context_parallel=n)
    ids, seqs = packed_rows(res.out)
    padded = [int(cp_padded_lengths(s, n).sum()) for s in seqs] if n > 1 else [sum(s) for s in seqs]
    assert max(padded) <= MAX
    assert all(sum(s) == len(r) for s, r in zip(seqs, ids))  # rows carry real tokens only, no padding
    kept = sorted(t for r in ids for t in r)
    if strategy == "bfd_split":  # every token, once
        assert kept == sorted(t for r in rows for t in r)
    else:  # the first max_length tokens of each
        assert kept == sorted(t for r in rows for t in r[:MAX])
    if n > 1:  # the padding is reported: what the CP layout adds to these rows
        lost = sum(CPLayout.build(s, n).fill_lost for s in seqs)
        assert res.stats["cp_padding_tokens"] == lost > 0
        assert res.stats["cp_fill_lost"] == pytest.approx(lost / (len(seqs) * MAX))
        assert res.stats["cp_longest_padded_row"] == max(padded)
        assert res.stats["fill_after_cp_padding"] == pytest.approx(sum(padded) / (len(seqs) * MAX))
        assert res.manifest["config"]["context_parallel"] == n
        # the ranks' attention work, row by row, on the layout prepare_trainer trains on (balanced)
        per_row = [rank_work(CPLayout.build(s, n, balance=True)) for s in seqs]
        assert res.stats["cp_worst_row_imbalance"] == pytest.approx(max(work_imbalance(w) for w in per_row))
        thd = max(work_imbalance(rank_work(CPLayout.build(s, n))) for s in seqs)
        assert res.stats["cp_worst_row_imbalance_head_tail"] == pytest.approx(thd)
    else:
        assert "cp_padding_tokens" not in res.stats


def test_part_plans_and_shuffled_rows_fit_too(corpus):
    """plan="shards" (one plan per part, put together) and shuffle keep the CP budget."""
    d, _, lengths, rows = corpus
    path = str(d / "groups.parquet")
    pq.write_table(pa.table({"input_ids": rows}), path, row_group_size=64)  # parts of 64 rows
    res = pack_files(
        path,
        str(d / "parts"),
        MAX,
        "bfd_split",
        context_parallel=4,
        plan="shards",
        part_rows=64,
        shuffle=True,
    )
    assert res.timings["parts"] > 1
    _, seqs = packed_rows(res.out)
    assert max(int(cp_padded_lengths(s, 4).sum()) for s in seqs) <= MAX
    assert sum(map(sum, seqs)) == int(lengths.sum())


def test_negative_control_planning_unpadded_lengths_overflows(corpus):
    """The same corpus planned on its real lengths (no CP budget) has rows over max_length once padded."""
    d, path, _, _ = corpus
    _, seqs = packed_rows(pack_files(path, str(d / "plain"), MAX, "bfd_split").out)
    for n in (2, 4):
        assert max(int(cp_padded_lengths(s, n).sum()) for s in seqs) > MAX
        with pytest.raises(PackingError, match=f"once padded for context_parallel={n}, over max_length"):
            check_rows_fit(seqs, n, MAX)


def test_one_is_the_default_byte_for_byte(corpus):
    d, path, _, _ = corpus
    a = pack_files(path, str(d / "default"), MAX, "bfd_split")
    b = pack_files(path, str(d / "one"), MAX, "bfd_split", context_parallel=1)
    assert a.manifest["fingerprint"] == b.manifest["fingerprint"] and a.stats == b.stats
    names = sorted(f for f in os.listdir(a.out) if f.endswith(".arrow"))
    assert names == sorted(f for f in os.listdir(b.out) if f.endswith(".arrow"))
    for name in names:
        with open(os.path.join(a.out, name), "rb") as x, open(os.path.join(b.out, name), "rb") as y:
            assert x.read() == y.read()


def test_the_cp_size_is_in_the_manifest_and_its_key(corpus, tmp_path):
    _, path, _, _ = corpus
    out = str(tmp_path / "out")
    one = pack_files(path, out, MAX, "bfd_split")
    two = pack_files(path, out, MAX, "bfd_split", context_parallel=2)
    assert not two.cached and two.manifest["fingerprint"] != one.manifest["fingerprint"]  # packed again
    assert manifest(out)["config"]["context_parallel"] == 2
    assert pack_files(path, out, MAX, "bfd_split", context_parallel=2).cached
    four = pack_files(path, out, MAX, "bfd_split", context_parallel=4)
    assert not four.cached and manifest(out)["stats"]["context_parallel"] == 4


def test_the_stage_key_does_not_hold_the_cp_size(corpus, tmp_path, monkeypatch):
    """Staging (read, tokenize) does not depend on CP: runs at N = 1, 2, 4 stage their parts under the same keys,
    while their output fingerprints differ."""
    from packtools.pipeline import stage_cache

    _, path, _, _ = corpus
    keys: list[str] = []
    real = stage_cache.stage_key

    def recording(*args, **kwargs):
        keys.append(real(*args, **kwargs))
        return keys[-1]

    monkeypatch.setattr(stage_cache, "stage_key", recording)
    prints = set()
    for n in (1, 2, 4):
        keys.clear()
        prints.add(
            pack_files(path, str(tmp_path / f"o{n}"), MAX, "bfd_split", context_parallel=n).manifest[
                "fingerprint"
            ]
        )
        if n == 1:
            first = list(keys)
        assert keys == first and keys
    assert len(prints) == 3


def features(ids, seqs):
    return [{"input_ids": r, "seq_lengths": s} for r, s in zip(ids, seqs)]


def documents(ids, seqs):
    """The documents of packed rows, one feature each (what a batch-time packer would be given)."""
    out = []
    for r, s in zip(ids, seqs):
        cut = np.cumsum([0, *s])
        out += [{"input_ids": r[a:b], "seq_lengths": [int(b - a)]} for a, b in zip(cut[:-1], cut[1:])]
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_collator_cuts_offline_rows_as_it_cuts_the_same_documents_at_batch_time(corpus, n):
    d, path, _, _ = corpus
    ids, seqs = packed_rows(pack_files(path, str(d / f"col-{n}"), MAX, "bfd_split", context_parallel=n).out)
    for batch in ([0], [1, 2], list(range(3, 7))):
        rows = [ids[i] for i in batch]
        lens = [seqs[i] for i in batch]
        for rank in range(n):
            offline = ContextParallelCollator(
                PaddingFreeCollator(0), n, rank, return_tensors="np", max_length=MAX
            )(features(rows, lens))
            at_batch = ContextParallelCollator(PaddingFreeCollator(0), n, rank, return_tensors="np")(
                documents(rows, lens)
            )
            for key in ("input_ids", "position_ids", "shift_labels", "cu_seqlens", "cu_seqlens_padded"):
                np.testing.assert_array_equal(offline[key], at_batch[key], err_msg=key)
            # each packed row of the batch fits max_length once padded (its share of the batch)
            assert all(int(cp_padded_lengths(s, n).sum()) <= MAX for s in lens)


def test_rows_packed_for_another_cp_size_fit_exactly_or_are_refused_by_row(corpus):
    d, path, _, _ = corpus
    ids2, seqs2 = packed_rows(pack_files(path, str(d / "for2"), MAX, "bfd_split", context_parallel=2).out)
    ids4, seqs4 = packed_rows(pack_files(path, str(d / "for4"), MAX, "bfd_split", context_parallel=4).out)
    check_rows_fit(seqs4, 2, MAX)  # packed at 4, trained at 2 (or 1): 2 divides 4, every row fits
    check_rows_fit(seqs4, 1, MAX)
    with pytest.raises(PackingError, match="context_parallel=4, over max_length=256") as info:
        check_rows_fit(seqs2, 4, MAX)  # packed at 2, trained at 4: some row does not fit
    assert info.value.param == "context_parallel" and "--context-parallel 4" in str(info.value)
    bad = next(i for i, s in enumerate(seqs2) if int(cp_padded_lengths(s, 4).sum()) > MAX)
    collator = ContextParallelCollator(PaddingFreeCollator(0), 4, 0, return_tensors="np", max_length=MAX)
    with pytest.raises(PackingError, match=f"row {1} .*once padded for context_parallel=4"):
        collator(features([ids2[0], ids2[bad]], [seqs2[0], seqs2[bad]]))
    fits = [i for i, s in enumerate(seqs2) if int(cp_padded_lengths(s, 4).sum()) <= MAX][:3]
    assert fits  # the rows that do fit are cut as usual
    assert collator(features([ids2[i] for i in fits], [seqs2[i] for i in fits]))["cp_size"] == 4


def test_turn_split_pieces_fit_after_cp_padding(tmp_path):
    """bfd_split on rows with labels: the pieces (cut at turns or every max_length tokens) fit once padded."""
    rng = np.random.default_rng(1)
    rows, labels = [], []
    for i in range(60):
        n = int(rng.integers(1, 3 * 64)) if i % 5 else int(rng.integers(1, 6))
        ids = rng.integers(10, 1000, n).tolist()
        lab = [t if (k // 9) % 2 else -100 for k, t in enumerate(ids)]  # alternating prompt / reply runs
        rows.append(ids)
        labels.append(lab)
    path = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": rows, "labels": labels}), path)
    same = ("pieces", "rows_split", "tokens_trained_kept", "tokens_dropped", "tokens_kept")
    for split_at in ("turns", "tokens"):
        base = pack_files(path, str(tmp_path / f"o-{split_at}-1"), 64, "bfd_split", split_at=split_at).stats
        assert base["rows_split"] > 0 and base["pieces"] > 0
        for n in (2, 4):
            res = pack_files(
                path,
                str(tmp_path / f"o-{split_at}-{n}"),
                64,
                "bfd_split",
                split_at=split_at,
                context_parallel=n,
            )
            _, seqs = packed_rows(res.out)
            assert max(int(cp_padded_lengths(s, n).sum()) for s in seqs) <= 64
            # CP changes which pieces share a row, nothing of what is cut, kept or trained
            assert {k: res.stats[k] for k in same} == {k: base[k] for k in same}


def test_options_cp_cannot_keep_are_refused_by_name(tmp_path):
    with pytest.raises(PackingError, match="not one: a document of max_length tokens") as info:
        PipelineConfig(max_length=100, context_parallel=8)
    assert info.value.param == "max_length" and "e.g. 96" in str(info.value)
    with pytest.raises(PackingError, match="max_length=100 is not one") as info:
        PipelineConfig(max_length=100, strategy="wrapped", context_parallel=4)  # wrapped: the same rule
    assert PipelineConfig(max_length=64, strategy="wrapped", context_parallel=2).context_parallel == 2
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(PackingError, match="context_parallel must be a positive int"):
            PipelineConfig(max_length=64, context_parallel=bad)
    PipelineConfig(max_length=64, strategy="wrapped", context_parallel=1)  # control
    for bad in (0, True, 1.5):
        with pytest.raises(PackingError, match="max_length must be"):
            ContextParallelCollator(PaddingFreeCollator(0), 2, 0, max_length=bad)
    src = tmp_path / "pref.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "chosen": "yes", "rejected": "no"}) + "\n")
    with pytest.raises(PackingError, match="does not apply to preference data") as info:
        pack_files(str(src), str(tmp_path / "out"), max_length=64, context_parallel=2)
    assert info.value.param == "context_parallel"


def test_cli_flag(corpus, tmp_path, capsys):
    _, path, _, _ = corpus
    out = str(tmp_path / "out")
    assert main(["pack", path, "--out", out, "--max-length", str(MAX), "--context-parallel", "2"]) == 0
    printed = capsys.readouterr().out
    assert "CP padding (N=2)" in printed and "% of the rows' capacity lost" in printed
    assert "CP work per rank" in printed and "off its mean (chunk pairs balanced per document" in printed
    assert manifest(out)["config"]["context_parallel"] == 2
    _, seqs = packed_rows(out)
    check_rows_fit(seqs, 2, MAX)
    assert main(["pack", path, "--out", str(tmp_path / "x.parquet"), "--context-parallel", "2"]) == 1
    assert "--context-parallel" in capsys.readouterr().err
    assert (
        main(["pack", path, "--out", str(tmp_path / "y"), "--max-length", "100", "--context-parallel", "4"])
        == 1
    )
    assert "--max-length" in capsys.readouterr().err


def test_prepare_trainer_holds_a_packed_folder_to_its_max_length(corpus):
    """prepare_trainer(context_parallel=N)'s collator reads the folder's max_length from its manifest: rows
    packed at 2 train at 2 and are refused by row at 4; a dataset without a manifest is not held to one."""
    from types import SimpleNamespace

    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.trainers.context_parallel import cp_collator, packed_max_length

    d, path, _, _ = corpus
    out = pack_files(path, str(d / "trainer2"), MAX, "bfd_split", context_parallel=2).out
    ds = datasets.load_from_disk(out)
    assert packed_max_length(ds) == MAX
    assert packed_max_length(datasets.Dataset.from_dict({"input_ids": [[1, 2]]})) is None
    trainer = SimpleNamespace(train_dataset=ds, data_collator=PaddingFreeCollator(0))
    rows = [ds[i] for i in range(len(ds))]
    at2 = cp_collator(trainer, RankLayout(0, 1, cp_rank=1, cp_size=2))
    assert at2.max_length == MAX
    for i in range(0, len(rows), 8):
        at2(rows[i : i + 8])  # every batch of rows packed for 2 is cut at 2
    # at 4: refused when the trainer is prepared (every row checked once, from seq_lengths), not mid-run ...
    with pytest.raises(PackingError, match=r"row \d+ .*once padded for context_parallel=4"):
        cp_collator(trainer, RankLayout(0, 1, cp_rank=0, cp_size=4))
    # ... and a collator given the max_length refuses such a batch too
    from packtools.batches.context_parallel import ContextParallelCollator

    at4 = ContextParallelCollator(PaddingFreeCollator(0), 4, 0, max_length=MAX)
    with pytest.raises(PackingError, match="once padded for context_parallel=4"):
        for i in range(0, len(rows), 8):
            at4(rows[i : i + 8])
