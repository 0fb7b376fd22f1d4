"""The MoE router (load-balancing) loss of a packed batch against the padded batch of the same documents.

transformers' MoE models add ``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...,
attention_mask)`` to their loss, a statistic of every token the batch routes; a padded batch keeps its padding
out through ``attention_mask``.  A padding-free row holds the same real tokens and no mask, so its router loss,
per layer and in total, is the padded batch's; filler tokens (``pad_to_multiple_of``, ``pad_to_buckets``, the
right-padding of ``padding_free=False`` rows) would enter the statistics, so ``prepare_trainer`` refuses them
beside a router loss.  Reference: every micro-batch of the recorded training run as one padded batch with its
``attention_mask`` (fp32, CPU, SGD), the token loss over the accumulation window plus the router loss of each
micro-batch, as ``Trainer`` sums them.
"""

import copy

import pytest
from _hf_models import PAD, Recorder, params, sequences
from test_hf import LR, packed_dataset, train_args
from test_sft_config_alone import labelled_rows

from packtools import PaddingFreeCollator, prepare_trainer
from packtools.errors import PackingError
from packtools.integrations import packed_sft_config
from packtools.testing import tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

COEF = 0.5  # large, so that a router loss left out or changed shows in every parameter
TOL = 1e-5


def moe(family="Qwen3-MoE"):
    model = tiny_model(family)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = COEF
    model.router_aux_loss_coef = COEF  # the model reads its copy taken at construction
    return model


def documents(rows):
    """The documents of packed rows, each ``(tokens, labels)`` as the padded batch trains them."""
    out = []
    for row in rows:
        start = 0
        for n in row["seq_lengths"]:
            ids = row["input_ids"][start : start + n]
            mask = row.get("completion_mask", [1] * len(row["input_ids"]))[start : start + n]
            labels = row["labels"][start : start + n] if "labels" in row else None
            out.append((ids, labels or [t if m else -100 for t, m in zip(ids, mask)]))
            start += n
    return out


def padded(docs):
    width = max(len(ids) for ids, _ in docs)
    ids = torch.tensor([i + [PAD] * (width - len(i)) for i, _ in docs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in docs])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in docs])
    return ids, labels, mask


def padded_training(model, batches, accumulation, aux_share=1.0, lr=LR):
    """Plain SGD over padded micro-batches: the window's token-summed loss over its trained tokens, plus
    ``COEF * aux_share`` times each micro-batch's router loss (counting only attention_mask's tokens):
    ``Trainer`` adds each micro-batch's whole router loss (``aux_share=1``), TRL's ``SFTTrainer`` its share of
    the window (``1 / accumulation``)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for w in range(0, len(batches), accumulation):
        window = [padded(documents(b)) for b in batches[w : w + accumulation]]
        n_items = sum(int((lab[:, 1:] != -100).sum()) for _, lab, _ in window)
        optimizer.zero_grad()
        for ids, labels, mask in window:
            out = model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False)
            logits, target = out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
            token_sum = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
            (token_sum / n_items + COEF * aux_share * out.aux_loss).backward()
        optimizer.step()


def gap(trained, reference):
    return max((trained[k] - reference[k]).abs().max().item() for k in trained)


@pytest.mark.parametrize("family", ["Qwen3-MoE", "Mixtral"])
def test_router_loss_of_a_padding_free_row_is_the_padded_batchs_per_layer(family):
    """Per layer: the router logits of the real tokens, and the router loss of each layer, equal the padded
    batch's; in total: the loss, the router loss and every gradient (within 1e-5 / fp32 rounding)."""
    docs = documents(
        [{"input_ids": s["input_ids"], "seq_lengths": [len(s["input_ids"])]} for s in sequences(6)]
    )
    ids, labels, mask = padded(docs)
    model = moe(family)
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    ref.loss.backward()
    ref_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    row = {"input_ids": sum((d[0] for d in docs), []), "seq_lengths": [len(d[0]) for d in docs]}
    row["labels"] = sum((d[1] for d in docs), [])
    out = model(**PaddingFreeCollator(PAD)([row]))
    out.loss.backward()
    loss_fn = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    experts = getattr(model.config, "num_local_experts", None) or model.config.num_experts
    top_k = model.config.num_experts_per_tok
    for layer, (packed_logits, padded_logits) in enumerate(zip(out.router_logits, ref.router_logits)):
        real = padded_logits[mask.flatten().bool()]
        assert (packed_logits - real).abs().max().item() < TOL, layer
        one = loss_fn((packed_logits,), experts, top_k).item()
        assert abs(one - loss_fn((padded_logits,), experts, top_k, mask).item()) < TOL, layer
    assert abs(out.aux_loss.item() - ref.aux_loss.item()) < TOL
    assert abs(out.loss.item() - ref.loss.item()) < TOL
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert gap(grads, ref_grads) < TOL
    # negative control: filler of pad_to_multiple_of counted as routed tokens moves the router loss
    model.zero_grad()
    filled = model(**PaddingFreeCollator(PAD, pad_to_multiple_of=64)([row]))
    assert abs(filled.aux_loss.item() - ref.aux_loss.item()) > 1e-4


def build(tmp_path, trainer_cls, collator=None, model=None, **overrides):
    model = moe() if model is None else model
    if trainer_cls is transformers.Trainer:
        args = train_args(tmp_path, **overrides)
        return transformers.Trainer(
            model=model, args=args, train_dataset=packed_dataset(), data_collator=collator
        )
    args = train_args(tmp_path, cls=packed_sft_config, bf16=False, **overrides)
    return trl.SFTTrainer(
        model=model, args=args, train_dataset=labelled_rows(), processing_class=_tokenizer(),
        **({} if collator is None else {"data_collator": collator}),
    )  # fmt: skip


def run(tmp_path, trainer_cls, collator=None, prepare=True, family="Qwen3-MoE", **overrides):
    model = moe(family)
    reference = copy.deepcopy(model)
    trainer = build(tmp_path, trainer_cls, collator, model, **overrides)
    recorder = Recorder(trainer.data_collator)
    trainer.data_collator = recorder
    if prepare:
        prepare_trainer(trainer)
    trainer.train()
    accumulation = trainer.args.gradient_accumulation_steps
    share = 1.0 if trainer_cls is transformers.Trainer else 1 / accumulation
    padded_training(reference, recorder.batches, accumulation, share)
    moved = gap(params(model), params(moe(family)))
    return gap(params(model), params(reference)), moved


def _tokenizer():
    from _hf_models import word_tokenizer

    return word_tokenizer()


@pytest.mark.parametrize("family", ["Qwen3-MoE", "Mixtral"])
def test_trainer_with_accumulation_trains_the_padded_router_loss(tmp_path, family):
    off, moved = run(tmp_path, transformers.Trainer, PaddingFreeCollator(PAD), family=family)
    assert moved > 1e-2 and off < TOL


@pytest.mark.parametrize("prepare", [False, True])
def test_sft_trainer_packed_sft_config_trains_the_padded_router_loss(tmp_path, prepare):
    off, moved = run(tmp_path, trl.SFTTrainer, prepare=prepare, gradient_checkpointing=False)
    assert moved > 1e-2 and off < TOL


@pytest.mark.parametrize(
    ("collator", "named"),
    [
        (PaddingFreeCollator(PAD, pad_to_multiple_of=64), "pad_to_multiple_of=64"),
        (PaddingFreeCollator(PAD, pad_to_buckets=[64, 128]), r"pad_to_buckets=\[64, 128\]"),
        (PaddingFreeCollator(PAD, padding_free=False, attn_implementation="sdpa"), "padding_free=False"),
    ],
)
def test_filler_beside_a_router_loss_is_refused_by_name(tmp_path, collator, named):
    """Each collator that adds filler tokens to a packed batch would count them in the router statistics (the
    negative control of the per-layer test): refused with the fix, and fine without the router loss."""
    with pytest.raises(PackingError, match=f"MoE router loss.*{named}.*router_aux_loss_coef=0.0"):
        prepare_trainer(build(tmp_path, transformers.Trainer, collator))
    model = moe()
    model.config.output_router_logits = False
    prepare_trainer(
        build(tmp_path, transformers.Trainer, collator, model)
    )  # no router loss: the filler is not counted anywhere


def test_trl_collator_pad_to_multiple_of_beside_a_router_loss_is_refused(tmp_path):
    """TRL's own collator (``padding_free=False`` hands it over, as a user's ``data_collator``) padding to a
    multiple beside the router loss: refused by ``prepare_trainer``."""
    collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(
        PAD, padding_free=True, pad_to_multiple_of=64
    )
    with pytest.raises(PackingError, match="MoE router loss.*pad_to_multiple_of=64"):
        prepare_trainer(build(tmp_path, trl.SFTTrainer, collator, padding_free=False))


def _sft_config_unchecked(**kwargs):
    """What ``packed_sft_config`` built before it refused ``pad_to_multiple_of``: TRL's ``SFTConfig`` with the
    packed-dataset settings."""
    kwargs.update(
        packing=False, padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True}
    )
    return trl.SFTConfig(**kwargs)


def test_packed_sft_config_pad_to_multiple_of_beside_a_router_loss_is_refused(tmp_path, monkeypatch):
    """``SFTTrainer(args=packed_sft_config(pad_to_multiple_of=64))`` without ``prepare_trainer``: TRL trains the
    router loss of a MoE model by default and its collator's pad tokens (one 1-token document each) count in it.
    Measured here: such a trainer lands away from the padded micro-batches; ``packed_sft_config`` refuses it by
    name, and takes it with ``router_aux_loss_coef=0.0`` (no router loss)."""
    with pytest.raises(
        PackingError, match="pad_to_multiple_of=64 under padding_free=True.*router_aux_loss_coef=0.0"
    ):
        packed_sft_config(output_dir=str(tmp_path), pad_to_multiple_of=64, bf16=False)
    packed_sft_config(output_dir=str(tmp_path), pad_to_multiple_of=64, router_aux_loss_coef=0.0, bf16=False)
    monkeypatch.setitem(globals(), "packed_sft_config", _sft_config_unchecked)
    off, moved = run(
        tmp_path, trl.SFTTrainer, prepare=False, gradient_checkpointing=False, pad_to_multiple_of=64
    )
    assert moved > 1e-2 and off > 1e-4  # the silent gap the refusal closes


def _dpo(tmp_path, n=16):
    from test_dpo import build as build_dpo

    return build_dpo(tmp_path, n=n, arch="Qwen3-MoE", router_aux_loss_coef=COEF)


def _packed_pairs(trainer, share_prompt):
    from packtools.dpo import pack_preference

    indexed = trainer.train_dataset.add_column("pair", list(range(len(trainer.train_dataset))))
    return pack_preference(indexed, 64, columns=["pair"], share_prompt=share_prompt)


def test_dpo_router_loss_equals_trls_padded_batch(tmp_path):
    """prepare_dpo_trainer on TRL's pairs and on packed pair rows: the loss, the logged aux_loss and every
    gradient equal TRL's padded batch of the same pairs (the router sees only real tokens either way)."""
    from test_dpo import assert_same, loss_metrics_grads, trl_batch

    from packtools import prepare_dpo_trainer

    padded = _dpo(tmp_path)
    assert padded.aux_loss_enabled
    prepared = prepare_dpo_trainer(_dpo(tmp_path))
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    want = loss_metrics_grads(padded, batch)
    assert want[1]["aux_loss"] > 1.0
    assert_same(want, loss_metrics_grads(prepared, batch))
    trainer = _dpo(tmp_path)
    packed = _packed_pairs(trainer, share_prompt=False)
    prepared = prepare_dpo_trainer(trainer, train_dataset=packed)
    rows = [packed[0], packed[1]]
    pairs = [i for r in rows for i in r["pair"]]
    padded = _dpo(tmp_path)  # a fresh one: TRL's num_tokens metric counts on from the first batch
    want = loss_metrics_grads(padded, trl_batch(padded, pairs))
    assert_same(want, loss_metrics_grads(prepared, prepared.data_collator(rows)))


def test_dpo_shared_prompt_beside_a_router_loss_is_refused(tmp_path):
    """A shared prompt is routed once, TRL routes it twice (chosen, rejected): measured, the aux loss moved by
    5e-4 and gradients by 2e-3 on this batch.  Refused by name, also when pack_preference's rows ask for it."""
    from packtools import prepare_dpo_trainer

    trainer = _dpo(tmp_path)
    with pytest.raises(PackingError, match="share_prompt=True with the MoE router loss"):
        prepare_dpo_trainer(trainer, train_dataset=_packed_pairs(trainer, share_prompt=True))
    with pytest.raises(PackingError, match="share_prompt=True with the MoE router loss"):
        prepare_dpo_trainer(_dpo(tmp_path), share_prompt=True)


def test_guard_model_refuses_filler_beside_a_router_loss_in_a_loop_of_ones_own():
    """guard_model sees no collator: a packed row ending in filler (pad_token_id, no label) while the model
    computes its router loss is refused at the forward; the same row without filler and the filler with
    output_router_logits=False pass."""
    from packtools.integrations.trainers.guard import guard_model

    docs = documents(
        [{"input_ids": s["input_ids"], "seq_lengths": [len(s["input_ids"])]} for s in sequences(6)]
    )
    row = {"input_ids": sum((d[0] for d in docs), []), "seq_lengths": [len(d[0]) for d in docs]}
    model = moe()
    guard_model(model, check_isolation=False)
    for collator in (
        PaddingFreeCollator(PAD, pad_to_multiple_of=64),
        PaddingFreeCollator(PAD, pad_to_buckets=[128]),
        PaddingFreeCollator(PAD, padding_free=False, attn_implementation="sdpa"),
    ):
        rows = [row, {"input_ids": row["input_ids"][:5], "seq_lengths": [5]}]
        with pytest.raises(PackingError, match="ends in .* filler tokens .*MoE router loss"):
            model(**collator(rows))
        model(**collator(rows), output_router_logits=False)
    model(**PaddingFreeCollator(PAD)([row]))


def _row_and_padded(n=6):
    docs = documents(
        [{"input_ids": s["input_ids"], "seq_lengths": [len(s["input_ids"])]} for s in sequences(n)]
    )
    row = {"input_ids": sum((d[0] for d in docs), []), "seq_lengths": [len(d[0]) for d in docs]}
    row["labels"] = sum((d[1] for d in docs), [])
    return row, padded(docs)


def test_guard_refuses_a_single_filler_token_and_trls_padding():
    """One filler token (``pad_to_multiple_of`` one past the row) and TRL's padding (each pad token its own
    1-token document, positions 0) move the router loss away from the padded batch's: both refused at the
    forward (before, a tail shorter than 2 tokens, and so TRL's padding, passed)."""
    from packtools.integrations.trainers.guard import guard_model

    row, (ids, labels, mask) = _row_and_padded()
    model = moe()
    want = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).aux_loss.item()
    length = len(row["input_ids"])
    one = PaddingFreeCollator(PAD, pad_to_multiple_of=length + 1)([row])
    collate = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(
        PAD, padding_free=True, pad_to_multiple_of=64
    )
    trls = collate(
        [{"input_ids": row["input_ids"], "labels": row["labels"], "seq_lengths": row["seq_lengths"]}]
    )
    fill = trls["input_ids"].shape[1] - length
    assert fill > 1 and int((trls["position_ids"][0, length:] == 0).sum()) == fill  # 1-token documents
    for batch in (one, trls):
        assert abs(model(**batch).aux_loss.item() - want) > 1e-7  # counted: another router loss
    guard_model(model, check_isolation=False)
    with pytest.raises(PackingError, match="ends in 1 filler tokens .*MoE router loss"):
        model(**one)
    with pytest.raises(PackingError, match=f"ends in {fill} filler tokens .*MoE router loss"):
        model(**trls)
    assert abs(model(**PaddingFreeCollator(PAD)([row])).aux_loss.item() - want) < TOL  # no filler: exact
    model(**one, output_router_logits=False)


def test_guard_without_a_pad_token_id_refuses_an_unlabelled_last_document():
    """A config without ``pad_token_id`` (the collator's is not known to the model): a row whose last document
    has no label trained may end in filler, so it is refused naming ``pad_token_id`` (before: nothing checked);
    with another ``pad_token_id`` than the collator's, an untrained last document of one repeated id is refused
    the same way (before: passed); with the collator's, filler is told by its tokens; a trained row passes."""
    from packtools.integrations.trainers.guard import guard_model

    row, _ = _row_and_padded()
    model = moe()
    model.config.pad_token_id = None
    guard_model(model, check_isolation=False)
    filled = PaddingFreeCollator(PAD, pad_to_multiple_of=64)([row])
    with pytest.raises(PackingError, match="no pad_token_id: it may be the collator's filler"):
        model(**filled)
    model(**PaddingFreeCollator(PAD)([row]))  # its last document is trained: no filler
    model.config.pad_token_id = PAD + 1  # another id than the collator's: its filler is not the config's pad
    with pytest.raises(PackingError, match=f"57 times token {PAD}, not the config's pad_token_id={PAD + 1}"):
        model(**filled)
    model(**PaddingFreeCollator(PAD)([row]))
    model.config.pad_token_id = PAD
    with pytest.raises(PackingError, match="ends in 57 filler tokens"):
        model(**filled)


def test_guard_without_a_pad_token_id_passes_an_untrained_last_document_of_several_ids():
    """A real last document that trains no token (``bfd`` keeps a document whose kept part trains nothing), the
    batch without filler: no collator pads with several ids, so it is no filler and passes (before: refused
    naming ``pad_token_id`` whenever the config had none -- Mixtral's, Qwen3-MoE's default -- mid-training,
    the batch exact); one of one repeated id is still refused."""
    from packtools.integrations.trainers.guard import guard_model

    row, (ids, labels, mask) = _row_and_padded()
    n = row["seq_lengths"][-1]
    assert len(set(row["input_ids"][-n:])) > 1
    row["labels"] = row["labels"][:-n] + [-100] * n
    labels[-1] = -100
    model = moe()
    model.config.pad_token_id = None
    want = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).aux_loss.item()
    guard_model(model, check_isolation=False)
    assert abs(model(**PaddingFreeCollator(PAD)([row])).aux_loss.item() - want) < TOL  # exact, and passes
    row["input_ids"] = row["input_ids"][:-n] + [7] * n  # one id repeated: may be filler, refused
    with pytest.raises(PackingError, match="no pad_token_id: it may be the collator's filler"):
        model(**PaddingFreeCollator(PAD)([row]))


def _jetmoe():
    """JetMoE weighs its router loss by ``aux_loss_coef`` (its own copy and its config's), not
    ``router_aux_loss_coef``."""
    from _hf_models import VOCAB

    config = transformers.JetMoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        kv_channels=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, aux_loss_coef=COEF, pad_token_id=PAD,
    )  # fmt: skip
    return transformers.JetMoeForCausalLM(config)


def test_jetmoe_router_loss_beside_filler_is_refused(tmp_path):
    """Its forward adds ``aux_loss_coef * aux_loss`` (measured: the filler moves it), so a collator's filler and a
    packed row ending in filler are refused as for the models that name it ``router_aux_loss_coef``."""
    from packtools.integrations.trainers.guard import guard_model

    model = _jetmoe()
    row = {"input_ids": list(range(2, 12)) + list(range(3, 9)), "seq_lengths": [10, 6]}
    ref = model(**PaddingFreeCollator(PAD)([row]), output_router_logits=True)
    filled = model(**PaddingFreeCollator(PAD, pad_to_multiple_of=32)([row]), output_router_logits=True)
    assert abs(filled.aux_loss.item() - ref.aux_loss.item()) > 1e-4
    with pytest.raises(PackingError, match="MoE router loss.*pad_to_multiple_of=64"):
        prepare_trainer(
            build(tmp_path, transformers.Trainer, PaddingFreeCollator(PAD, pad_to_multiple_of=64), model)
        )
    guard_model(model, check_isolation=False)
    with pytest.raises(PackingError, match="ends in .* filler tokens .*MoE router loss"):
        model(**PaddingFreeCollator(PAD, pad_to_multiple_of=32)([row]))
    model.config.output_router_logits = False
    model(
        **PaddingFreeCollator(PAD, pad_to_multiple_of=32)([row])
    )  # no router loss: the filler is not counted


def test_trls_own_router_coefficient_beside_filler_is_refused(tmp_path):
    """TRL's trainers decide the router loss themselves (``aux_loss_enabled`` from SFTConfig's
    ``router_aux_loss_coef``), pass ``output_router_logits=True`` to every forward and weight ``outputs.aux_loss``
    with their own coefficient: a model built with ``router_aux_loss_coef=0.0`` still trains it, so filler beside
    it is refused by prepare_trainer and, at the forward, by guard_model."""
    from packtools.integrations.trainers.guard import guard_model

    model = moe()
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = 0.0
    model.config.output_router_logits = False
    collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(
        PAD, padding_free=True, pad_to_multiple_of=64
    )
    trainer = build(tmp_path, trl.SFTTrainer, collator, model, padding_free=False, router_aux_loss_coef=COEF)
    assert trainer.aux_loss_enabled and model.router_aux_loss_coef == 0.0
    with pytest.raises(PackingError, match="MoE router loss.*pad_to_multiple_of=64"):
        prepare_trainer(trainer)
    guard_model(model, check_isolation=False)
    row = {"input_ids": list(range(2, 12)) + list(range(3, 9)), "seq_lengths": [10, 6]}
    batch = PaddingFreeCollator(PAD, pad_to_multiple_of=32)([row])
    with pytest.raises(PackingError, match="ends in .* filler tokens .*MoE router loss"):
        model(**batch, output_router_logits=True)
    model(**PaddingFreeCollator(PAD)([row]), output_router_logits=True)  # no filler


def test_a_multimodal_collators_padding_beside_a_router_loss_is_refused():
    """``MultimodalCollator(pad_to_multiple_of=)`` keeps the setting on its text collator: seen there too."""
    from types import SimpleNamespace

    from packtools.batches import MultimodalCollator
    from packtools.batches.mrope import MropeSpec
    from packtools.integrations.trainers.step import check_router_padding

    def trainer(collator):
        return SimpleNamespace(
            model=moe(), data_collator=collator, args=SimpleNamespace(per_device_train_batch_size=1)
        )

    spec = MropeSpec("qwen2_vl", 9, 8, 2)
    with pytest.raises(PackingError, match="router loss.*pad_to_multiple_of=64 in MultimodalCollator"):
        check_router_padding(trainer(MultimodalCollator(spec, PAD, pad_to_multiple_of=64)), None)
    check_router_padding(trainer(MultimodalCollator(spec, PAD)), None)  # no filler: accepted


def test_llama4_returns_no_router_loss_so_its_padding_is_accepted(tmp_path):
    """Llama 4's forward returns its router logits and no ``aux_loss`` (transformers 5.25), whatever its config's
    ``output_router_logits`` and ``router_aux_loss_coef``: filler changes none of its loss, so
    ``pad_to_multiple_of`` beside it is accepted (before: refused as a router loss it does not have)."""
    from packtools.integrations.trainers.guard import guard_model
    from packtools.integrations.trainers.router import router_loss_on

    model = tiny_model("Llama 4")
    model.config.output_router_logits = True
    assert model.config.router_aux_loss_coef and not router_loss_on(model)
    row, (ids, labels, mask) = _row_and_padded()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    filled = PaddingFreeCollator(PAD, pad_to_multiple_of=64)([row])
    guard_model(model, check_isolation=False)
    out = model(**filled, output_router_logits=True)
    assert ref.aux_loss is None and out.aux_loss is None and out.router_logits
    assert abs(out.loss.item() - ref.loss.item()) < TOL  # the filler is in no loss
    prepare_trainer(
        build(tmp_path, transformers.Trainer, PaddingFreeCollator(PAD, pad_to_multiple_of=64), model)
    )


def test_the_families_without_a_router_loss_are_those_of_the_installed_transformers():
    """:data:`~packtools.integrations.trainers.router.NO_ROUTER_LOSS` re-derived from transformers' sources: the
    models whose config declares ``output_router_logits`` and a router coefficient while their modeling file
    computes no load-balancing loss."""
    import re
    from pathlib import Path

    from packtools.integrations.trainers.router import COEFFICIENTS, NO_ROUTER_LOSS

    found = set()
    for config in sorted(Path(transformers.__file__).parent.glob("models/*/configuration_*.py")):
        text = config.read_text()
        if "output_router_logits" not in text or not any(f"{c}:" in text for c in COEFFICIENTS):
            continue
        modeling = config.with_name(config.name.replace("configuration_", "modeling_"))
        if modeling.exists() and "load_balancing_loss_func(" not in modeling.read_text():
            found |= {t for t in re.findall(r'model_type = "(\w+)"', text) if "vision" not in t}
    assert found == NO_ROUTER_LOSS


def _bamba(z):
    from packtools.integrations.attention.mixers import run_mixers_per_document

    model = tiny_model("Bamba")
    model.config.z_loss_coefficient = model.z_loss_coefficient = z
    run_mixers_per_document(model)
    return model


def test_bambas_z_loss_beside_packed_rows_is_refused(tmp_path):
    """Bamba's z-loss is a mean of logsumexp(logits)^2 over every position of the batch: the padded batch counts
    its padding, a padding-free row only its real tokens, a row with filler its filler.  Measured: three
    different losses (the cross-entropy the same); refused by prepare_trainer and at the forward by the guard
    (before: trained silently); ``z_loss_coefficient=0.0`` (the default) passes."""
    from packtools.integrations.trainers.guard import guard_model

    row, (ids, labels, mask) = _row_and_padded()
    model = _bamba(0.5)
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.item()
    free = model(**PaddingFreeCollator(PAD)([row])).loss.item()
    filled = model(**PaddingFreeCollator(PAD, pad_to_multiple_of=64)([row])).loss.item()
    assert abs(free - ref) > 1e-3 and abs(filled - ref) > 1e-3 and abs(filled - free) > 1e-3
    with pytest.raises(PackingError, match="z_loss_coefficient=0.5 on BambaForCausalLM"):
        prepare_trainer(build(tmp_path, transformers.Trainer, PaddingFreeCollator(PAD), model))
    guard_model(model, check_isolation=False)
    with pytest.raises(PackingError, match="z_loss_coefficient=0.5.*padding included"):
        model(**PaddingFreeCollator(PAD)([row]))
    model.z_loss_coefficient = model.config.z_loss_coefficient = 0.0
    model(**PaddingFreeCollator(PAD)([row]))
    assert (
        abs(
            model(**PaddingFreeCollator(PAD)([row])).loss.item()
            - model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss.item()
        )
        < TOL
    )


def test_guard_refuses_filler_beside_qwen_vl_rotary_positions_without_cu_seq_lens():
    """A Qwen-VL MoE (Qwen3.5-MoE) batch carries ``(4, B, T)`` positions: without
    ``cu_seq_lens_q`` (``return_flash_attn_kwargs=False``, a collator of one's own) its filler moved the router
    loss and the guard, reading only 2-D positions, checked nothing (before: passed); with them it is refused."""
    from _vl_models import mixed_samples, tiny_vl
    from test_vision_train import packed_rows

    from packtools.batches.vision import MultimodalCollator
    from packtools.integrations.attention.mixers import run_mixers_per_document
    from packtools.integrations.trainers.guard import guard_model

    model = tiny_vl("qwen3_5_moe", "sdpa").eval()
    text = model.config.text_config
    text.output_router_logits, text.router_aux_loss_coef, text.pad_token_id = True, COEF, 0
    run_mixers_per_document(model)
    docs = packed_rows(mixed_samples(3))[:1]
    exact = MultimodalCollator(model, 0, return_flash_attn_kwargs=False)(docs)
    filled = MultimodalCollator(model, 0, pad_to_multiple_of=64, return_flash_attn_kwargs=False)(docs)
    assert "cu_seq_lens_q" not in filled and filled["position_ids"].shape[0] == 4
    with torch.no_grad():
        want = model(**exact).aux_loss.item()
        assert abs(model(**filled).aux_loss.item() - want) > 1e-7  # the filler is counted: silent
        guard_model(model, check_isolation=False)
        assert abs(model(**exact).aux_loss.item() - want) < TOL  # no filler: passes
        with pytest.raises(PackingError, match="ends in 16 filler tokens .*MoE router loss"):
            model(**filled)
