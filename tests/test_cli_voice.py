"""One voice for the CLI and the API: ``packtools pack`` prints the warning ``pack_files`` raises when tokens
are dropped, and ``packtools profile`` of a packed folder reads its manifest."""

from __future__ import annotations

import os
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packtools.cli.main import main
from packtools.integrations.data.drops import TokensDroppedWarning
from packtools.pipeline import pack_files


@pytest.fixture
def tokenized(tmp_path):
    path = tmp_path / "tok.parquet"
    pq.write_table(pa.table({"input_ids": [list(range(n)) for n in (3, 12, 5, 20)]}), path)
    return str(path)


def test_pack_files_warns_and_the_cli_prints_it(tmp_path, tokenized, capsys):
    with pytest.warns(
        TokensDroppedWarning, match=r"dropped 16 of 40 tokens .*strategy='bfd_split' keeps every"
    ):
        pack_files(tokenized, str(tmp_path / "api"), 8)
    assert main(["pack", tokenized, "--out", str(tmp_path / "cli"), "--max-length", "8", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "packtools pack: warning:" in err and "dropped 16 of 40 tokens" in err and "bfd_split" in err
    # a cached rerun says it again: the output still lacks those tokens
    assert main(["pack", tokenized, "--out", str(tmp_path / "cli"), "--max-length", "8", "--quiet"]) == 0
    assert "dropped 16 of 40 tokens" in capsys.readouterr().err
    # nothing dropped: nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokensDroppedWarning)
        pack_files(tokenized, str(tmp_path / "split"), 8, "bfd_split")


@pytest.mark.parametrize("strategy", ["bfd_split", "wrapped"])
def test_a_drop_by_the_overlong_policy_names_overlong_split(tmp_path, tokenized, strategy):
    """bfd_split or wrapped with --overlong drop/truncate: the tokens go by the policy, and the warning named
    strategy='bfd_split' as the fix, the strategy the user had chosen; it names overlong='split'."""
    for overlong in ("drop", "truncate"):
        with pytest.warns(TokensDroppedWarning) as caught:
            pack_files(tokenized, str(tmp_path / f"{strategy}-{overlong}"), 8, strategy, overlong=overlong)
        text = str(caught[0].message)
        assert f"strategy={strategy!r}, overlong={overlong!r}" in text and "overlong='split'" in text, text
        assert "strategy='bfd_split' keeps" not in text


def test_pack_without_out_says_nothing_was_written(tmp_path, tokenized, capsys, monkeypatch):
    """`packtools pack FILE --max-length N` (no --out) printed the summary of a pack (rows out, tokens kept)
    and wrote nothing, without a word."""
    monkeypatch.chdir(tmp_path)
    assert main(["pack", tokenized, "--max-length", "32", "--strategy", "bfd_split"]) == 0
    out = capsys.readouterr().out
    assert "rows out" in out and "nothing written (no --out)" in out
    assert sorted(os.listdir(tmp_path)) == ["tok.parquet"]
    assert main(["pack", tokenized, "--max-length", "32", "--out", str(tmp_path / "p.parquet")]) == 0
    assert "nothing written" not in capsys.readouterr().out


def test_profile_of_a_packed_folder_reads_its_manifest(tmp_path, tokenized, capsys):
    out = str(tmp_path / "packed")
    pack_files(tokenized, out, 32, "bfd_split")
    capsys.readouterr()
    assert main(["profile", out]) == 0
    text = capsys.readouterr().out
    assert text.startswith("packed: 4 sequences")
    assert "of max_length 32 (from manifest.json)" in text
    assert "no manifest" not in text


def test_profile_of_a_bfd_folder_says_its_lengths_are_truncated(tmp_path, tokenized, capsys):
    """A folder packed with bfd holds the truncated sequences: its profile showed them as the data's lengths
    (max = max_length, "every sequence fits") without saying that 2 of 4 had been cut."""
    out = str(tmp_path / "bfd")
    with pytest.warns(TokensDroppedWarning):
        pack_files(tokenized, out, 8)
    capsys.readouterr()
    assert main(["profile", out]) == 0
    assert "2 sequences were truncated to max_length when packed" in capsys.readouterr().out


def test_profile_of_a_wrapped_folder_is_refused(tmp_path, tokenized, capsys):
    """A wrapped output has no seq_lengths: it was profiled as its rows (every one max_length long) with a
    recommendation made from them, where the docs say a packtools folder is profiled by its sequences."""
    from packtools import profile_lengths
    from packtools.errors import PackingError

    out = str(tmp_path / "wrapped")
    pack_files(tokenized, out, 8, "wrapped")
    with pytest.raises(PackingError, match="strategy 'wrapped'") as e:
        profile_lengths(out)
    assert tokenized in str(e.value)  # the inputs to profile instead
    capsys.readouterr()
    assert main(["profile", out]) == 1
    assert "profile the inputs it was packed from" in capsys.readouterr().err


def test_the_console_script_freezes_what_it_holds_before_the_interpreter_exits(monkeypatch):
    import gc

    import tomllib

    import packtools.cli.main as cli

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as fh:
        assert tomllib.load(fh)["project"]["scripts"]["packtools"] == "packtools.cli.main:console"
    monkeypatch.setattr(cli, "main", lambda: 3)
    assert gc.get_freeze_count() == 0
    try:
        assert cli.console() == 3  # main's status, unchanged
        assert gc.get_freeze_count() > 0  # the shutdown's collections skip what was held
    finally:
        gc.unfreeze()


def test_ctrl_c_before_the_command_runs_is_one_line_and_130(monkeypatch, capsys):
    """A Ctrl-C while the CLI still reads its options and imports its command's modules (before the command's
    own handling) ends with its one line and 130, as later, not a traceback."""
    import packtools.cli.main as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["pack", "x.jsonl", "--out", "o", "--max-length", "8"]) == 130
    assert capsys.readouterr().err == "packtools pack: interrupted by Ctrl-C; stopped.\n"
    assert main(["--help"]) == 130
    assert capsys.readouterr().err == "packtools: interrupted by Ctrl-C; stopped.\n"


def test_cli_errors_name_the_flags_not_the_python_arguments():
    """Two library messages a command-line user reads told them to pass Python arguments that the command
    spells otherwise: a tokenizer without eos_token said 'pass add_eos=False' (the flag is --no-eos), and the
    engine errors said tokenizer_engine='auto' (--tokenizer-engine auto)."""
    from packtools.cli.main import cli_words

    no_eos = (
        "the tokenizer in '/t' has no eos_token, so none can end each sequence; set eos_token in its "
        "tokenizer_config.json or pass add_eos=False."
    )
    assert cli_words(no_eos, "tokenizer").endswith("or pass --no-eos.")
    engine = "transformers can: rerun with tokenizer_engine='auto' or 'transformers'."
    assert cli_words(engine) == "transformers can: rerun with --tokenizer-engine 'auto' or 'transformers'."
