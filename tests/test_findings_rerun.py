"""Earlier adversarial findings re-run on today's tree (issue 40: "a re-run of every earlier finding stays fixed,
a test per case").  Most cases of ``adversarial-2026-12``, ``-12b`` and ``-12c`` have their own regression test
elsewhere (named in each module's docstring); the cases here had none.  Each test is named after its file and
case, runs the finding's repro on a tiny input, and asserts the fixed behaviour, with a negative control where
the fix rests on a check."""

from __future__ import annotations

import errno
import fcntl
import os

import _stage_fixtures
import pytest

from packtools import pack_files
from packtools.errors import PackingError
from packtools.pipeline.profile import profile_files

# The shared fixtures (tests/_stage_fixtures.py), named here for pytest to find.
tok, cache, data = _stage_fixtures.tok, _stage_fixtures.cache, _stage_fixtures.data

# -- adversarial-2026-12 ----------------------------------------------------------------------------------------


def test_2026_12_U14_a_foreign_lock_holder_is_not_named_pid_question_mark(tmp_path, data, tok):
    """U14: a process that holds the lock file without a packtools record in it (a foreign ``flock``, or a run
    between its flock and its write) was named ``pid ? on host ?, since ?``."""
    out = str(tmp_path / "out")
    lock_path = str(tmp_path / ".out.packtools.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held, the file empty: nobody wrote who holds it
        with pytest.raises(PackingError, match="another process holds the lock file") as info:
            pack_files(data, out, 64, tokenizer=tok)
        msg = str(info.value)
        assert "?" not in msg.split("(")[1] and repr(lock_path) in msg and "choose another out" in msg
        assert info.value.param == "out"
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert pack_files(data, out, 64, tokenizer=tok).stats["rows_in"] == 300  # released: the run goes through


def test_2026_12_U15_the_summary_fits_its_width_with_values_left_aligned(tmp_path, data, tok):
    """U15: the summary was a 210-column table, every value right-aligned to the width of the engine reason."""
    from packtools.pipeline.summary import WIDTH, format_pipeline_summary

    res = pack_files(data, str(tmp_path / "out"), 64, tokenizer=tok)
    text = format_pipeline_summary(res.stats, res.out, timings=res.timings)
    lines = text.splitlines()
    assert WIDTH <= 100 and max(len(line) for line in lines) <= WIDTH
    rows_in = next(line for line in lines if line.startswith("rows in "))
    col = rows_in.index("300")  # the value column: right after the longest label and two spaces
    assert rows_in == "rows in".ljust(col) + "300"  # left-aligned, not padded to the widest value
    assert all(line[col] != " " and line[col - 2 : col] == "  " for line in lines if line.strip()), text


def test_2026_12_S16_parts_another_engine_staged_are_not_reused(tok, data, cache, tmp_path):
    """S16: parts staged under the fast engine (a killed auto run's, or here ``profile``'s in the stage cache)
    were reused by a rerun with ``--tokenizer-engine transformers``, whose output then kept no trace of the fast
    engine.  The engine is in the stage key: the rerun tokenizes with transformers and says so.  Control: an
    auto pack after the same profile takes the cached part."""
    profile_files(data, tok)
    asked = pack_files(data, str(tmp_path / "asked"), 64, tokenizer=tok, tokenizer_engine="transformers")
    assert asked.timings["parts_from_stage_cache"] == 0
    assert asked.stats["tokenizer"]["engine"] == "transformers"
    assert asked.stats["tokenizer"]["parts_by_engine"] == {"transformers": 1}
    auto = pack_files(data, str(tmp_path / "auto"), 64, tokenizer=tok)
    assert auto.timings["parts_from_stage_cache"] == 1
    assert auto.stats["tokens_in"] == asked.stats["tokens_in"]


def test_2026_12_U2_cut_files_name_the_file_in_profile_too(tmp_path, capsys):
    """U2: ``ArrowInvalid: Parquet magic bytes not found``, ``Expected to read ... metadata bytes`` and the like
    named no file, in ``pack`` and in ``profile`` alike.  (tests/test_pipeline_inputs.py covers pack on a cut
    stream and parquet; here the Arrow IPC *file* cut at 2/3, a parquet less its last 10 bytes, and profile.)"""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packtools.cli.main import main

    table = pa.table({"input_ids": pa.array([[i, i + 1] for i in range(300)], pa.list_(pa.int32()))})
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=100):
            w.write_batch(batch)
    pq.write_table(table, str(tmp_path / "ok.parquet"))
    arrow, parquet = (tmp_path / "f.arrow").read_bytes(), (tmp_path / "ok.parquet").read_bytes()
    (tmp_path / "cut.arrow").write_bytes(arrow[: 2 * len(arrow) // 3])
    (tmp_path / "tail.parquet").write_bytes(parquet[:-10])
    for name in ("cut.arrow", "tail.parquet"):
        path = str(tmp_path / name)
        for argv in (["pack", path, "--out", str(tmp_path / "out"), "--max-length", "8"], ["profile", path]):
            assert main(argv) == 1
            err = capsys.readouterr().err
            assert f"{name}' cannot be read as" in err and "copy it again" in err, err
            assert "ArrowInvalid" not in err and "OSError" not in err
    assert main(["profile", str(tmp_path / "f.arrow")]) == 0  # control: the whole file reads


def test_2026_12_U12_a_length_only_difference_says_where_the_ids_part():
    """U12: the fast/transformers difference showed two identical prefixes (only the lengths differed)."""
    from packtools.pipeline.tokenizer.fast import describe_difference

    same = list(range(100, 140))
    msg = describe_difference(["hello world " * 30], 0, same + [7, 8], same)
    assert "ids differ from position 40 of 42 (fast) / 40 (transformers)" in msg
    assert "fast [7, 8], transformers []" in msg and "hello world" in msg
    inner = describe_difference(["x"], 0, [1, 2, 3], [1, 9, 3])
    assert "position 1 of 3 (fast) / 3 (transformers): fast [2, 3], transformers [9, 3]" in inner


# -- adversarial-2026-12b ---------------------------------------------------------------------------------------


def test_2026_12b_U5_a_cache_that_fills_during_profile_is_left_out_saying_so(tok, data, cache, monkeypatch):
    """U5: the stage cache filled up while ``profile`` wrote an entry: ``OSError: [Errno 28] Error writing
    bytes`` with no folder and no fix.  The profile now stages aside (not kept), with a note naming the cache
    and ``$PACKTOOLS_STAGE_CACHE``; the numbers are the same as with room in the cache (negative control)."""
    import packtools.pipeline.profile as profile

    real = profile.stage_part
    full = []

    def no_room(job, *args, **kwargs):
        if os.path.dirname(os.path.abspath(job.staged)) == os.path.abspath(cache):
            full.append(job.staged)
            raise OSError(errno.ENOSPC, "No space left on device", job.staged)
        return real(job, *args, **kwargs)

    monkeypatch.setattr(profile, "stage_part", no_room)
    res = profile_files(data, tok)
    assert full and res.profile.count == 300 and not res.stage["kept"]
    note = next(n for n in res.notes if "cannot be written" in n)
    assert repr(cache) in note and "No space left on device" in note and "PACKTOOLS_STAGE_CACHE" in note
    monkeypatch.setattr(profile, "stage_part", real)
    roomy = profile_files(data, tok)
    assert roomy.stage["kept"] and roomy.profile.count == 300
    assert list(roomy.profile.lengths) == list(res.profile.lengths)


def test_2026_12b_U6_a_higher_audit_rate_after_profile_stages_again(tok, data, cache, tmp_path):
    """U6: ``pack --tokenizer-audit 1`` after a ``profile`` took the part the profile staged (audited at 0.001)
    and had no engine-checks line: the audit rate was not in the stage key.  Now it is: the part is tokenized
    again and every row compared.  Control: the same pack at the default rate takes the cached part."""
    from packtools.pipeline.tokenizer.fast import engine_version

    profile_files(data, tok)
    audited = pack_files(data, str(tmp_path / "audited"), 64, tokenizer=tok, tokenizer_audit=1.0)
    assert audited.timings["parts_from_stage_cache"] == 0
    report = audited.stats["tokenizer"]
    if engine_version() is not None and report["engine"] != "transformers":
        checked = report["checked"]  # the driver's proof rows, then every row of the part audited
        assert checked["rows_checked"] - checked["proof_rows"] == 300, checked
    plain = pack_files(data, str(tmp_path / "plain"), 64, tokenizer=tok)
    assert plain.timings["parts_from_stage_cache"] == 1
    assert audited.stats["tokens_in"] == plain.stats["tokens_in"]


# -- adversarial-2026-12c ---------------------------------------------------------------------------------------


def test_2026_12c_falcon_alibi_on_sdpa_is_prepared_not_a_traceback(tmp_path):
    """Traceback case: ``FalconForCausalLM(alibi=True)`` on ``sdpa`` through ``prepare_trainer`` raised
    ``AttributeError: 'DocumentMask' object has no attribute 'dtype'`` (the segmented mask reached Falcon's
    ALiBi path).  Now the model keeps ``sdpa``, which separates packed documents by ``position_ids``, passes
    the isolation probe and trains."""
    datasets = pytest.importorskip("datasets")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import packtools
    from packtools.integrations import check_isolation

    torch.manual_seed(0)
    config = transformers.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, alibi=True,
        new_decoder_architecture=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.FalconForCausalLM(config)
    rows = packtools.pack_dataset(
        datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]}),
        max_length=16,
    )
    args = transformers.TrainingArguments(
        str(tmp_path), max_steps=1, per_device_train_batch_size=1, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model, args, train_dataset=rows, data_collator=packtools.PaddingFreeCollator(pad_token_id=0)
    )
    packtools.prepare_trainer(trainer)
    assert trainer.model.config._attn_implementation == "sdpa"
    assert not check_isolation(trainer.model, backward=True).leaks
    loss = trainer.train().training_loss
    assert loss == loss and 0.0 < loss < 10.0  # finite: a real step ran
