"""In-memory packing for context parallelism (``pack_dataset(..., context_parallel=N)``,
:mod:`packtools.core.cp_budget`): documents planned at their CP-padded length exactly as ``pack_files`` plans them
offline, so every row fits ``max_length`` once the collator pads it; the padding reported as fill lost; and
``prepare_trainer(trainer, context_parallel=N)``'s collator holding ``pack_dataset`` output to its ``max_length``
once padded, every row checked before training and refused by row."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools import PaddingFreeCollator, pack_dataset
from packtools.batches.context_parallel import CPLayout
from packtools.core.cp_budget import check_rows_fit, cp_padded_lengths
from packtools.errors import PackingError
from packtools.pipeline import pack_files

datasets = pytest.importorskip("datasets")

from test_cp_offline import MAX, long_tailed  # noqa: E402  (the same long-tailed lengths as offline)


@pytest.fixture(scope="module")
def corpus():
    lengths = long_tailed()
    start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = [list(range(int(s) + 1, int(s + n) + 1)) for s, n in zip(start, lengths)]  # every token unique
    return datasets.Dataset.from_dict({"input_ids": rows}), rows


def packed(ds):
    """Rows and their documents as the CP collator sees them (``wrapped`` rows: one sequence each)."""
    table = ds.data.table
    ids = table.column("input_ids").to_pylist()
    if "seq_lengths" not in table.column_names:
        return ids, [[len(r)] for r in ids]
    return ids, table.column("seq_lengths").to_pylist()


STRATEGIES = ["bfd", "bfd_split", "wrapped"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [2, 4])
def test_rows_fit_max_length_after_cp_padding_and_the_padding_is_reported(corpus, strategy, n):
    ds, rows = corpus
    out, report = pack_dataset(ds, MAX, strategy, context_parallel=n, return_report=True)
    ids, seqs = packed(out)
    padded = [int(cp_padded_lengths(s, n).sum()) for s in seqs]
    assert max(padded) <= MAX
    if strategy != "wrapped":  # the same, read from the Arrow column
        check_rows_fit(out.data.table.column("seq_lengths"), n, MAX)
    assert all(sum(s) == len(r) for s, r in zip(seqs, ids))  # real tokens only: the collator pads
    kept = [t for r in ids for t in r]
    want = [t for r in rows for t in (r[:MAX] if strategy == "bfd" else r)]
    assert sorted(kept) == sorted(want)
    if strategy == "wrapped":  # the stream in order, every row full but the last: padding only there
        assert kept == want and all(len(r) == MAX for r in ids[:-1])
    lost = sum(CPLayout.build(s, n).fill_lost for s in seqs)
    assert report.context_parallel == n and report.cp_padding_tokens == lost
    assert lost > 0 or strategy == "wrapped"
    assert report.cp_fill_lost == pytest.approx(lost / (len(seqs) * MAX))
    assert report.tokens_kept == len(kept)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_rows_are_those_pack_files_writes_offline(corpus, tmp_path, strategy):
    """One rule, two front doors: the in-memory rows equal the offline rows, row for row."""
    ds, rows = corpus
    path = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))}), path)
    res = pack_files(path, str(tmp_path / "out"), MAX, strategy, context_parallel=4)
    offline = datasets.load_from_disk(res.out).data.table
    memory = pack_dataset(ds, MAX, strategy, context_parallel=4).data.table
    assert memory.column_names == offline.column_names
    for name in memory.column_names:
        assert memory.column(name).to_pylist() == offline.column(name).to_pylist()
    report = pack_dataset(ds, MAX, strategy, context_parallel=4, return_report=True)[1]
    assert report.cp_padding_tokens == res.stats["cp_padding_tokens"]
    assert report.cp_fill_lost == pytest.approx(res.stats["cp_fill_lost"])


def test_negative_control_packed_without_cp_overflows_once_padded(corpus):
    ds, _ = corpus
    out, report = pack_dataset(ds, MAX, "bfd_split", return_report=True)
    _, seqs = packed(out)
    assert report.context_parallel == 1 and report.cp_padding_tokens == 0
    for n in (2, 4):
        assert max(int(cp_padded_lengths(s, n).sum()) for s in seqs) > MAX
        with pytest.raises(PackingError, match=f"once padded for context_parallel={n}, over max_length"):
            check_rows_fit(out.data.table.column("seq_lengths"), n, MAX)


def test_one_is_no_cp_and_the_cp_size_is_in_the_key(corpus):
    ds, _ = corpus
    plain = pack_dataset(ds, MAX, "bfd_split")
    one = pack_dataset(ds, MAX, "bfd_split", context_parallel=1)
    two = pack_dataset(ds, MAX, "bfd_split", context_parallel=2)
    assert one[:] == plain[:] and one._fingerprint == plain._fingerprint
    assert two._fingerprint != plain._fingerprint and two[:] != plain[:]


def test_a_dataset_dict_an_iterable_and_a_cache_file_fit_too(corpus, tmp_path):
    ds, _ = corpus
    split = pack_dataset(datasets.DatasetDict({"train": ds}), MAX, "bfd_split", context_parallel=2)["train"]
    check_rows_fit(split.data.table.column("seq_lengths"), 2, MAX)
    stream = pack_dataset(ds.to_iterable_dataset(), MAX, "bfd_split", window=50, context_parallel=2)
    seqs = [r["seq_lengths"] for r in stream]
    check_rows_fit(seqs, 2, MAX)
    assert sum(map(sum, seqs)) == sum(len(r) for r in ds["input_ids"])
    ds.save_to_disk(str(tmp_path / "src"))  # memory-mapped: packed block by block into a cache file
    mapped = pack_dataset(datasets.load_from_disk(str(tmp_path / "src")), MAX, "bfd", context_parallel=4)
    assert mapped.cache_files and mapped[:] == pack_dataset(ds, MAX, "bfd", context_parallel=4)[:]


def test_options_cp_cannot_keep_are_refused_by_name(corpus):
    ds, _ = corpus
    with pytest.raises(PackingError, match=r"max_length=100 is not one.*e\.g\. 96"):
        pack_dataset(ds, 100, "bfd", context_parallel=4)
    with pytest.raises(PackingError, match=r"max_length=250 is not one.*e\.g\. 248"):
        pack_dataset(ds, 250, "wrapped", context_parallel=2)
    with pytest.raises(PackingError, match="context_parallel must be a positive int"):
        pack_dataset(ds, MAX, "bfd", context_parallel=0)
    vision = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3]], "pixel_values": [[[0.0] * 4]], "image_grid_thw": [[[1, 1, 1]]]}
    )
    with pytest.raises(PackingError, match="context_parallel=2 with vision-language samples"):
        pack_dataset(vision, MAX, "bfd", context_parallel=2)


def collator_of(dataset, cp_size: int, cp_rank: int = 0, **inner):
    """What ``prepare_trainer(trainer, context_parallel=cp_size)`` installs as the collator (one process of it)."""
    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.trainers.context_parallel import cp_collator

    trainer = SimpleNamespace(train_dataset=dataset, data_collator=PaddingFreeCollator(0, **inner))
    return cp_collator(trainer, RankLayout(0, 1, cp_rank=cp_rank, cp_size=cp_size))


def test_prepare_trainer_holds_pack_dataset_output_to_its_max_length(corpus, tmp_path):
    """``prepare_trainer(context_parallel=N)`` on ``pack_dataset`` output: the max_length read from the
    dataset's record (also after shuffle / select / save_to_disk), every row checked before training; packed at
    4, rows train at 2 and 4; packed without CP, the first row that overflows once padded is refused by its
    index in the dataset as the trainer reads it."""
    from packtools.integrations.data.datasets import packing_record
    from packtools.integrations.trainers.context_parallel import packed_max_length

    ds, _ = corpus
    at4 = pack_dataset(ds, MAX, "bfd_split", context_parallel=4, shuffle=True, seed=3)
    assert packing_record(at4) == {"max_length": MAX, "strategy": "bfd_split", "context_parallel": 4}
    at4.save_to_disk(str(tmp_path / "saved"))
    saved = datasets.load_from_disk(str(tmp_path / "saved"))
    for view in (at4, at4.shuffle(seed=1), at4.select(range(10)), at4.with_format("torch"), saved):
        assert packed_max_length(view) == MAX
    for n in (2, 4):
        collator = collator_of(at4, n, n - 1)
        assert collator.max_length == MAX
        for i in range(0, len(at4), 16):
            collator([at4[j] for j in range(i, min(i + 16, len(at4)))])
    plain = pack_dataset(ds, MAX, "bfd_split")
    _, seqs = packed(plain)
    over = [i for i, s in enumerate(seqs) if int(cp_padded_lengths(s, 2).sum()) > MAX]
    fits = [i for i, s in enumerate(seqs) if int(cp_padded_lengths(s, 2).sum()) <= MAX]
    order = fits[:3] + [over[-1]] + fits[3:6]  # the trainer's row 3 is the table's row over[-1]
    assert over[-1] != 3
    message = rf"^row 3 \(documents {re.escape(str(seqs[over[-1]]))}, .*context_parallel=2, over max_length"
    with pytest.raises(PackingError, match=message):
        collator_of(plain.select(order), 2)
    # Without that row the same rows are accepted: the refusal is that row's.
    assert collator_of(plain.select(order[:3] + order[4:]), 2).max_length == MAX


def test_prepare_trainer_holds_wrapped_rows_as_one_sequence_each(corpus):
    """``wrapped`` rows carry no ``seq_lengths``: each is one sequence, held to max_length as a whole.  Packed
    for CP (a max_length that is a multiple of 2N) they fit; packed at 250 without CP, a full row of 250 tokens
    is 252 once padded for CP=2 and refused by its row index."""
    ds, _ = corpus
    fits = pack_dataset(ds, MAX, "wrapped", context_parallel=2)
    collator = collator_of(fits, 2, 1, unpacked=True)  # rows without seq_lengths: one sequence each
    assert collator.max_length == MAX
    shard = collator([fits[i] for i in range(4)])
    assert shard["cu_seqlens"].tolist() == [0, MAX, 2 * MAX, 3 * MAX, 4 * MAX]
    plain = pack_dataset(ds, 250, "wrapped")
    with pytest.raises(PackingError, match=r"^row 0 \(documents \[250\], 250 tokens\) is 252 tokens"):
        collator_of(plain, 2)
    last = len(plain) - 1  # the last, shorter row alone may fit: then only it is accepted
    if int(cp_padded_lengths([len(plain[last]["input_ids"])], 2)[0]) <= 250:
        assert collator_of(plain.select([last]), 2).max_length == 250


def test_packed_rows_of_unknown_max_length_are_said_not_checked():
    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "seq_lengths": [[2, 1]]})
    with pytest.warns(UserWarning, match="cannot read.*not checked against it once padded"):
        collator = collator_of(rows, 2)
    assert collator.max_length is None
    plain = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})  # unpacked rows: nothing to say
    assert collator_of(plain, 2).max_length is None
