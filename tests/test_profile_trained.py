"""Trained (label) tokens as a first-class figure: the profile of chat data, its tradeoff table and its token
rule count them, and agree with what ``pack_files`` reports for the same data."""

from __future__ import annotations

import json
import warnings

import pytest
from _pipeline_data import CHATML_PLAIN, build_tokenizer

from packtools.integrations.data.drops import TokensDroppedWarning
from packtools.pipeline import pack_files
from packtools.pipeline.profile import profile_files

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = build_tokenizer(str(root / "tok"), CHATML_PLAIN)
    path = root / "chat.jsonl"
    with open(path, "w") as fh:
        for i in range(40):
            conv = [{"role": "system", "content": "be brief"}] if i % 2 else []
            for t in range(1 + i % 4):
                conv.append({"role": "user", "content": "the quick brown fox " * (1 + (i * 7 + t) % 19)})
                conv.append({"role": "assistant", "content": "hello world " * (1 + (i + t) % 3)})
            if i % 5 == 0:
                conv = conv[:1] + [{"role": "user", "content": "tokens"}]  # a row that trains nothing
            fh.write(json.dumps({"messages": conv}) + "\n")
    return str(path), tok


def test_profile_tradeoffs_and_pack_agree_on_trained_tokens(chat, tmp_path):
    path, tok = chat
    profile = profile_files(path, tok, stage_cache=False).profile
    trained = profile.trained
    assert trained is not None and "trained tokens" in profile.to_text()
    table = profile.tradeoffs([64, 128, 256])
    assert "trained kept" in table.to_text() and "training nothing" in table.to_text()
    for row in table:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TokensDroppedWarning)
            stats = pack_files(
                path, str(tmp_path / f"bfd{row.max_length}"), row.max_length, tokenizer=tok
            ).stats
        # two computations: the profile from the staged labels' positions, the pack from the truncated rows
        assert stats["tokens_trained_in"] == trained.total
        assert row.trained_kept == pytest.approx(stats["tokens_trained_kept"] / stats["tokens_trained_in"])
        assert row.untrained == pytest.approx(stats["tokens_untrained"] / stats["tokens_kept"])
    assert table[0].trained_kept < 1.0 and table[0].untrained > table[-1].untrained
    # bfd_split (turns) keeps every trained token where bfd does not, and trains on every sequence it packs
    split = pack_files(path, str(tmp_path / "split"), 64, "bfd_split", tokenizer=tok).stats
    assert split["tokens_trained_kept"] >= trained.kept_by_bfd(64)
    # only the input's own unlabeled rows, each as the sequences bfd_split's plan cuts it into
    idle = (trained.lengths > 0) & (trained.first >= trained.lengths)
    assert (
        split["sequences_untrained"]
        == int((-(-trained.lengths[idle] // 64)).sum())
        >= trained.rows_without()[0]
    )


def test_token_rule_counts_trained_tokens(chat):
    path, tok = chat
    profile = profile_files(path, tok, stage_cache=False).profile
    rec = profile.recommend(keep_tokens=0.95, multiple_of=16)
    m, t = rec.max_length, profile.trained
    assert t.kept_by_bfd(m) >= 0.95 * t.total > t.kept_by_bfd(m - 16)
    assert "trained (label) tokens" in rec.reason and rec.options[1].label.startswith("trained tokens kept")


def test_the_tradeoff_plot_draws_trained_tokens_kept(chat):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg", force=True)
    from packtools.profiling.plot import plot_tradeoffs

    path, tok = chat
    profile = profile_files(path, tok, stage_cache=False).profile
    ax = plot_tradeoffs(profile, [64, 128, 256])
    line = next(ln for ln in ax.lines if ln.get_label() == "trained (label) tokens kept, bfd")
    want = [100 * r.trained_kept for r in profile.tradeoffs([64, 128, 256])]
    assert list(line.get_ydata()) == pytest.approx(want)


@pytest.mark.parametrize("overlong", ["split", "truncate"])
def test_wrapped_counts_trained_tokens_by_its_packed_rows(tmp_path, overlong):
    """Under ``wrapped`` each packed row is one sequence as the model sees it (no ``seq_lengths``; the collator
    masks the row's first label). The manifest counted by the input documents instead: every trained token
    kept and no sequence untrained, while rows cut from a long prompt train nothing and each row's first
    trained token is masked. The counts are checked against the written rows."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    ignore = -100
    docs = [
        ([ignore] * 11 + [5, 6, 7], 14),  # a long prompt: its first rows train nothing
        ([1, 2, 3, 4, 5], 5),  # trained from its first token
        ([ignore, 8, 9], 3),
        ([ignore] * 9 + [4], 10),
        ([7] * 6, 6),
    ]
    labels = [lab for lab, _ in docs]
    src = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"input_ids": [[3] * n for _, n in docs], "labels": labels}), src)
    stats = pack_files(str(src), str(tmp_path / "o"), 4, "wrapped", overlong=overlong).stats
    rows = datasets.load_from_disk(str(tmp_path / "o"))["labels"]
    trained = [sum(x != ignore for x in row[1:]) for row in rows]
    assert stats["tokens_trained_kept"] == sum(trained)
    assert stats["sequences_untrained"] == sum(t == 0 for t in trained) > 0
    assert stats["tokens_untrained"] == sum(len(r) for r, t in zip(rows, trained) if t == 0)
    # the input's own figure is unchanged: labels after each document's first token
    assert stats["tokens_trained_in"] == sum(sum(x != ignore for x in lab[1:]) for lab in labels)
    # the summary says which sequences each figure counts (the rows may hold more than the input: "11 kept of 8")
    from packtools.pipeline.summary import format_pipeline_summary

    text = " ".join(format_pipeline_summary(stats, str(tmp_path / "o")).split())
    assert f"{stats['tokens_trained_kept']:,} in the packed rows" in text and "kept of" not in text
