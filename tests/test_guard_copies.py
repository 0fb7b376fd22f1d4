"""A guarded model pickles and deep-copies with its guard: ``torch.save(model)`` / ``torch.load`` and
``copy.deepcopy`` (TRL's ``create_reference_model`` deep-copies the policy) of a model after ``guard_model``,
``watch_model`` or ``prepare_trainer``.  The hooks were local closures: ``torch.save`` failed on them, and a deep
copy shared the original's hook and undo records (``unprepare(copy)`` deleted the original's guard attribute and
left the copy marked guarded without its hook).  A copy is guarded as the model was, with hooks of its own."""

from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _hf_models import tiny_llama  # noqa: E402

from packtools.errors import PackingError  # noqa: E402
from packtools.integrations import unprepare  # noqa: E402
from packtools.integrations.trainers.guard import guard_model, packed_loss_inputs, watch_model  # noqa: E402

IDS = torch.arange(3, 11)[None]
POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])


def hooks_of(model, attr):
    """The hook that ``guard_model`` (``attr="_packtools_guard"``) or ``watch_model`` registered on ``model``."""
    handle = vars(model).get(attr)
    return [] if handle is None else [model._forward_pre_hooks[handle.id]]


def assert_guarded(model):
    """Inside a compute_loss over the packed row, a forward of its ids without their positions is refused."""
    with packed_loss_inputs({"input_ids": IDS, "position_ids": POSITIONS}, "Mine.compute_loss"):
        with pytest.raises(PackingError, match="Mine.compute_loss called the model"):
            model(input_ids=IDS)
        model(input_ids=IDS, position_ids=POSITIONS)  # the same row with its positions passes


def round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["guard_model", "watch_model"])
@pytest.mark.parametrize("clone", [round_trip, copy.deepcopy], ids=["torch.save", "deepcopy"])
def test_a_copy_of_a_guarded_model_is_guarded_with_hooks_of_its_own(how, clone):
    model = tiny_llama()
    kind = "_packtools_guard" if how == "guard_model" else "_packtools_watch"
    if how == "guard_model":
        guard_model(model, check_isolation=True)
    else:
        watch_model(model, owner=model)
    copied = clone(model)
    (hook,), (copied_hook,) = hooks_of(model, kind), hooks_of(copied, kind)
    assert copied_hook is not hook
    assert_guarded(copied)
    assert_guarded(model)
    if how == "guard_model":  # the probe's state is the copy's own: probing the copy leaves the model's alone
        assert copied_hook.probe is not hook.probe
    # unprepare(copy) takes the copy's guard off, and only the copy's
    assert unprepare(copied)
    assert not ({"_packtools_guard", "_packtools_watch"} & set(vars(copied)))
    assert list(copied._forward_pre_hooks) == []
    with packed_loss_inputs({"input_ids": IDS, "position_ids": POSITIONS}, "Mine.compute_loss"):
        copied(input_ids=IDS)  # unguarded now: not refused
    assert_guarded(model)
    assert {"_packtools_guard", "_packtools_watch"} & set(vars(model))


def test_a_prepared_trainers_model_saves_and_loads_guarded(tmp_path):
    """torch.save(trainer.model) after prepare_trainer failed on the guard's closure."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    from _hf_models import sequences

    from packtools import PaddingFreeCollator, pack_dataset, prepare_trainer

    rows = pack_dataset(datasets.Dataset.from_list(sequences(8, seed=5)), 32)
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    trainer = transformers.Trainer(
        model=tiny_llama(), args=args, train_dataset=rows, data_collator=PaddingFreeCollator(0)
    )
    prepare_trainer(trainer)
    path = tmp_path / "model.pt"
    torch.save(trainer.model, path)
    loaded = torch.load(path, weights_only=False)
    assert len(hooks_of(loaded, "_packtools_guard")) == 1
    assert_guarded(loaded)
    reference = copy.deepcopy(trainer.model)  # what TRL's create_reference_model does
    assert_guarded(reference)


@pytest.mark.parametrize("clone", [round_trip, copy.deepcopy], ids=["torch.save", "deepcopy"])
def test_a_copy_of_a_hybrid_keeps_its_documents_apart(clone):
    """run_mixers_per_document's hooks were closures too: torch.save failed, and a deep copy's decoder-layer hook
    handed the documents to the original's token-mixing layer, not the copy's -- a copy whose layer is called
    with fixed arguments (transformers 5.15's Nemotron-H / Falcon-H1, simulated as in test_mixers) ran its packed
    row as one sequence, with no error.  The copy's hooks hold its own layers now."""
    from _hf_models import tiny_arch

    from packtools import PaddingFreeCollator
    from packtools.integrations import check_isolation
    from packtools.integrations.attention.backends import token_mixing_layers
    from packtools.integrations.attention.mixers import SEGMENTS_KEY, run_mixers_per_document

    model = tiny_arch("Nemotron-H", "sdpa")
    run_mixers_per_document(model)
    guard_model(model, check_isolation=False)
    copied = clone(model)
    name = token_mixing_layers(copied, include_handled=True)[0]
    mixer = dict(copied.named_modules())[name]
    wrapper = vars(mixer)["forward"]
    assert wrapper is not vars(dict(model.named_modules())[name])["forward"]
    assert wrapper.layer() is not None and any(wrapper.layer() is m for m in copied.modules())

    def fixed_arguments(hidden_states, **kwargs):
        kwargs.pop(SEGMENTS_KEY, None)
        return wrapper(hidden_states, **kwargs)

    mixer.forward = fixed_arguments
    collator = PaddingFreeCollator(0, return_seq_idx=False, return_flash_attn_kwargs=False)
    report = check_isolation(copied, collator, raise_on_leak=False)
    assert not report.leaks and max(report.alone_diff) < 1e-5


@pytest.mark.parametrize("clone", [round_trip, copy.deepcopy], ids=["torch.save", "deepcopy"])
def test_unprepare_of_a_copys_only_user_takes_its_per_document_layers_off(clone):
    """A copy of a hybrid prepared for one owner kept that owner's id among its per-document layers' users, so
    unprepare of the copy's own (only) user left the copy's layers and hooks on: the original's user, whose undo
    record holds the original, was counted for the copy forever.  A copy starts with no users."""
    from _hf_models import tiny_arch

    from packtools.integrations.attention.backends import token_mixing_layers
    from packtools.integrations.attention.mixers import document_mixers, run_mixers_per_document

    class Owner:
        pass

    model = tiny_arch("Nemotron-H", "sdpa")
    name = token_mixing_layers(model)[0]
    first, second = Owner(), Owner()
    run_mixers_per_document(model, owner=first)
    copied = clone(model)
    run_mixers_per_document(copied, owner=second)
    assert unprepare(second)
    assert document_mixers(copied) is None
    assert "forward" not in vars(dict(copied.named_modules())[name])
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in copied.modules())
    assert document_mixers(model) is not None  # the original's user still has its layers
    assert unprepare(first) and document_mixers(model) is None
