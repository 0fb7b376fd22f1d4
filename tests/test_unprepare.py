"""unprepare / prepared: everything prepare_trainer changes is recorded and put back; unknown shapes are refused.

A trainer prepared and then unprepared must be the trainer as it was built: the same attribute values (columns
kept, collator, loss function, loader method), a model with no packtools hook and its own attention backend
(same forward output), and transformers' attention registry without packtools' entry.  An object lacking the
internals packtools checked raises a PackingError naming the library and its version, never a silent fallback.
"""

import pytest
from _hf_models import PAD, VOCAB, sequences, tiny_llama, torch, transformers

from packtools import compat, pack_dataset
from packtools.batches.collate import PaddingFreeCollator
from packtools.compat import transformers as compat_transformers
from packtools.errors import PackingError
from packtools.integrations import prepare_trainer, prepared, unprepare
from packtools.integrations.attention.segmented import SEGMENTED_SDPA

datasets = pytest.importorskip("datasets")
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402

WATCHED = ("_signature_columns", "data_collator", "compute_loss_func", "packtools_step", "__class__")


class NamedInputsLlama(transformers.LlamaForCausalLM):
    """A forward that names its inputs (no **kwargs): prepare_trainer switches seq_idx / cu_seq_lens off."""

    def forward(self, input_ids=None, labels=None, position_ids=None, use_cache=None):
        return super().forward(
            input_ids=input_ids, labels=labels, position_ids=position_ids, use_cache=use_cache
        )


@pytest.fixture(autouse=True)
def no_packtools_sdpa_registered(monkeypatch):
    """Each test starts without packtools_sdpa in the registries and with no owner holding it (other tests in
    the session register it for good, or prepare trainers they never unprepare); all put back afterwards."""
    for registry in (AttentionInterface, type(ALL_MASK_ATTENTION_FUNCTIONS)):
        if SEGMENTED_SDPA in registry._global_mapping:
            monkeypatch.delitem(registry._global_mapping, SEGMENTED_SDPA)
    monkeypatch.setattr(compat_transformers, "_HELD", {})


def _args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    return transformers.TrainingArguments(**{**kwargs, **overrides})


def _trainer(tmp_path, model=None, collator=None):
    data = pack_dataset(datasets.Dataset.from_list(sequences(12, seed=3)), 32)
    return transformers.Trainer(
        model=model if model is not None else tiny_llama("sdpa"),
        args=_args(tmp_path),
        train_dataset=data,
        data_collator=collator or PaddingFreeCollator(PAD, return_seq_idx=True),
    )


def _state(trainer):
    """What prepare_trainer may change, as values (the instance's own attributes, not the class's)."""
    own = {name: vars(trainer).get(name, "<class>") for name in WATCHED}
    own["__class__"] = type(trainer)  # the step owner swaps the class
    model = trainer.model
    hooks = dict(model._forward_pre_hooks)
    ids = torch.arange(1, 11)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    return own, hooks, model.config._attn_implementation, logits, sorted(vars(model))


def _registered():
    return (
        SEGMENTED_SDPA in AttentionInterface._global_mapping,
        SEGMENTED_SDPA in ALL_MASK_ATTENTION_FUNCTIONS,
    )


def _assert_restored(before, after, trained=False):
    (own0, hooks0, impl0, logits0, attrs0), (own1, hooks1, impl1, logits1, attrs1) = before, after
    assert own1 == own0
    assert hooks1 == hooks0
    assert impl1 == impl0 == "sdpa"
    assert torch.equal(logits1, logits0) != trained  # same weights: the very same output
    assert [a for a in attrs1 if "packtools" in a] == []
    if not trained:  # training itself adds accelerate's attributes
        assert attrs1 == attrs0


def test_unprepare_restores_a_trainer(tmp_path):
    model = NamedInputsLlama(tiny_llama("sdpa").config)
    trainer = _trainer(tmp_path, model=model, collator=PaddingFreeCollator(PAD, return_seq_idx=True))
    trainer.model_accepts_loss_kwargs = False  # so prepare_trainer also installs its compute_loss_func
    assert _registered() == (False, False)
    before = _state(trainer)
    prepare_trainer(trainer)
    # prepare_trainer changed every watched thing (the check below would pass trivially otherwise).
    changed = _state(trainer)
    assert changed[0]["_signature_columns"] != before[0]["_signature_columns"]
    assert "seq_lengths" in changed[0]["_signature_columns"]
    assert changed[0]["data_collator"] is not before[0]["data_collator"]  # seq_idx switched off for Llama
    assert changed[0]["compute_loss_func"] is not None
    assert changed[0]["packtools_step"] != "<class>"  # the run's plan
    assert (
        changed[0]["__class__"].__name__ == "PackedTrainer" and before[0]["__class__"] is transformers.Trainer
    )
    assert len(changed[1]) == len(before[1]) + 1 and changed[2] == SEGMENTED_SDPA
    assert _registered() == (True, True)
    assert prepare_trainer(trainer) is trainer  # idempotent: the same options change nothing
    with pytest.raises(PackingError, match="already called on this PackedTrainer with max_tokens=None"):
        prepare_trainer(trainer, max_tokens=64)  # other options would stack on the first: refused
    assert _state(trainer)[0] == changed[0]

    names = compat.patches_of(trainer).names()
    assert unprepare(trainer) is trainer
    _assert_restored(before, _state(trainer))
    assert _registered() == (False, False)
    assert any("_signature_columns" in n for n in names) and any("pre-hook" in n for n in names)
    assert compat.patches_of(trainer).names() == []
    # The trainer can be prepared again after unprepare (nothing of the first preparation is left behind).
    prepare_trainer(trainer, check_isolation=False)
    assert trainer.model.config._attn_implementation == SEGMENTED_SDPA
    unprepare(trainer)
    assert trainer.model.config._attn_implementation == "sdpa"


def test_registry_entry_stays_while_another_trainer_needs_it(tmp_path):
    first, second = _trainer(tmp_path / "a"), _trainer(tmp_path / "b")
    prepare_trainer(first, check_isolation=False)
    prepare_trainer(second, check_isolation=False)
    unprepare(first)
    assert _registered() == (True, True)  # second still runs packtools_sdpa
    assert second.model.config._attn_implementation == SEGMENTED_SDPA
    with torch.no_grad():
        second.model(input_ids=torch.arange(1, 6)[None])
    unprepare(second)
    assert second.model.config._attn_implementation == "sdpa"
    assert _registered() == (False, False)


def test_prepared_context_manager_trains_and_restores(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.args.max_steps = 1
    before = _state(trainer)
    with prepared(trainer, max_tokens=64) as same:
        assert same is trainer
        assert type(trainer).__name__ == "PackedTrainer" and "get_train_dataloader" not in vars(trainer)
        loader = trainer.get_train_dataloader()
        assert type(loader.batch_sampler).__name__ == "RankBatches"  # packtools' token-budget batches
        trainer.train()
    _assert_restored(before, _state(trainer), trained=True)
    assert type(trainer.get_train_dataloader().batch_sampler).__name__ != "RankBatches"


def test_prepared_refuses_a_trainer_already_prepared(tmp_path):
    """Leaving the block would unprepare the earlier preparation too (loss mode, loader, attention back to the
    trainer's own, silently): refused by name, the earlier preparation kept."""
    trainer = prepare_trainer(_trainer(tmp_path), max_tokens=64)
    with pytest.raises(PackingError, match="already prepared"):
        with prepared(trainer, max_tokens=64):
            pass
    assert type(trainer).__name__ == "PackedTrainer"


def test_a_refused_trainer_is_left_as_it_came(tmp_path):
    from transformers import DataCollatorWithFlattening

    trainer = _trainer(tmp_path, collator=DataCollatorWithFlattening())
    before = _state(trainer)
    with pytest.raises(PackingError, match="cannot keep packed sequences apart"):
        prepare_trainer(trainer)
    _assert_restored(before, _state(trainer))
    assert compat.patches_of(trainer).names() == []


def test_sft_trainer_unprepared(tmp_path):
    trl = pytest.importorskip("trl")
    from packtools.integrations import packed_sft_config

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(), pad_token="<pad>", eos_token="<eos>"
    )
    data = pack_dataset(datasets.Dataset.from_list(sequences(12, seed=3)), 32)
    args = packed_sft_config(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", padding_free=False
    )
    trainer = trl.SFTTrainer(
        model=tiny_llama("sdpa"),
        args=args,
        train_dataset=data,
        processing_class=tok,
        data_collator=PaddingFreeCollator(PAD),
    )
    before = _state(trainer)
    prepare_trainer(trainer)
    assert trainer.model.config._attn_implementation == SEGMENTED_SDPA
    unprepare(trainer)
    _assert_restored(before, _state(trainer))


def _word_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    return tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))


def test_trainer_without_signature_columns_is_refused_not_ignored(tmp_path, monkeypatch):
    """Negative control for the old silent fallback (remove_unused_columns quietly switched off)."""
    trainer = _trainer(tmp_path)
    del trainer._signature_columns
    with pytest.raises(
        PackingError, match=r"transformers .*_signature_columns.*checked against transformers"
    ):
        prepare_trainer(trainer)
    assert trainer.args.remove_unused_columns is True  # nothing changed behind the user's back
    assert compat.patches_of(trainer).names() == []


def test_unknown_trainer_column_removal_is_refused(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    monkeypatch.setattr(
        type(trainer), "_remove_unused_columns", lambda self, dataset: dataset
    )  # a shape without description=
    with pytest.raises(PackingError, match=r"_remove_unused_columns\(dataset, description\)"):
        prepare_trainer(trainer)
    assert "packtools_step" not in vars(trainer) and type(trainer) is transformers.Trainer


def test_unknown_registry_shape_names_the_version(monkeypatch):
    monkeypatch.setattr(compat, "version", lambda name: "99.0.0")  # a transformers packtools never saw
    monkeypatch.setattr(AttentionInterface, "_global_mapping", ())  # ... whose registry is no dict
    with pytest.raises(
        PackingError, match=r"transformers 99\.0\.0.*_global_mapping.*checked against transformers 5"
    ):
        compat_transformers.register_attention("packtools_test", lambda *a, **k: None, owner=object())


def test_tensor_without_version_counter_is_refused():
    from packtools.compat.torch import tensor_version

    class NotATensor:
        pass

    assert tensor_version(torch.zeros(1)) == 0
    with torch.inference_mode():
        assert tensor_version(torch.zeros(1)) is None
    with pytest.raises(PackingError, match="torch .*no _version"):
        tensor_version(NotATensor())


def test_unknown_batch_sampler_shard_is_refused():
    from packtools.compat.accelerate import stop_sharding

    class BatchSamplerShard:  # accelerate's name, a shape without process_index
        def __init__(self):
            self.batch_sampler, self.num_processes, self.split_batches = [], 2, False

    with pytest.raises(PackingError, match=r"accelerate .*without \['process_index'\]"):
        stop_sharding(BatchSamplerShard(), lambda epoch: None)
