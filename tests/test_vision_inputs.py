"""Vision inputs as the model's processor sees them, and every bad input named by file and line (issue 40).

Regressions of the 2026-12c adversarial round: EXIF orientation (finding 3), a replaced image file keeping the
old pixels (finding 4), the raw tracebacks and unclear messages of ``pack --processor`` / ``profile``, and the
assistant-only mask of vision samples (newcomer §5)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _vl_models import IMAGE, processor_folder

from packtools.cli.main import main
from packtools.errors import PackingError
from packtools.integrations.multimodal.processor import load_vision_processor, process_vision_sample
from packtools.pipeline.vision import pack_vision_files

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

ASK = [{"type": "image"}, {"type": "text", "text": "what is this"}]


def _row(images, content=None, answer="a cat"):
    answer = [{"type": "text", "text": answer}]
    msgs = [{"role": "user", "content": content or ASK}, {"role": "assistant", "content": answer}]
    return {"messages": msgs, "images": images}


def _write(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _exif_photo(path: Path) -> None:
    """A JPEG stored 112 wide x 56 high whose EXIF orientation (6: turn 90°) shows it 56 wide x 112 high."""
    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 112, 3), dtype=np.uint8))
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(path, exif=exif.tobytes())


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    return processor_folder(tmp_path_factory.mktemp("proc"))


def _pack(data: Path, out: Path, proc: str, *extra: str) -> int:
    return main(["pack", str(data), "--out", str(out), "--processor", proc, "--max-length", "4096", *extra])


def test_exif_orientation_is_applied_as_the_processor_applies_it(tmp_path, proc):
    _exif_photo(tmp_path / "photo.jpg")
    data = _write(tmp_path, [_row(["photo.jpg"])])
    assert _pack(data, tmp_path / "out", proc) == 0
    got = datasets.load_from_disk(str(tmp_path / "out"))[0]
    ip = transformers.AutoImageProcessor.from_pretrained(proc)
    want = ip(images=[str(tmp_path / "photo.jpg")], return_tensors="np")  # load_image: exif_transpose
    assert want["image_grid_thw"].tolist() == [[1, 8, 4]]
    assert got["image_grid_thw"] == [[1, 8, 4]]
    assert np.array_equal(np.asarray(got["pixel_values"], np.float32), want["pixel_values"])
    # datasets' Image feature (which also turns the photo) and the path give the same sample in memory
    vp = load_vision_processor(proc)
    feature = datasets.Dataset.from_dict(
        {"images": [[str(tmp_path / "photo.jpg")]]},
        features=datasets.Features({"images": datasets.List(datasets.Image())}),
    )[0]["images"]
    by_feature = process_vision_sample(vp, _row(None)["messages"], feature)
    by_path = process_vision_sample(vp, _row(None)["messages"], [str(tmp_path / "photo.jpg")])
    assert by_feature["image_grid_thw"].tolist() == by_path["image_grid_thw"].tolist() == [[1, 8, 4]]
    assert np.array_equal(by_feature["pixel_values"], by_path["pixel_values"])
    # vision_lengths reads the turned size from the header
    from packtools.integrations.multimodal.processor import vision_lengths

    ds = datasets.Dataset.from_list([_row([str(tmp_path / "photo.jpg")])])
    assert vision_lengths(ds, proc).tolist() == [len(by_path["input_ids"])]


def test_palette_with_transparency_and_grey_open_as_the_processor_opens_a_path(tmp_path, proc):
    rng = np.random.default_rng(1)
    pal = Image.fromarray(rng.integers(0, 8, (56, 84), dtype=np.uint8), mode="L").convert("P")
    pal.info["transparency"] = 3
    pal.save(tmp_path / "pal.png", transparency=3)
    Image.fromarray(rng.integers(0, 255, (56, 56), dtype=np.uint8), mode="L").save(tmp_path / "grey.png")
    vp = load_vision_processor(proc)
    ip = transformers.AutoImageProcessor.from_pretrained(proc)
    for name in ("pal.png", "grey.png"):
        got = process_vision_sample(vp, _row(None)["messages"], [str(tmp_path / name)])
        want = ip(images=[str(tmp_path / name)], return_tensors="np")["pixel_values"]
        assert np.array_equal(got["pixel_values"], want), name


def test_a_replaced_image_changes_the_output(tmp_path, proc):
    Image.fromarray(np.full((56, 84, 3), 200, np.uint8)).save(tmp_path / "a.png")
    data = _write(tmp_path, [_row(["a.png"])])
    out = tmp_path / "out"
    assert _pack(data, out, proc) == 0
    before = np.asarray(datasets.load_from_disk(str(out))[0]["pixel_values"], np.float32)
    Image.fromarray(np.zeros((56, 84, 3), np.uint8)).save(tmp_path / "a.png")  # same size, other pixels
    r = pack_vision_files(data, out, processor=proc, max_length=4096)
    assert not r.cached and r.reused_blocks == 0
    got = np.asarray(datasets.load_from_disk(str(out))[0]["pixel_values"], np.float32)
    want = transformers.AutoImageProcessor.from_pretrained(proc)(
        images=[str(tmp_path / "a.png")], return_tensors="np"
    )["pixel_values"]
    assert np.array_equal(got, want) and not np.array_equal(got, before)
    assert pack_vision_files(data, out, processor=proc, max_length=4096).cached  # unchanged: kept


def _error(tmp_path, proc, capsys, rows, *extra) -> str:
    data = _write(tmp_path / "bad", rows)
    assert _pack(data, tmp_path / "out", proc, *extra) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_bad_inputs_are_named_by_file_line_and_image(tmp_path, proc, capsys):
    # the refused image under a folder of a long name: its path (over 80 characters wherever tmp_path is) was
    # cut to its first 80 characters, the file's name lost (under pytest-xdist's longer tmp_path too)
    (tmp_path / ("a-folder-of-a-long-name-" * 4)).mkdir()
    Image.fromarray(np.zeros((1, 300, 3), np.uint8)).save(
        tmp_path / ("a-folder-of-a-long-name-" * 4) / "thin.png"
    )
    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(tmp_path / "ok.png")
    noise = np.random.default_rng(3).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "noise.png")
    full = (tmp_path / "noise.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(full[:200])
    ok = _row([str(tmp_path / "ok.png")])
    where = str(tmp_path / "bad" / "data.jsonl")

    err = _error(
        tmp_path, proc, capsys, [ok, _row([str(tmp_path / ("a-folder-of-a-long-name-" * 4) / "thin.png")])]
    )
    assert f"{where}:2: image 0" in err and "thin.png" in err and "300x1" in err and "aspect ratio" in err
    err = _error(tmp_path, proc, capsys, [_row([str(tmp_path / "cut.png")])])
    assert f"{where}:1: cannot open image" in err and "cut.png" in err and "truncated" in err
    err = _error(tmp_path, proc, capsys, [ok, {"messages": [], "images": []}])
    assert f"{where}:2: 'messages' must be a non-empty list" in err
    err = _error(tmp_path, proc, capsys, [{**ok, "images": str(tmp_path / "ok.png")}])
    assert f"{where}:1: 'images' must be a list" in err
    err = _error(tmp_path, proc, capsys, [_row(["http://example.com/cat.png"])])
    assert f"{where}:1: image 'http://example.com/cat.png' is a URL; packtools does not fetch images" in err
    video = [{"type": "video"}, {"type": "text", "text": "what happens"}]
    err = _error(tmp_path, proc, capsys, [ok, _row([], content=video)])
    assert f"{where}:2: message 0 has a video part" in err
    err = _error(tmp_path, proc, capsys, [ok, {**ok, "id": 7}])
    assert f"{where}:2: the row has the key(s) ['id']" in err
    assert "--leave-out" not in err and "packtools pack has no option to leave row keys out" in err
    plain = _row([], content=[{"type": "text", "text": "hi"}])
    data = _write(tmp_path / "bad", [plain, plain, _row([str(tmp_path / "ok.png")])])
    assert (
        main(["pack", str(data), "--out", str(tmp_path / "o"), "--processor", proc, "--max-length", "12"])
        == 1
    )
    err = capsys.readouterr().err
    assert f"{where}:3: the sample has" in err and "> --max-length 12" in err


def test_python_api_names_leave_out_for_row_keys(tmp_path, proc):
    data = _write(tmp_path, [{**_row([], content=[{"type": "text", "text": "hi"}]), "id": 1}])
    with pytest.raises(PackingError, match=r"pack_vision_files\(\.\.\., leave_out=\['id'\]\)"):
        pack_vision_files(data, tmp_path / "out", processor=proc, max_length=64)


def test_vision_samples_train_the_assistant_turns_only(tmp_path, proc):
    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(tmp_path / "ok.png")
    vp = load_vision_processor(proc)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": "and now"},
        {"role": "assistant", "content": "a dog"},
    ]
    got = process_vision_sample(vp, msgs, [str(tmp_path / "ok.png")])
    ids, mask = got["input_ids"], got["assistant_masks"]
    tokens = vp.tokenizer.convert_ids_to_tokens(ids.tolist())
    trained = [t for t, m in zip(tokens, mask) if m]
    # the assistant turns as this template renders them (no generation prompt: the incremental rule's spans
    # start at the turn's header), nothing of the system prompt, the questions or the image
    assert trained == ["<|im_start|>", "assistant", "a", "cat", "<|im_end|>"] + [
        "<|im_start|>",
        "assistant",
        "a",
        "dog",
        "<|im_end|>",
    ]
    assert not mask[ids == IMAGE].any() and tokens.count("<|image_pad|>") == 4


@pytest.mark.parametrize("which", ["data", "state.json", "dataset_info.json"])
def test_a_vision_rerun_rebuilds_an_output_missing_a_file(tmp_path, proc, which):
    """A shard (or datasets' state/info file) deleted from a vision output: pack_vision_files reported the output
    done (cached) and load_from_disk failed on the missing shard; it packs again, as pack_files does."""
    rows = []
    for i in range(6):
        Image.fromarray(np.full((56, 56, 3), 40 * i, np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(_row([f"{i}.png"]))
    data = _write(tmp_path, rows)
    out = tmp_path / "out"
    first = pack_vision_files(data, out, processor=proc, max_length=24, shard_bytes=1)  # a shard per row
    shards = sorted(p.name for p in out.glob("*.arrow"))
    assert len(shards) > 1
    (out / (shards[0] if which == "data" else which)).unlink()
    again = pack_vision_files(data, out, processor=proc, max_length=24, shard_bytes=1)
    assert not again.cached
    assert datasets.load_from_disk(str(out)).num_rows == first.rows_out
    assert pack_vision_files(data, out, processor=proc, max_length=24, shard_bytes=1).cached  # whole again


def test_a_vision_rerun_into_a_damaged_output_says_it_packed_again(tmp_path, proc, capsys):
    """pack --processor repacked an output missing a shard without a word (the text path notes "... packed
    again"); it notes it now, on stderr as the text path does, and a rerun into a whole output notes nothing."""
    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(tmp_path / "0.png")
    data = _write(tmp_path, [_row(["0.png"]), _row(["0.png"])])
    out = tmp_path / "out"
    argv = ["pack", str(data), "--out", str(out), "--processor", proc, "--max-length", "24", "--quiet"]
    assert main(argv) == 0
    capsys.readouterr()
    shard = next(out.glob("*.arrow"))
    shard.unlink()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (
        f"packtools pack: note: {out} lacked {shard.name} (deleted since it was written): packed again" in err
    )
    assert main(argv) == 0
    assert "packed again" not in capsys.readouterr().err


def test_rows_with_images_are_not_tokenized_as_text(tmp_path, proc, capsys):
    """pack --tokenizer PROC (no --processor) on vision rows packed their text with one placeholder token per
    image and no image, without a word (and profile_files counted those lengths); both refuse now."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packtools import profile_files

    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(tmp_path / "0.png")
    data = _write(tmp_path, [_row(["0.png"]), _row(["0.png"])])
    assert main(["pack", str(data), "--out", str(tmp_path / "o"), "--tokenizer", proc, "--quiet"]) == 1
    assert "packtools pack --processor DIR" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    with pytest.raises(PackingError, match="holds images"):
        profile_files(str(data), tokenizer=proc)
    parts = tmp_path / "parquet"
    parts.mkdir()
    pq.write_table(pa.Table.from_pylist([_row(["0.png"])]), parts / "rows.parquet")  # an images column
    assert main(["pack", str(parts), "--out", str(tmp_path / "p"), "--tokenizer", proc, "--quiet"]) == 1
    assert "holds images (images)" in capsys.readouterr().err
    row = _row(["0.png"])  # transformers' layout: the image inside its part, no images column
    row["messages"][0]["content"] = [{"type": "image", "image": "0.png"}, {"type": "text", "text": "what?"}]
    del row["images"]
    parts_only = _write(tmp_path / "parts", [row])
    assert main(["pack", str(parts_only), "--out", str(tmp_path / "q"), "--tokenizer", proc, "--quiet"]) == 1
    assert "line 1: column 'messages' turn 0 part 0 is of type 'image'" in capsys.readouterr().err


def test_image_parts_after_the_first_rows_are_refused(tmp_path, proc):
    """Image parts in messages were looked for in a file's first 64 rows only: text rows first, then rows with
    image parts, packed with the processor folder as --tokenizer, lost those images without a word."""
    from packtools import pack_files

    text = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    image = [
        {"role": "user", "content": [{"type": "image", "image": "0.png"}, {"type": "text", "text": "what?"}]}
    ]
    rows = [{"messages": text}] * 100 + [{"messages": image + text[1:]}]
    data = _write(tmp_path, rows)
    with pytest.raises(PackingError, match=r"line 101: column 'messages' turn 0 part 0 is of type 'image'"):
        pack_files(data, tmp_path / "out", 64, tokenizer=proc)
    assert not (tmp_path / "out").exists()
    plain = _write(tmp_path / "plain", [{"messages": text}] * 101)  # no image part: packs
    assert pack_files(plain, tmp_path / "plain_out", 64, tokenizer=proc).stats["rows_in"] == 101


def test_rows_with_an_empty_images_column_pack_as_text(tmp_path, capsys):
    """Text-only rows of a vision dataset (``images: []`` or null on every row) lose nothing as text, but any
    ``images`` column was refused ("the images would be lost"); a row with an image after them still is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packtools import pack_files
    from packtools.testing import tiny_tokenizer

    tok = tiny_tokenizer(str(tmp_path / "tok"))
    texts = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, how are you"}]
    plain = _write(tmp_path / "plain", [{"messages": texts}] * 3)
    want = datasets.load_from_disk(pack_files(plain, tmp_path / "want", 64, tokenizer=tok).out)["input_ids"]
    empty = _write(tmp_path / "empty", [{"messages": texts, "images": v} for v in ([], None, [])])
    got = pack_files(empty, tmp_path / "got", 64, tokenizer=tok)
    assert datasets.load_from_disk(got.out)["input_ids"] == want
    parts = tmp_path / "parquet"
    parts.mkdir()
    table = pa.table({"messages": [texts] * 3, "images": pa.array([[], None, []], pa.list_(pa.string()))})
    pq.write_table(table, parts / "rows.parquet")
    got = pack_files(str(parts), tmp_path / "got_parquet", 64, tokenizer=tok)
    assert datasets.load_from_disk(got.out)["input_ids"] == want
    (tmp_path / "late").mkdir()
    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(tmp_path / "late" / "0.png")
    late = [{"messages": texts, "images": []}] * 3000 + [{"messages": texts, "images": ["0.png"]}]
    late_file = tmp_path / "late" / "data.jsonl"
    late_file.write_text("".join(json.dumps(r) + "\n" for r in late))
    with pytest.raises(PackingError, match="holds images"):
        pack_files(late_file, tmp_path / "late_out", 64, tokenizer=tok)
    assert not (tmp_path / "late_out").exists()


def test_parquet_images_are_told_from_the_footer(tmp_path, monkeypatch):
    """Whether a parquet images column holds an image is read from the footer's statistics (a null count per
    leaf), not from the column: a row group of embedded image bytes was read whole only to refuse it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import packtools.pipeline.schema as schema
    from packtools import pack_files
    from packtools.testing import tiny_tokenizer

    tok = tiny_tokenizer(str(tmp_path / "tok"))
    texts = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, how are you"}]
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    monkeypatch.setattr(schema, "iter_part", lambda *a, **k: pytest.fail("read the images column"))
    for name, values, refused in (
        ("set", [[], [{"bytes": b"\x89PNG" * 1000, "path": None}], None], True),
        ("empty", [[], None, []], False),
    ):
        folder = tmp_path / name
        folder.mkdir()
        table = pa.table({"messages": [texts] * 3, "images": pa.array(values, pa.list_(image))})
        pq.write_table(table, folder / "rows.parquet")
        if refused:
            with pytest.raises(PackingError, match=r"holds images \(images\)"):
                pack_files(str(folder), tmp_path / f"{name}_out", 64, tokenizer=tok)
        else:
            assert pack_files(str(folder), tmp_path / f"{name}_out", 64, tokenizer=tok).stats["rows_in"] == 3


def test_vision_rows_in_parquet_are_told_a_way_that_takes_them(tmp_path, proc, capsys):
    """Vision rows in parquet: the refusal said to run `packtools profile PATH --tokenizer DIR (the processor
    folder)`, the command that had just been refused, and `packtools pack --processor`, which reads JSON lines
    only; it names the ways that take them (JSON lines, or pack_dataset(..., processor=DIR))."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(tmp_path / "0.png")
    pq.write_table(pa.Table.from_pylist([_row(["0.png"])]), tmp_path / "rows.parquet")
    assert main(["profile", str(tmp_path / "rows.parquet"), "--tokenizer", proc]) == 1
    err = capsys.readouterr().err
    assert "holds images (images)" in err and "JSON lines" in err and "pack_dataset(" in err, err
    assert (
        "packtools profile PATH --tokenizer DIR" not in err and "packtools pack --processor DIR" not in err
    ), err


def test_profile_recommends_a_max_length_pack_takes(tmp_path, proc, capsys):
    """Vision samples are packed whole and pack --processor refuses a longer one: the recommendation (the
    sequence rule at 0.99, bfd_split) left the longest samples out, and the pack at it was refused."""
    import re

    rng = np.random.default_rng(3)
    rows = []
    for i in range(120):
        side = 448 if i == 0 else 112  # one large image: the longest sample, above the 99% of the others
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(_row([f"{i}.png"]))
    data = _write(tmp_path, rows)
    assert main(["profile", str(data), "--tokenizer", proc, "--quiet"]) == 0
    out = capsys.readouterr().out
    m = int(re.search(r"recommended: max_length=(\d+)", out).group(1))
    argv = ["pack", str(data), "--out", str(tmp_path / "o"), "--processor", proc, "--max-length", str(m)]
    assert main([*argv, "--quiet"]) == 0, capsys.readouterr().err


def test_profile_counts_image_tokens_with_the_processor(tmp_path, proc, capsys):
    from packtools.integrations.multimodal.processor import sample_length

    rng = np.random.default_rng(2)
    rows = []
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (224, 224, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(_row([f"{i}.png"]))
    data = _write(tmp_path, rows)
    assert main(["profile", str(data), "--tokenizer", proc]) == 0
    out = capsys.readouterr().out
    assert "vision samples: 6 (6 images); each length counts its image tokens" in out
    vp = load_vision_processor(proc)
    n = sample_length(vp, rows[0]["messages"], [str(tmp_path / "0.png")], 0)
    assert n > 64 and f"max={n}" in out.replace(",", "")
    assert (
        main(["pack", str(data), "--out", str(tmp_path / "o"), "--processor", proc, "--max-length", str(n)])
        == 0
    )
    tok = tmp_path / "tok"
    transformers.AutoTokenizer.from_pretrained(proc).save_pretrained(tok)  # a tokenizer alone: cannot count
    assert main(["profile", str(data), "--tokenizer", proc, "--keep-tokens", "0.9"]) == 1
    assert "error (--keep-tokens)" in capsys.readouterr().err
    assert main(["profile", str(data), "--tokenizer", str(tok)]) == 1
    assert "their image tokens are counted only with the model's processor folder" in capsys.readouterr().err


def test_a_replaced_image_changes_the_in_memory_processing_of_a_dataset_on_disk(tmp_path, proc):
    from packtools.integrations.multimodal.processor import process_vision_dataset

    Image.fromarray(np.full((56, 84, 3), 200, np.uint8)).save(tmp_path / "a.png")
    datasets.Dataset.from_list([_row([str(tmp_path / "a.png")])]).save_to_disk(str(tmp_path / "ds"))
    ds = datasets.load_from_disk(str(tmp_path / "ds"))  # memory-mapped: datasets would cache map results
    before = np.asarray(process_vision_dataset(ds, proc)[0]["pixel_values"], np.float32)
    Image.fromarray(np.zeros((56, 84, 3), np.uint8)).save(tmp_path / "a.png")
    after = np.asarray(process_vision_dataset(ds, proc)[0]["pixel_values"], np.float32)
    want = transformers.AutoImageProcessor.from_pretrained(proc)(
        images=[str(tmp_path / "a.png")], return_tensors="np"
    )["pixel_values"]
    assert np.array_equal(after, want) and not np.array_equal(after, before)


def test_samples_without_an_assistant_turn_are_counted(tmp_path, proc, capsys):
    ask = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    data = _write(
        tmp_path, [_row([], content=[{"type": "text", "text": "hi"}]), {"messages": ask, "images": []}]
    )
    r = pack_vision_files(data, tmp_path / "out", processor=proc, max_length=64)
    assert r.samples_untrained == 1
    assert pack_vision_files(data, tmp_path / "out", processor=proc, max_length=64).samples_untrained == 1
    assert _pack(data, tmp_path / "cli", proc, "--quiet") == 0
    assert "note: 1 sample(s) have no assistant turn" in capsys.readouterr().out


def test_a_folder_without_the_image_processor_file_leads_with_our_message(tmp_path, proc, capsys):
    """A processor folder without preprocessor_config.json quoted transformers' long message (about the hub)
    first: ours leads, naming the folder, the file and the fix; transformers' text follows."""
    import shutil

    folder = tmp_path / "tok-only"
    shutil.copytree(proc, folder)
    (folder / "preprocessor_config.json").unlink()
    data = _write(tmp_path, [_row([], content=[{"type": "text", "text": "hi"}])])
    assert _pack(data, tmp_path / "out", str(folder)) == 1
    err = capsys.readouterr().err
    ours = f"--processor {str(folder)!r} has no preprocessor_config.json"
    assert ours in err and "save_pretrained(" in err and "Traceback" not in err
    assert err.index(ours) < err.index("transformers said: ") < err.index("huggingface.co")
    with pytest.raises(
        PackingError, match=r"^processor='.*tok-only' has no preprocessor_config\.json"
    ) as got:
        load_vision_processor(folder)
    assert got.value.param == "processor"


def test_rows_already_tokenized_or_processed_given_a_processor_are_told_what_they_are(tmp_path, proc, capsys):
    """Rows without 'messages' given to --processor / processor= were told only "no 'messages'": the refusal
    now says what they hold and how to pack that."""
    from packtools import pack_dataset
    from packtools.integrations.multimodal.processor import process_vision_dataset

    tokenized = tmp_path / "tok.jsonl"
    tokenized.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [1, 2, 3]}) + "\n")
    assert _pack(tokenized, tmp_path / "out", proc) == 1
    err = capsys.readouterr().err
    assert f"{tokenized}:1: the row has no 'messages'" in err and "already tokenized text" in err
    assert "leave processor= (--processor) out" in err
    assert (
        main(["pack", str(tokenized), "--out", str(tmp_path / "plain"), "--max-length", "64", "--quiet"]) == 0
    )

    rows = datasets.Dataset.from_list([_row([], content=[{"type": "text", "text": "hi"}])])
    processed = process_vision_dataset(rows, proc)
    with pytest.raises(PackingError, match=r"already processed .*'pixel_values', 'image_grid_thw'") as got:
        pack_dataset(processed, 64, processor=proc)
    assert "without processor=" in str(got.value)
    assert pack_dataset(processed, 64).num_rows == 1  # the fix it names
    with pytest.raises(
        PackingError, match=r"has no 'messages' .*\['text'\]\); processor= \(--processor\) packs"
    ):
        pack_dataset(datasets.Dataset.from_list([{"text": "hi"}]), 64, processor=proc)


#: ChatML whose content may be a list of parts: it writes the text parts and drops the rest (as Qwen's and
#: Llama's templates do with an image part when the tokenizer has no image processor).
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['content'] is string %}"
    "{% set t = m['content'] %}{% else %}{% set t = m['content'] | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join('') %}{% endif %}{{ t + '<|im_end|>\\n' }}{% endfor %}"
)


def test_image_parts_with_a_text_tokenizer_are_refused(tmp_path, capsys):
    """Image parts in chat messages packed with a text-only tokenizer rendered as its chat template writes
    them (this one drops them): the images were lost without a word, from JSON lines and from a JSON array
    file (.json, never looked at); both refuse now, through pack and profile, and text rows still pack."""
    from packtools import pack_files, profile_files
    from packtools.testing import tiny_tokenizer

    tok = tiny_tokenizer(str(tmp_path / "tok"), chat_template=PARTS_TEMPLATE)
    parts = [{"type": "image", "image": "0.png"}, {"type": "text", "text": "what is this"}]
    text = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    rows = [{"messages": text}] * 5 + [{"messages": [{"role": "user", "content": parts}, text[1]]}]
    lines = _write(tmp_path / "lines", rows)
    array = tmp_path / "array" / "data.json"
    array.parent.mkdir()
    array.write_text(json.dumps(rows, indent=1))
    prompts = tmp_path / "prefs" / "data.jsonl"  # preference rows: the part in the prompt
    prompts.parent.mkdir()
    row = {"prompt": [{"role": "user", "content": parts}], "chosen": text[1:], "rejected": text[1:]}
    prompts.write_text(json.dumps(row) + "\n")
    for data in (lines, array, prompts):
        assert main(["pack", str(data), "--out", str(data.parent / "o"), "--tokenizer", tok, "--quiet"]) == 1
        err = capsys.readouterr().err
        assert "turn 0 part 0 is of type 'image'" in err and "chat template" in err, err
        assert not (data.parent / "o").exists()
        with pytest.raises(PackingError, match=r"turn 0 part 0 is of type 'image'"):
            profile_files(str(data), tokenizer=tok)
    assert main(["profile", str(array), "--tokenizer", tok]) == 1
    assert "object 6 of the array: column 'messages' turn 0 part 0" in capsys.readouterr().err
    plain = tmp_path / "plain" / "data.json"
    plain.parent.mkdir()
    plain.write_text(json.dumps(rows[:5], indent=1))
    assert pack_files(plain, tmp_path / "plain_out", 64, tokenizer=tok).stats["rows_in"] == 5


def test_recommend_on_vision_lengths_holds_every_sample(tmp_path, proc):
    """profile_lengths(vision_lengths(...)).recommend() used the sequence rule at 0.99 (bfd_split): a
    max_length that leaves the longest samples out, which pack --processor then refuses (the docs asked
    for keep_sequences=1.0 by hand).  Vision lengths are packed whole: the default holds every sample, with
    bfd, and a rule that would leave one out is refused by name."""
    from packtools import profile_lengths
    from packtools.integrations.multimodal.processor import vision_lengths

    small = tmp_path / "small.png"
    big = tmp_path / "big.png"
    Image.fromarray(np.zeros((56, 56, 3), np.uint8)).save(small)
    Image.fromarray(np.zeros((448, 448, 3), np.uint8)).save(big)
    rows = [_row([str(small)])] * 120 + [_row([str(big)])]
    lengths = vision_lengths(rows, proc)
    rec = profile_lengths(lengths).recommend()
    assert rec.max_length >= int(lengths.max()) and rec.strategy == "bfd", (rec.max_length, lengths.max())
    plain = profile_lengths(np.asarray(lengths).view(np.ndarray)).recommend()  # text lengths: the 99% rule
    assert plain.max_length < int(lengths.max())
    for kw in ({"keep_sequences": 0.99}, {"keep_tokens": 0.9}):
        with pytest.raises(PackingError, match="packed whole"):
            profile_lengths(lengths).recommend(**kw)
    assert profile_lengths(lengths).recommend(keep_sequences=1.0).max_length == rec.max_length
    # still the int64 array the function returned before: a reduction is a NumPy scalar (lengths.max() was a
    # 0-d WholeLengths, which max_length= refused as no int)
    from packtools.core.plan import check_max_length

    assert isinstance(lengths.max(), np.integer) and isinstance(lengths.sum(), np.integer)
    assert check_max_length(lengths.max()) == int(np.asarray(lengths).max())


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
        {"type": "input_image", "image_url": "https://x/cat.png"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "audio", "audio": "a.wav"},
        {"type": "file", "file": {"file_id": "f-1"}},
        {"type": "input_text", "text": "OpenAI's text part"},
        {"text": "a part without a type"},
        "a bare string among the parts",
    ],
)
def test_every_non_text_part_with_a_text_tokenizer_is_refused(tmp_path, capsys, part):
    """Only ``image`` and ``video`` parts were refused: OpenAI-style ``image_url``/``input_image``, audio and
    file parts, ``input_text`` and a part without a type packed with a text tokenizer, whose template (this one
    selects ``type == 'text'``) dropped them without a word.  Refused now, naming file, line, column, turn, part
    and type, from JSON lines (before any work) and from Parquet (row by row as it is tokenized)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packtools import pack_files
    from packtools.testing import tiny_tokenizer

    tok = tiny_tokenizer(str(tmp_path / "tok"), chat_template=PARTS_TEMPLATE)
    text = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    said = [{"type": "text", "text": "what is this"}, part]
    rows = [{"messages": text}] * 2 + [{"messages": [text[0], text[1], {"role": "user", "content": said}]}]
    lines = _write(tmp_path / "lines", rows)
    kind = part.get("type") if isinstance(part, dict) else "<str>"
    named = f"turn 2 part 1 {'is of type ' + repr(kind) if kind else 'has no ' + repr('type')}"
    if kind == "<str>":
        named = "turn 2 part 1 is a str, not a part object"
    assert main(["pack", str(lines), "--out", str(tmp_path / "o"), "--tokenizer", tok, "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"data.jsonl' line 3: column 'messages' {named}" in err, err
    assert ("pack --processor DIR" in err) == (kind in ("input_image", "image_url")), err
    assert not (tmp_path / "o").exists()
    answer = {"role": "assistant", "content": said[:1]}  # Arrow holds one type of content per column
    if isinstance(part, dict):  # Arrow cannot hold a string beside part objects
        (tmp_path / "pq").mkdir()
        table = pa.Table.from_pylist([{"messages": [{"role": "user", "content": said}, answer]}])
        pq.write_table(table, tmp_path / "pq" / "rows.parquet")
        with pytest.raises(PackingError, match=r"rows.parquet' row 0: column 'messages' turn 0 part 1 "):
            pack_files(str(tmp_path / "pq"), tmp_path / "p", 64, tokenizer=tok)
    only_text = [{"role": "user", "content": said[:1]}, answer]
    ok = _write(tmp_path / "ok", [{"messages": only_text}])  # text parts pack
    assert pack_files(ok, tmp_path / "ok_out", 64, tokenizer=tok).stats["rows_in"] == 1


def test_a_content_that_is_one_part_object_is_refused(tmp_path):
    """A message whose content is one part object ({'type': 'text', 'text': 'hi'}), not a list of them: this
    template dropped its text without a word (another writes the dict as text).  Refused by line."""
    from packtools import pack_files
    from packtools.testing import tiny_tokenizer

    tok = tiny_tokenizer(str(tmp_path / "tok"), chat_template=PARTS_TEMPLATE)
    conv = [
        {"role": "user", "content": {"type": "text", "text": "hi"}},
        {"role": "assistant", "content": "hello"},
    ]
    data = _write(tmp_path, [{"messages": conv}])
    with pytest.raises(
        PackingError, match=r"line 1: column 'messages' turn 0 part 0 is one part object .*as a string"
    ):
        pack_files(data, tmp_path / "out", 64, tokenizer=tok)


def test_an_image_column_of_captions_is_refused_with_the_fix(tmp_path):
    """A string column named ``image`` that holds no image (a caption) is read as images and refused; the
    error said to pack with the processor or drop the images, not that the column can be renamed or dropped."""
    from packtools import pack_files
    from packtools.testing import tiny_tokenizer

    tok = tiny_tokenizer(str(tmp_path / "tok"))
    text = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]
    data = _write(tmp_path, [{"messages": text, "image": "a cat on a mat"}])
    with pytest.raises(
        PackingError, match=r"holds images \(image\).* If column 'image' holds no images .* rename"
    ):
        pack_files(data, tmp_path / "out", 64, tokenizer=tok)


def test_text_parts_with_a_template_that_drops_content_lists_are_refused(tmp_path):
    """Qwen 3's template renders a content that is no string as '' ({% if message.content is string %}...{% else
    %}{% set content = '' %}): an assistant turn given as text parts packed as an empty reply (2 tokens trained
    of the answer's), without a word.  Refused now by line, column and turn; a template that reads parts packs
    them, and a template that leaves a role out whatever its content (a string there shows no more) is no
    reason to refuse."""
    from packtools import pack_files
    from packtools.testing import tiny_tokenizer

    qwen3 = (
        "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
        "{%- else %}{%- set content = '' %}{%- endif %}"
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    tok = tiny_tokenizer(str(tmp_path / "tok"), chat_template=qwen3)
    answer = {"role": "assistant", "content": [{"type": "text", "text": "the answer", "cache_control": None}]}
    data = _write(tmp_path / "drops", [{"messages": [{"role": "user", "content": "hi"}, answer]}])
    with pytest.raises(
        PackingError,
        match=r"line 1: column 'messages' turn 1: its content is a list of parts, and the chat template drops",
    ):
        pack_files(data, tmp_path / "out", 64, tokenizer=tok)
    # a template that reads parts: the same row packs, the answer trained
    reads = tiny_tokenizer(str(tmp_path / "reads"), chat_template=PARTS_TEMPLATE)
    assert pack_files(data, tmp_path / "r", 64, tokenizer=reads).stats["tokens_trained_in"] > 2
    # a role the template leaves out whatever its content: not the parts' loss
    skips = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{{ m['content'][0]['text'] }}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    )
    skip = tiny_tokenizer(str(tmp_path / "skip"), chat_template=skips)
    tool = {"role": "tool", "content": [{"type": "text", "text": "42"}]}
    rows = [{"messages": [{"role": "user", "content": "hi"}, tool, {"role": "assistant", "content": "ok"}]}]
    assert (
        pack_files(_write(tmp_path / "tool", rows), tmp_path / "t", 64, tokenizer=skip).stats["rows_in"] == 1
    )


def test_text_parts_with_a_template_that_prints_content_lists_are_refused(tmp_path):
    """Text parts with a chat template that writes ``{{ m['content'] }}`` (many text-only templates do) packed
    "[{'type': 'text', 'text': 'hi'}]" as the user's text, Python's repr and all, without a word (transformers
    renders the same).  Refused now by line, column and turn (messages, prompt and completion); plain strings
    with that template, and text parts with a template that reads them, pack."""
    from packtools import pack_files
    from packtools.testing import tiny_tokenizer

    printing = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{{ m['content'] }}{{ '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tok = tiny_tokenizer(str(tmp_path / "tok"), chat_template=printing)
    user = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    answer = {"role": "assistant", "content": "hello"}
    plain = {"messages": [{"role": "user", "content": "hi"}, answer]}
    cases = [
        ("messages", [plain, {"messages": [user, answer]}], "line 2: column 'messages' turn 0"),
        ("prompt", [{"prompt": [user], "completion": [answer]}], "line 1: column 'prompt' turn 0"),
        ("completion", [{"prompt": [plain["messages"][0]], "completion": [{**user, "role": "assistant"}]}],
         "line 1: column 'completion' turn 0"),
    ]  # fmt: skip
    for name, rows, said in cases:
        data = _write(tmp_path / name, rows)
        with pytest.raises(
            PackingError, match=rf"{said}: its content is a list of parts, and the chat template"
        ):
            pack_files(data, tmp_path / f"{name}_out", 64, tokenizer=tok)
    assert (
        pack_files(_write(tmp_path / "plain", [plain]), tmp_path / "p", 64, tokenizer=tok).stats["rows_in"]
        == 1
    )
    reads = tiny_tokenizer(str(tmp_path / "reads"), chat_template=PARTS_TEMPLATE)
    data = _write(tmp_path / "reads_parts", [{"messages": [user, answer]}])
    assert pack_files(data, tmp_path / "r", 64, tokenizer=reads).stats["rows_in"] == 1
