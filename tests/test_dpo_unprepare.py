"""``packtools.compat.unprepare`` puts a DPOTrainer back as TRL built it, and the compat modules
refuse a library object whose internals are not the shape they were checked against (never patch blindly)."""

import types

import numpy as np
import pyarrow as pa
import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
import test_dpo as dpo  # noqa: E402

from packtools import (  # noqa: E402
    compat,  # noqa: E402
    prepare_dpo_trainer,  # noqa: E402
)
from packtools.compat import datasets as cds  # noqa: E402
from packtools.compat import trl as ctrl  # noqa: E402
from packtools.dpo import pack_preference  # noqa: E402
from packtools.errors import PackingError  # noqa: E402

MODES = {
    "plain": lambda trainer: prepare_dpo_trainer(trainer, segmented_sdpa=False),
    "share_prompt": lambda trainer: prepare_dpo_trainer(
        trainer, train_dataset=pack_preference(trainer.train_dataset, 64, share_prompt=True)
    ),
    "max_tokens": lambda trainer: prepare_dpo_trainer(trainer, max_tokens=96, segmented_sdpa=False),
}


def bases(trainer):
    return [m for m in (trainer.model, trainer.ref_model) if m is not None]


def snapshot(trainer):
    """What packtools' DPO side may change: trainer attributes and each model's own forward, by identity."""
    own = {k: v for k, v in vars(trainer).items() if k in ("train_dataset", "data_collator")}
    methods = {k for k in ("compute_loss", "get_batch_samples", "packtools_step") if k in vars(trainer)}
    methods |= {type(trainer).__name__}  # the step owner swaps the class
    ours = ("_packtools_padding_free", "_packtools_shared_prompt")  # the DPO side's flags on a model
    forwards = [(vars(m).get("forward"), sorted(k for k in vars(m) if k in ours)) for m in bases(trainer)]
    return own, methods, forwards


@pytest.mark.parametrize("mode", list(MODES))
def test_unprepare_restores_the_trainer_and_its_forwards(tmp_path, mode):
    trainer = dpo.build(tmp_path, remove_unused_columns=True)
    before = snapshot(trainer)
    assert before[2][0][0] is not None  # TRL's fused forward, an instance attribute
    MODES[mode](trainer)
    during = snapshot(trainer)
    assert during[1] == {"packtools_step", "PackedDPOTrainer"}  # the plan and the class, no method patched
    assert all(f is not b for (f, _), (b, _) in zip(during[2], before[2], strict=True))  # forwards wrapped
    if mode == "share_prompt":
        assert "prompt_lengths" in trainer._signature_columns
    undone = compat.unprepare(trainer)
    assert undone is trainer
    after = snapshot(trainer)
    assert after[0].keys() == before[0].keys()
    assert all(after[0][k] is before[0][k] for k in before[0])  # same dataset, collator, columns objects
    assert after[1] == before[1] == {"DPOTrainer"}
    assert all(a is b for (a, _), (b, _) in zip(after[2], before[2], strict=True))
    assert after[2] == before[2]  # no packtools flag left on a model either
    # The kept columns are Trainer's own again: None (computed on first use) or what Trainer computes itself
    # (the transformers side's collator check fills Trainer's cache); never the packed rows' columns.
    kept = trainer._signature_columns
    trainer._signature_columns = None
    trainer._set_signature_columns_if_needed()
    assert kept in (None, trainer._signature_columns)
    fresh = trainer
    assert "prompt_lengths" not in fresh._signature_columns and "seq_lengths" not in fresh._signature_columns


def test_a_step_after_unprepare_is_trls_own(tmp_path):
    """Loss, metrics and gradients of a micro-batch through the unprepared trainer equal an untouched TRL
    trainer's, and the model is again called with TRL's padded batch (negative control: prepared, it is not)."""
    reference = dpo.build(tmp_path)
    trainer = prepare_dpo_trainer(dpo.build(tmp_path), segmented_sdpa=False)
    batch = reference.data_collator([reference.train_dataset[i] for i in range(4)])
    recorder = dpo.ShapeRecorder(trainer.model)
    dpo.loss_metrics_grads(reference, batch)  # both trainers see the batch twice (num_tokens accumulates)
    dpo.loss_metrics_grads(trainer, batch)
    real = int(batch["attention_mask"].sum())
    assert recorder.calls[-1] == ((1, real), False)  # prepared: one padding-free row
    compat.unprepare(trainer)
    recorder.calls.clear()
    ours, theirs = dpo.loss_metrics_grads(trainer, batch), dpo.loss_metrics_grads(reference, batch)
    assert recorder.calls and all(call == (tuple(batch["input_ids"].shape), True) for call in recorder.calls)
    assert ours[0] == theirs[0] and ours[1] == theirs[1]
    assert all(bool((ours[2][k] == theirs[2][k]).all()) for k in theirs[2])


def test_unprepare_also_removes_what_the_transformers_side_installed(tmp_path):
    trainer = dpo.build(tmp_path)
    impl = trainer.model.config._attn_implementation
    prepare_dpo_trainer(trainer)
    compat.unprepare(trainer)
    assert "get_train_dataloader" not in vars(trainer)
    assert not any(k.startswith("_packtools") for m in bases(trainer) for k in vars(m))
    assert trainer.model.config._attn_implementation == impl
    prepare_dpo_trainer(trainer, max_tokens=96)  # unprepared, it can be prepared again


def test_a_refused_prepare_leaves_nothing_behind(tmp_path, monkeypatch):
    """A shape the compat module does not know (here compute_loss with another signature) is refused by name,
    after the forwards were already wrapped: everything recorded so far is undone."""
    trainer = dpo.build(tmp_path)
    before = snapshot(trainer)

    def compute_loss(self, model, inputs, return_outputs=False):  # a TRL that dropped num_items_in_batch
        raise AssertionError("not called")

    trainer.compute_loss = types.MethodType(compute_loss, trainer)
    with pytest.raises(PackingError, match="does not know this trl .*compute_loss takes"):
        prepare_dpo_trainer(trainer, segmented_sdpa=False)
    after = snapshot(trainer)
    assert after[2] == before[2] and "packtools_step" not in vars(trainer)
    assert type(trainer).__name__ == "DPOTrainer"


class _FakeDataset:
    """A ``Dataset`` look-alike whose row mapping moved to another attribute (an unknown datasets version)."""

    def __init__(self, table, mapping):
        self.data = types.SimpleNamespace(table=table)
        self._index_mapping = mapping


def test_unknown_datasets_shapes_are_refused_not_read_unmapped(tmp_path):
    table = pa.table({"input_ids": [[1], [2, 2], [3, 3, 3]]})
    moved = _FakeDataset(table, pa.table({"indices": pa.array([2, 0], pa.uint64())}))
    with pytest.raises(PackingError, match="does not know this datasets .* no _indices"):
        cds.dataset_table(moved)
    # Negative control: the duck-typed read this replaces returns all three rows, unmapped, without a word.
    old_indices = getattr(moved, "_indices", None)
    assert old_indices is None and moved.data.table.num_rows == 3
    # A real dataset with a mapping reads through; a mapping of another shape is refused.
    ds = datasets.Dataset.from_dict({"input_ids": [[1], [2, 2], [3, 3, 3]]}).select([2, 0])
    got, indices = cds.dataset_table(ds)
    assert got.num_rows == 3 and indices.tolist() == [2, 0] and indices.dtype == np.int64
    ds._indices = pa.table({"a": [0], "b": [1]})
    with pytest.raises(PackingError, match="not a 1-column table"):
        cds.dataset_table(ds)
    stream = datasets.Dataset.from_dict({"input_ids": [[1]]}).to_iterable_dataset().with_format("numpy")
    assert cds.format_type(stream) == "numpy"
    del stream._formatting
    with pytest.raises(PackingError, match="no _formatting"):
        cds.format_type(stream)
    # state.json without the _data_files list datasets writes: refused (the old reader saw no files at all).
    (tmp_path / "state.json").write_text('{"data_files": [{"filename": "x.arrow"}]}')
    with pytest.raises(PackingError, match="no _data_files"):
        cds.saved_data_files(str(tmp_path))
    (tmp_path / "state.json").write_text('{"_data_files": [{"filename": "x.arrow"}]}')
    assert cds.saved_data_files(str(tmp_path)) == ["x.arrow"]


def test_unknown_trainer_shapes_are_refused(tmp_path):
    plain = types.SimpleNamespace()
    with pytest.raises(PackingError, match="does not know this transformers .* _signature_columns"):
        ctrl.keep_signature_columns(plain, ["x"])
    with pytest.raises(PackingError, match="_is_vision_dataset"):
        ctrl.is_vision(plain)
    with pytest.raises(PackingError, match="no fused LM head"):
        ctrl.fused_forward(dpo.tiny_llama())
    trainer = dpo.build(tmp_path)
    assert ctrl.is_vision(trainer) is False
    assert ctrl.tokenizer_of(trainer).pad_token_id == dpo.PAD


def test_prepared_takes_the_dpo_path_and_prepare_trainer_refuses_a_dpo_trainer(tmp_path):
    from packtools import prepare_trainer
    from packtools.integrations import prepared

    trainer = dpo.build(tmp_path)
    with pytest.raises(PackingError, match="prepare_dpo_trainer"):
        prepare_trainer(trainer)  # the SFT path would not batch pairs whole nor scale DPO's loss
    assert "packtools_step" not in vars(trainer)
    with prepared(trainer):
        assert type(trainer).__name__ == "PackedDPOTrainer"  # prepare_dpo_trainer ran, not prepare_trainer
    assert "packtools_step" not in vars(trainer) and type(trainer).__name__ == "DPOTrainer"
