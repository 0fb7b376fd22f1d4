"""Audio processor outputs (``input_features``, ``feature_attention_mask``, ``input_features_mask``, ...) are
never left out silently: packtools packs no audio, and rows that lose them keep their audio placeholder tokens in
``input_ids`` (the model then trains on placeholders with no audio). Refused by name on every path that names its
columns, as video columns are (``constants.AUDIO_COLUMNS``, ``core.pack.refuse_unpacked_media``)."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from packtools.errors import PackingError

AUDIO = ["input_features", "feature_attention_mask"]
_AUDIO = r"audio column\(s\) \[.*'input_features'.*\].*placeholder tokens"


def _audio_rows(mask: str = "feature_attention_mask") -> pa.Table:
    # Qwen2-Audio-style rows: token 5 is the audio placeholder, the features travel per sample
    return pa.table(
        {
            "input_ids": [[1, 5, 5, 2], [1, 5, 2]],
            "labels": [[1, 5, 5, 2], [1, 5, 2]],
            "input_features": [[[0.1, 0.2], [0.3, 0.4]], [[0.5, 0.6], [0.7, 0.8]]],
            mask: [[1, 1], [1, 1]],
        }
    )


@pytest.mark.parametrize("mask", ["feature_attention_mask", "input_features_mask"])
def test_text_collators_refuse_audio_columns_even_in_leave_out(mask):
    """leave_out=['input_features', 'feature_attention_mask'] on PaddingFreeCollator / PackedRows dropped the audio
    with no error, its placeholder tokens kept in input_ids."""
    from packtools import PaddingFreeCollator
    from packtools.batches import PackedRows

    table = _audio_rows(mask)
    audio = ["input_features", mask]
    rows = [dict(r, seq_lengths=[len(r["input_ids"])]) for r in table.to_pylist()]
    with pytest.raises(PackingError, match="row 0 has the " + _AUDIO):
        PaddingFreeCollator(0, leave_out=audio)(rows)
    with pytest.raises(PackingError, match="the data has the " + _AUDIO):
        PackedRows(table, leave_out=audio)
    # a mask column alone listed in leave_out is refused too (it is an audio processor's output)
    with pytest.raises(PackingError, match=rf"audio column\(s\) \['{mask}'\]"):
        PaddingFreeCollator(0, leave_out=[mask])([{"input_ids": [1, 2], "seq_lengths": [2], mask: [1]}])
    # the same rows without the audio still batch
    text = [{k: v for k, v in r.items() if k not in audio} for r in rows]
    assert PaddingFreeCollator(0)(text)["input_ids"].shape == (1, 7)


@pytest.mark.parametrize("columns", [None, ["input_ids", "labels"]])
def test_packing_paths_refuse_audio_columns(tmp_path, columns):
    """columns=['input_ids', 'labels'] packed the tokens and left the audio out with no error in pack_table,
    pack_dataset, packed_view, a streamed IterableDataset, pack_files and pack_ray_dataset."""
    datasets = pytest.importorskip("datasets")
    pq = pytest.importorskip("pyarrow.parquet")
    from packtools import pack_dataset, pack_files, pack_table
    from packtools.integrations.data.views import packed_view

    table = _audio_rows()
    ds = datasets.Dataset(table)
    with pytest.raises(PackingError, match="pack_table: the rows hold " + _AUDIO):
        pack_table(table, 8, columns=columns)
    with pytest.raises(PackingError, match="pack_dataset: the rows hold " + _AUDIO):
        pack_dataset(ds, 8, columns=columns)
    with pytest.raises(PackingError, match="packed_view: the rows hold " + _AUDIO):
        packed_view(ds, 8, columns=columns)
    stream = datasets.IterableDataset.from_generator(lambda: iter(table.to_pylist()))
    with pytest.raises(PackingError, match=_AUDIO):
        list(pack_dataset(stream, 8, columns=columns))
    path = str(tmp_path / "rows.parquet")
    pq.write_table(table, path)
    with pytest.raises(PackingError, match="rows.parquet'.*" + _AUDIO):
        pack_files([path], str(tmp_path / "out"), max_length=16, columns=columns)
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_pack_ray_dataset_refuses_audio_columns():
    """pack_ray_dataset(ds, columns=['input_ids']) planned the token columns of audio rows (refused before any
    block runs, from the dataset's schema)."""
    pytest.importorskip("ray.data")
    from packtools.integrations.data.ray import pack_ray_dataset

    class KnownSchema:  # the part of ray.data.Dataset pack_ray_dataset reads before planning
        def schema(self, fetch_if_missing=False):
            return _audio_rows().schema

    with pytest.raises(PackingError, match="pack_ray_dataset: the rows hold " + _AUDIO):
        pack_ray_dataset(KnownSchema(), 8, columns=["input_ids"])


@pytest.mark.parametrize("where", ["train", "eval"])
def test_prepare_trainer_refuses_audio_columns(tmp_path, where):
    """Trainer's remove_unused_columns dropped a text model's input_features before PaddingFreeCollator saw the
    rows: prepare_trainer passed and the audio placeholders trained without audio."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    from _hf_models import tiny_llama

    from packtools import PaddingFreeCollator, prepare_trainer

    text = {"input_ids": [[1, 2, 3, 4], [5, 6, 7]], "seq_lengths": [[4], [3]]}
    rows = {**text, "input_features": [[[0.1]], [[0.2]]], "feature_attention_mask": [[1], [1]]}

    def trainer(train, evaluation=None):
        args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
        return transformers.Trainer(
            tiny_llama(), args=args, train_dataset=datasets.Dataset.from_dict(train),
            eval_dataset=None if evaluation is None else datasets.Dataset.from_dict(evaluation),
            data_collator=PaddingFreeCollator(0),
        )  # fmt: skip

    given = trainer(rows) if where == "train" else trainer(text, rows)
    with pytest.raises(
        PackingError, match=rf"the {where}_dataset holds the audio column\(s\) \['input_features'"
    ):
        prepare_trainer(given)
    prepare_trainer(trainer(text, text))


@pytest.mark.parametrize("media", ["input_features", "pixel_values"])
def test_prepare_trainer_keeps_streamed_media_for_the_collator_to_refuse(tmp_path, media):
    """A streamed IterableDataset's columns are unknown when prepared (column_names None), so prepare_trainer could
    not refuse its audio or image column by name, and Trainer's remove_unused_columns (RemoveColumnsCollator, row by
    row) dropped it before PaddingFreeCollator saw the rows: a text model trained on the placeholders with no
    error.  The media columns are kept through the removal now, and the collator refuses them by name."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    from _hf_models import tiny_llama

    from packtools import PaddingFreeCollator, prepare_trainer

    def rows(with_media):
        def gen():
            for n in (4, 5, 6, 7):
                yield {
                    "input_ids": list(range(3, 3 + n)),
                    "seq_lengths": [n],
                    **({media: [0.5]} if with_media else {}),
                }

        return datasets.IterableDataset.from_generator(gen)

    def trainer(with_media):
        args = transformers.TrainingArguments(
            str(tmp_path), use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=2,
            accelerator_config={"dispatch_batches": False},
        )  # fmt: skip
        found = transformers.Trainer(
            tiny_llama(), args=args, train_dataset=rows(with_media), data_collator=PaddingFreeCollator(0)
        )
        assert found.train_dataset.column_names is None  # nothing to refuse by name when prepared
        return prepare_trainer(found) or found

    with pytest.raises(PackingError, match=rf"row 0 has the \w+ column\(s\) \['{media}'\]"):
        next(iter(trainer(True).get_train_dataloader()))  # (prepare_trainer's own look at a batch refuses)
    batch = next(iter(trainer(False).get_train_dataloader()))  # the same rows without it still batch
    assert batch["input_ids"].shape == (1, 9)


@pytest.mark.parametrize("media", ["pixel_values", "input_features", "images"])
@pytest.mark.parametrize("packer", ["pack_preference", "pack_reward_pairs", "pack_groups"])
def test_preference_packers_refuse_media_columns(packer, media):
    """pack_preference / pack_reward_pairs / pack_groups pack token columns only and dropped every other column with
    no error: vision-language DPO rows tokenized with their images (prompt_ids beside pixel_values, or TRL's raw
    images column) or audio rows lost their media, their placeholder tokens kept.  Refused by name now, whatever columns= names; the same rows without the
    media still pack."""
    from packtools.integrations.preference import data

    rows = {
        "pack_preference": {
            "prompt_ids": [[1, 2], [3]],
            "chosen_ids": [[4, 5], [6]],
            "rejected_ids": [[7], [8, 9]],
        },
        "pack_reward_pairs": {"chosen_ids": [[1, 4, 5], [3, 6]], "rejected_ids": [[1, 7], [3, 8, 9]]},
        "pack_groups": {"prompt_ids": [[1, 2], [3]], "completion_ids": [[[4], [5, 6]], [[7, 8], [9]]]},
    }[packer]
    pack = getattr(data, packer)
    with pytest.raises(PackingError, match=rf"{packer}: the rows hold the media column\(s\) \['{media}'\]"):
        pack(pa.table({**rows, media: [[0.5], [0.25]]}), 16)
    assert pack(pa.table(rows), 16).num_rows == 1
    if media == "images":  # a text dataset's empty images column (no row holds one) is no media
        assert pack(pa.table({**rows, media: [[], None]}), 16).num_rows == 1


@pytest.mark.parametrize("media", ["feature_attention_mask", "pixel_values_videos"])
@pytest.mark.parametrize("columns", [None, ["input_ids"]])
def test_truncation_refuses_video_and_audio_columns(media, columns):
    """truncate_table / truncate_dataset cut every list column to max_length: an audio feature mask or a video's
    patches lost positions (or, named out of columns=, stayed whole while their placeholder tokens were cut), with
    a warning about tokens only.  Refused by name now; the rows without them still truncate."""
    datasets = pytest.importorskip("datasets")
    from packtools.core.pack import truncate_table
    from packtools.integrations import truncate_dataset

    text = {"input_ids": [[1, 5, 5, 2, 3, 4]], "labels": [[1, 5, 5, 2, 3, 4]]}
    table = pa.table({**text, media: [[[0.5]] * 6 if media == "pixel_values_videos" else [1] * 6]})
    with pytest.raises(PackingError, match=rf"truncate_table \(truncate_dataset\): .*\['{media}'\]"):
        truncate_table(table, 3, columns)
    with pytest.raises(PackingError, match=rf"\['{media}'\]"):
        truncate_dataset(datasets.Dataset(table), 3, columns)
    with pytest.warns(UserWarning):
        assert truncate_dataset(datasets.Dataset(pa.table(text)), 3, columns)[0]["input_ids"] == [1, 5, 5]


@pytest.mark.parametrize(
    "audio",
    [
        ["audio_input_ids", "audio_input_ids_mask"],  # Higgs Audio V2, Inkling: audio codes per clip
        [
            "input_values",
            "padding_mask",
        ],  # Apertus 1.5, OmniASR, VibeVoice-ASR: waveform samples + their mask
        ["padding_mask"],  # the waveform's mask alone in leave_out
    ],
)
def test_audio_codes_and_waveform_masks_are_refused_even_in_leave_out(tmp_path, audio):
    """transformers 5.25's audio language models take ``audio_input_ids`` (+ ``audio_input_ids_mask``) or
    ``input_values`` + ``padding_mask`` beside ``input_ids`` holding each clip's placeholder tokens: with
    leave_out=['audio_input_ids', 'audio_input_ids_mask'] PaddingFreeCollator and PackedRows dropped the codes
    with no error, and pack_table(columns=...) packed the tokens without them."""
    from packtools import PaddingFreeCollator, pack_table
    from packtools.batches import PackedRows

    extra = {c: [[[3, 4], [5, 6]], [[7, 8]]] if c == "audio_input_ids" else [[1, 1], [1]] for c in audio}
    table = pa.table({"input_ids": [[1, 5, 5, 2], [1, 5, 2]], "labels": [[1, 5, 5, 2], [1, 5, 2]], **extra})
    rows = [dict(r, seq_lengths=[len(r["input_ids"])]) for r in table.to_pylist()]
    named = r"audio column\(s\) \[.*'" + audio[0] + r"'.*\].*placeholder tokens"
    with pytest.raises(PackingError, match="row 0 has the " + named):
        PaddingFreeCollator(0, leave_out=audio)(rows)
    with pytest.raises(PackingError, match="the data has the " + named):
        PackedRows(table, leave_out=audio)
    with pytest.raises(PackingError, match="pack_table: the rows hold " + named):
        pack_table(table, 8, columns=["input_ids", "labels"])
