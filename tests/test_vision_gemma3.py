"""Gemma 3 with images trained packed: through Trainer + prepare_trainer + MultimodalCollator and through a guarded
loop of one's own, the loss and every gradient equal the samples run one by one (CPU fp32, 1e-5), with a sliding
layer whose window is shorter than the documents, images of one and two per document and a text-only one.

transformers builds a packed row's sliding-window mask wrong for Gemma 3's images (tests/test_vision_refusals.py
pins it), so ``MultimodalCollator`` gives each document's masks ready-made (``attention_mask`` by layer type, with
``token_type_ids``); ``eager`` cannot read them and is refused, and so are image inputs without them.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _hf_models import plain_sgd_options
from test_vision_refusals import IMAGE, tiny_gemma3

from packtools import PaddingFreeCollator, pack_dataset, prepare_trainer
from packtools.batches.mrope import MropeSpec
from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError
from packtools.integrations.trainers.guard import guard_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

BOI, EOI = 297, 298


def samples(seed: int = 0) -> list[dict]:
    """Samples with 1, 0, 2, 1 and 0 images (<boi>, 4 image tokens, <eoi>, within the text) of 6 to 24 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for images, words in ((1, 5), (0, 9), (2, 4), (1, 11), (0, 6)):
        ids = [2, *rng.integers(3, 290, words).tolist()]
        for _ in range(images):
            ids += [BOI, *[IMAGE] * 4, EOI, *rng.integers(3, 290, 3).tolist()]
        row = {"input_ids": ids}
        if images:
            row["pixel_values"] = rng.standard_normal((images, 3, 56, 56)).astype(np.float32).tolist()
        out.append(row)
    return out


def one_by_one(model, rows: list[dict], mean: bool = True) -> tuple[float, dict]:
    """Each sample alone, as its processor gives it (``token_type_ids`` 1 on the image tokens)."""
    model.zero_grad()
    total = sum(int((torch.tensor(s["input_ids"][1:]) != IMAGE).sum()) for s in rows)
    loss = 0.0
    for s in rows:
        ids = torch.tensor([s["input_ids"]])
        extra = {"token_type_ids": (ids == IMAGE).long()}
        if "pixel_values" in s:
            extra["pixel_values"] = torch.tensor(s["pixel_values"])
        labels = ids.masked_fill(ids == IMAGE, -100)
        if mean:
            out = model(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=total, **extra)
            part = out.loss
        else:
            logits = model(input_ids=ids, use_cache=False, **extra).logits[0, :-1]
            part = torch.nn.functional.cross_entropy(
                logits, labels[0, 1:], reduction="sum", ignore_index=-100
            )
        part.backward()
        loss += float(part.detach())
    return loss, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(model, before, ref_grads, step: bool) -> None:
    got = {k: (before[k] - p.detach()) if step else p.grad for k, p in model.named_parameters()}
    diffs = [float((got[k] - g).abs().max()) for k, g in ref_grads.items()]
    worst = max(ref_grads, key=lambda k: float((got[k] - ref_grads[k]).abs().max()))
    assert len(diffs) == len(ref_grads) and max(diffs) < 1e-5, (
        worst,
        max(diffs),
        float(ref_grads[worst].abs().max()),
    )
    tower = [k for k in ref_grads if "vision_tower" in k]
    assert tower and any(float(ref_grads[k].abs().max()) > 0 for k in tower)  # the vision tower learns


@pytest.mark.parametrize(
    "layers, impl, segmented, image_masks",
    [
        (("sliding_attention", "full_attention"), "sdpa", False, None),  # kept on sdpa: dense masks
        (("full_attention", "sliding_attention"), "sdpa", False, None),
        (("sliding_attention", "full_attention"), "packtools_sdpa", True, None),  # per-document masks
        # loaded on sdpa: prepare_trainer switches it to packtools_sdpa (main left it on sdpa, and refused a
        # per-document collator), which reads the collator's dense masks and its per-document ones alike
        (("sliding_attention", "full_attention"), "sdpa", True, None),
        (("full_attention", "sliding_attention"), "sdpa", True, "per_document"),
    ],
)
def test_trainer_step_equals_one_by_one(layers, impl, segmented, image_masks, tmp_path):
    from packtools.integrations.attention.backends import attention_implementation

    model = tiny_gemma3("sdpa", layers).train()
    if impl != "sdpa":
        from packtools.integrations.attention.segmented import register

        model.set_attn_implementation(register())
    rows = samples()
    reference = copy.deepcopy(model)
    # as the processor gives them: token_type_ids 1 on the image tokens (packed along, checked by the collator)
    marked = [dict(r, token_type_ids=[int(t == IMAGE) for t in r["input_ids"]]) for r in rows]
    packed = pack_dataset(datasets.Dataset.from_list(marked), 48)
    assert len(packed) < len(rows) and max(len(r["input_ids"]) for r in rows) > 4  # longer than the window
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=len(packed), max_steps=1, optim="sgd",
        **plain_sgd_options(),
    )  # fmt: skip
    collator = MultimodalCollator(model, 0, image_masks=image_masks)
    assert collator.image_masks == (image_masks or ("dense" if impl == "sdpa" else "per_document"))
    trainer = transformers.Trainer(model, args, train_dataset=packed, data_collator=collator)
    trainer = prepare_trainer(trainer, segmented_sdpa=segmented)
    assert attention_implementation(model) == ("packtools_sdpa" if segmented else "sdpa")
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    result = trainer.train()
    ref_loss, ref_grads = one_by_one(reference, rows)
    assert abs(result.training_loss - ref_loss) < 1e-5
    assert_same_grads(model, before, ref_grads, step=True)


def test_prepare_trainer_switch_is_undone(tmp_path):
    # the switch to packtools_sdpa is recorded: unprepare puts the whole model (vision tower too) back on sdpa
    from packtools.integrations import unprepare
    from packtools.integrations.attention.backends import attention_implementation

    model = tiny_gemma3("sdpa").train()
    packed = pack_dataset(datasets.Dataset.from_list(samples()), 48)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, **plain_sgd_options())
    collator = MultimodalCollator(model, 0, image_masks="per_document")
    trainer = prepare_trainer(transformers.Trainer(model, args, train_dataset=packed, data_collator=collator))
    assert attention_implementation(model) == "packtools_sdpa"
    assert model.config.vision_config._attn_implementation == "packtools_sdpa"
    unprepare(trainer)
    assert attention_implementation(model) == "sdpa"
    assert model.config.vision_config._attn_implementation == "sdpa"
    # a vision tower loaded on another backend keeps it: no switch (it would name one backend for both)
    from packtools.integrations.attention.backends import switches_to_segmented_sdpa

    assert switches_to_segmented_sdpa(model)
    model.config.vision_config._attn_implementation = "eager"
    assert not switches_to_segmented_sdpa(model)


@pytest.mark.parametrize("impl", ["sdpa", "packtools_sdpa"])
def test_guarded_loop_equals_one_by_one(impl):
    model = tiny_gemma3("sdpa").train()
    if impl != "sdpa":
        from packtools.integrations.attention.segmented import register

        model.set_attn_implementation(register())
    rows = samples()
    reference = copy.deepcopy(model)
    guard_model(model)
    row = {
        "input_ids": sum((s["input_ids"] for s in rows), []),
        "seq_lengths": [len(s["input_ids"]) for s in rows],
        "pixel_values": sum((s.get("pixel_values", []) for s in rows), []),
    }
    batch = MultimodalCollator(model, 0)([row])
    assert set(batch["attention_mask"]) == {"full_attention", "sliding_attention"}
    assert torch.equal(batch["token_type_ids"], (batch["input_ids"] == IMAGE).long())
    labels = batch.pop("labels")
    logits = model(**batch).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum", ignore_index=-100)
    loss.backward()
    ref_loss, ref_grads = one_by_one(reference, rows, mean=False)
    assert abs(float(loss.detach()) - ref_loss) < 1e-4 * max(1.0, abs(ref_loss))
    assert_same_grads(model, None, ref_grads, step=False)
    # the same batch without its ready-made masks (a collator of one's own): refused, never trained
    batch.pop("attention_mask")
    with pytest.raises(PackingError, match=r"without each document's masks ready-made.*MultimodalCollator"):
        model(**batch)


def test_masks_match_the_documents_alone():
    # the masks of a packed row are, block by block, those transformers builds for each document alone
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    model = tiny_gemma3("sdpa")
    rows = samples()
    row = {
        "input_ids": sum((s["input_ids"] for s in rows), []),
        "seq_lengths": [len(s["input_ids"]) for s in rows],
    }
    row["pixel_values"] = sum((s.get("pixel_values", []) for s in rows), [])
    masks = MultimodalCollator(model, 0)([row])["attention_mask"]
    at = 0
    for s in rows:
        ids = torch.tensor([s["input_ids"]])
        n = ids.shape[1]
        alone = create_masks_for_vision_model(
            config=model.config.get_text_config(), inputs_embeds=torch.zeros(1, n, 8), attention_mask=None,
            cache=None, position_ids=torch.arange(n)[None],
            block_sequence_ids=get_block_sequence_ids_for_mask((ids == IMAGE).long()),
        )  # fmt: skip
        for kind, mask in masks.items():
            assert torch.equal(mask[0, 0, at : at + n, at : at + n], alone[kind][0, 0]), kind
            assert not mask[0, 0, at : at + n, at + n :].any() and not mask[0, 0, at : at + n, :at].any()
        at += n


def test_eager_and_masks_of_ones_own_are_refused(tmp_path):
    model = tiny_gemma3("eager")
    spec = MropeSpec.from_config(model.config)
    assert (spec.flat, spec.image_tokens, spec.image_shape, spec.sliding_window) == (True, 4, (3, 56, 56), 4)
    rows = [{"input_ids": [1, 2, 3], "seq_lengths": [3]}]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    trainer = transformers.Trainer(
        model,
        args,
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=MultimodalCollator(model, 0),
    )
    with pytest.raises(
        PackingError, match=r"attn_implementation='eager'.*ready-made.*\['sdpa', 'packtools_sdpa'\]"
    ):
        prepare_trainer(trainer)
    # a guarded loop on eager: image inputs refused, with or without the masks
    guard_model(model)
    first, second = samples()[0], samples()[2]
    row = {
        "input_ids": first["input_ids"] + second["input_ids"],
        "seq_lengths": [len(first["input_ids"]), len(second["input_ids"])],
        "pixel_values": first["pixel_values"] + second["pixel_values"],
    }
    batch = MultimodalCollator(model, 0)([row])
    with pytest.raises(
        PackingError, match=r"with each document's masks ready-made, on attn_implementation='eager'"
    ):
        model(**batch)
    # text-only rows still pass (no image inputs)
    text = PaddingFreeCollator(0)([{"input_ids": [2, 5, 6, 7, 2, 8, 9], "seq_lengths": [4, 3]}])
    assert torch.isfinite(model(**text).loss)


def test_gemma3_spec_and_columns():
    model = tiny_gemma3("sdpa")
    collate = MultimodalCollator(model, 0)
    first = samples()[0]
    row = dict(first, seq_lengths=[len(first["input_ids"])])
    # the processor's token_type_ids column: checked against the image tokens (was refused as unknown)
    marks = [int(t == IMAGE) for t in first["input_ids"]]
    assert collate([dict(row, token_type_ids=marks)])["token_type_ids"][0].tolist() == marks
    wrong = marks[:1] + [1] + marks[2:]  # a text token marked as an image token
    with pytest.raises(PackingError, match="'token_type_ids' does not mark exactly the image tokens"):
        collate([dict(row, token_type_ids=wrong)])
    # other models do not take it (LLaVA's processor gives none): refused by name, as before
    from test_vision_llava import tiny_llava

    with pytest.raises(PackingError, match="token_type_ids"):
        MultimodalCollator(tiny_llava("sdpa"), 0)(
            [{"input_ids": [1, 2], "seq_lengths": [2], "token_type_ids": [0, 0]}]
        )
    # full-attention layers only: no sliding mask (the model reads none)
    full = tiny_gemma3("sdpa", ("full_attention", "full_attention"))
    assert MropeSpec.from_config(full.config).sliding_window is None
    assert set(MultimodalCollator(full, 0)([row])["attention_mask"]) == {"full_attention"}
    # what the spec cannot count, or a model whose text attends both ways: refused by name
    odd = copy.deepcopy(model.config)
    odd.mm_tokens_per_image = 3
    with pytest.raises(PackingError, match="mm_tokens_per_image 3 is not a square"):
        MropeSpec.from_config(odd)
    both = copy.deepcopy(model.config)
    both.text_config.use_bidirectional_attention = True
    with pytest.raises(PackingError, match="use_bidirectional_attention"):
        MropeSpec.from_config(both)


def test_sft_trainer_is_refused_by_name(tmp_path):
    # TRL's SFTTrainer counts a batch's tokens with inputs["attention_mask"].sum(): the ready-made masks (a dict)
    # stopped the first step with "'dict' object has no attribute 'sum'"; prepare_trainer says why and the fix
    trl = pytest.importorskip("trl")
    from _hf_models import word_tokenizer

    from packtools.integrations.trainers.sft import packed_sft_config

    model = tiny_gemma3("sdpa").train()
    packed = pack_dataset(datasets.Dataset.from_list(samples()), 48)
    args = packed_sft_config(
        output_dir=str(tmp_path),
        max_steps=1,
        bf16=False,
        max_length=None,
        padding_free=False,
        **plain_sgd_options(),
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=packed,
        processing_class=word_tokenizer(),
        data_collator=MultimodalCollator(model, 0),
    )
    with pytest.raises(
        PackingError, match=r"SFTTrainer counts the tokens.*attention_mask.*transformers.Trainer"
    ):
        prepare_trainer(trainer)


def test_non_padding_token_count_is_refused_by_name(tmp_path):
    # Trainer's include_num_input_tokens_seen="non_padding" sums inputs["attention_mask"]: the ready-made masks
    # (a dict) stopped the first step with an AttributeError; prepare_trainer says why and the fix
    model = tiny_gemma3("sdpa").train()
    packed = pack_dataset(datasets.Dataset.from_list(samples()), 48)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        include_num_input_tokens_seen="non_padding",
        **plain_sgd_options(),
    )
    trainer = transformers.Trainer(
        model, args, train_dataset=packed, data_collator=MultimodalCollator(model, 0)
    )
    with pytest.raises(PackingError, match=r"include_num_input_tokens_seen='non_padding'.*'all'"):
        prepare_trainer(trainer).train()


@pytest.mark.parametrize(
    "window, impl, pad, split",
    [
        (1, "sdpa", None, False),
        (64, "sdpa", None, False),
        (3, "sdpa", 16, True),
        (3, "packtools_sdpa", 16, True),
    ],
)
def test_edge_documents_equal_transformers_alone(window, impl, pad, split):
    # documents the Trainer test has not: two images back to back (one bidirectional block, as transformers makes
    # it alone), an image first or last in a document, a document that is one image, a document ending in an
    # image before one starting with an image; windows of 1 and longer than every document; padding at the end;
    # rows of different lengths given as several features (laid end to end); logits of a guarded forward
    model = tiny_gemma3("sdpa", window=window)
    if impl != "sdpa":
        from packtools.integrations.attention.segmented import register

        model.set_attn_implementation(register())
    guard_model(model)
    image, rng = [IMAGE] * 4, np.random.default_rng(3)

    def text(n):
        return rng.integers(3, 290, n).tolist()

    docs = [image + image + text(3), text(2) + [BOI, *image, *image], image + text(5) + image, text(7), image]
    pixels = [rng.standard_normal((d.count(IMAGE) // 4, 3, 56, 56)).astype(np.float32) for d in docs]
    groups = [[0, 1], [2], [3, 4]] if split else [[0, 1, 2, 3, 4]]
    rows = []
    for group in groups:
        rows.append(
            {
                "input_ids": sum((docs[i] for i in group), []),
                "seq_lengths": [len(docs[i]) for i in group],
                "pixel_values": np.concatenate([pixels[i] for i in group]),
            }
        )
    batch = MultimodalCollator(model, 0, pad_to_multiple_of=pad)(rows)
    assert batch["input_ids"].shape[0] == 1
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch).logits[0]
        at = 0
        for d, pix in zip(docs, pixels):
            ids = torch.tensor([d])
            extra = {"pixel_values": torch.tensor(pix)} if len(pix) else {}
            alone = model(
                input_ids=ids, token_type_ids=(ids == IMAGE).long(), use_cache=False, **extra
            ).logits[0]
            assert float((packed[at : at + len(d)] - alone).abs().max()) < 1e-5
            at += len(d)


def _packed_row(rows: list[dict]) -> dict:
    return {
        "input_ids": sum((s["input_ids"] for s in rows), []),
        "seq_lengths": [len(s["input_ids"]) for s in rows],
        "pixel_values": sum((s.get("pixel_values", []) for s in rows), []),
    }


def test_packtools_sdpa_batches_hold_no_row_sized_mask():
    # a model on packtools_sdpa gets each document's masks per document: T bytes per layer type, not the T² of
    # the dense [1, 1, T, T] masks (1 GiB each at 32,768 tokens; main built them whatever the backend)
    from packtools.batches.vision import DocumentBlockMask, image_block_masks
    from packtools.integrations.attention.segmented import register

    model = tiny_gemma3("sdpa")
    model.set_attn_implementation(register())
    batch = MultimodalCollator(model, 0, pad_to_multiple_of=16)([_packed_row(samples())])
    total = batch["input_ids"].shape[1]
    masks = batch["attention_mask"]
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert all(isinstance(m, DocumentBlockMask) for m in masks.values())
    held = sum(m.is_image.nbytes + 8 * len(m.bounds) for m in masks.values())
    assert held < total * total // 4
    # the same masks, exactly, as the dense form (checked block by block against transformers alone above)
    dense = image_block_masks(batch["position_ids"][0].numpy(), batch["token_type_ids"][0].numpy() == 1, 4)
    for kind, mask in masks.items():
        assert np.array_equal(mask.dense(), dense[kind]), kind
    assert MultimodalCollator(model, 0).image_masks == "per_document"
    assert MultimodalCollator(model, 0, image_masks="dense").replace().image_masks == "dense"
    assert (
        MultimodalCollator(tiny_gemma3("sdpa"), 0).image_masks == "dense"
    )  # sdpa reads only whole-row masks
    with pytest.raises(PackingError, match="image_masks must be one of"):
        MultimodalCollator(model, 0, image_masks="blocks")


@pytest.mark.parametrize("flash_kwargs", [True, False])
def test_per_document_masks_equal_one_by_one(flash_kwargs):
    # loss and every gradient of the packed row on packtools_sdpa with per-document masks equal the samples
    # alone; without cu_seq_lens in the batch the masks' own documents are used
    from packtools.integrations.attention.segmented import register

    model = tiny_gemma3("sdpa").train()
    model.set_attn_implementation(register())
    reference = copy.deepcopy(model)
    rows = samples()
    batch = MultimodalCollator(model, 0, return_flash_attn_kwargs=flash_kwargs)([_packed_row(rows)])
    assert ("cu_seq_lens_q" in batch) == flash_kwargs
    labels = batch.pop("labels")
    logits = model(**batch).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum", ignore_index=-100)
    loss.backward()
    ref_loss, ref_grads = one_by_one(reference, rows, mean=False)
    assert abs(float(loss.detach()) - ref_loss) < 1e-4 * max(1.0, abs(ref_loss))
    assert_same_grads(model, None, ref_grads, step=False)


def test_per_document_masks_elsewhere_are_refused(tmp_path):
    from packtools.integrations.attention.segmented import register

    rows = samples()
    # kept on sdpa (which reads whole-row tensors): prepare_trainer and the guard refuse, naming the fix
    model = tiny_gemma3("sdpa")
    collate = MultimodalCollator(model, 0, image_masks="per_document")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    trainer = transformers.Trainer(
        model, args, train_dataset=datasets.Dataset.from_list(rows), data_collator=collate
    )
    with pytest.raises(
        PackingError, match=r"image_masks='per_document'.*'packtools_sdpa'.*image_masks='dense'"
    ):
        prepare_trainer(trainer, segmented_sdpa=False)
    guard_model(model)
    batch = collate([_packed_row(rows)])
    with pytest.raises(PackingError, match=r"per document.*attn_implementation='sdpa'.*image_masks='dense'"):
        model(**batch)
    # unguarded, plain sdpa hands it to torch's kernel: a PackingError naming the fix (main: torch's TypeError
    # "argument 'attn_mask' must be Tensor, not DocumentBlockMask" from inside transformers)
    unguarded = tiny_gemma3("sdpa")
    with pytest.raises(
        PackingError, match=r"scaled_dot_product_attention.*'packtools_sdpa'.*image_masks='dense'"
    ):
        unguarded(**{k: v for k, v in batch.items() if k != "labels"})
    # a backend that indexes it as a tensor (eager) gets a PackingError, never another mask
    with pytest.raises(PackingError, match="reads masks as whole-row tensors"):
        batch["attention_mask"]["full_attention"][:, :, :, :3]
    # boundaries other than the masks' documents (a batch changed after collation): refused, not mixed
    segmented = tiny_gemma3("sdpa")
    segmented.set_attn_implementation(register())
    batch = MultimodalCollator(segmented, 0)([_packed_row(rows)])
    batch.pop("labels")
    cu = batch["cu_seq_lens_q"]
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.cat([cu[:1], cu[2:]])  # two documents as one
    with pytest.raises(PackingError, match="are not the documents of its per-document masks"):
        segmented(**batch)


def test_per_document_blocks_are_built_once_per_forward():
    # packtools_sdpa built each image document's block in every layer, and autograd kept each layer's copy for the
    # backward (torch's float form of it): one block per document and layer type now, shared by that type's
    # layers, and the logits and every gradient equal those with the dense masks
    from packtools.integrations.attention.segmented import register

    layers = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    model = tiny_gemma3("sdpa", layers).train()
    model.set_attn_implementation(register())
    dense_model = copy.deepcopy(model)
    rows = samples()
    batch = MultimodalCollator(model, 0)([_packed_row(rows)])
    masks = batch["attention_mask"]
    bounds = batch["cu_seq_lens_q"].tolist()
    blocks = sum(not plain for m in masks.values() for plain in m.plain_causal(bounds))
    assert blocks > 0
    held: dict[int, tuple] = {}

    def pack(t):
        if t.dim() == 4 and t.shape[:2] == (1, 1) and t.shape[-1] == t.shape[-2] > 1:
            held[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    labels = batch.pop("labels")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(**batch).logits
    assert len(held) == blocks, (len(held), blocks)  # main: one per document and layer (2 layers a type)
    dense_batch = MultimodalCollator(dense_model, 0, image_masks="dense")([_packed_row(rows)])
    dense_batch.pop("labels")
    dense_logits = dense_model(**dense_batch).logits
    assert float((logits - dense_logits).detach().abs().max()) < 1e-6
    for out in (logits, dense_logits):
        torch.nn.functional.cross_entropy(out[0, :-1], labels[0, 1:], ignore_index=-100).backward()
    dense_grads = dict(dense_model.named_parameters())
    compared = 0
    for name, p in model.named_parameters():
        assert (p.grad is None) == (dense_grads[name].grad is None), name
        if p.grad is not None:
            assert float((p.grad - dense_grads[name].grad).abs().max()) < 1e-6, name
            compared += 1
    assert compared > len(layers) * 4


def test_per_document_blocks_are_not_held_after_the_backward():
    # the shared blocks live as long as autograd needs them, not as long as the batch: Trainer keeps every batch
    # of an accumulation window (and the last one after it), so blocks kept on the mask were held through the
    # optimizer step, N windows' worth (main after 746353d: all still held by the mask)
    import gc
    import pickle
    import weakref

    from packtools.integrations.attention.segmented import register

    model = tiny_gemma3("sdpa", ("sliding_attention", "full_attention")).train()
    model.set_attn_implementation(register())
    batch = MultimodalCollator(model, 0)([_packed_row(samples())])
    labels = batch.pop("labels")
    saved: list = []

    def pack(t):
        if (
            t.dim() == 4
            and t.shape[:2] == (1, 1)
            and t.shape[-1] == t.shape[-2] > 1
            and t.is_floating_point()
        ):
            saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(**batch).logits
    assert saved and all(r() is not None for r in saved)  # held for the backward
    torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100).backward()
    del logits
    gc.collect()
    assert all(r() is None for r in saved), sum(r() is not None for r in saved)  # the batch is still alive
    with torch.no_grad():  # a later forward over the same batch builds them again
        again = model(**batch).logits
    assert torch.isfinite(again).all()
    copied = pickle.loads(pickle.dumps(batch["attention_mask"]))  # after a forward too
    assert copied["full_attention"].bounds == batch["attention_mask"]["full_attention"].bounds


@pytest.mark.parametrize(
    "impl, layers, window",
    [
        ("sdpa", ("sliding_attention", "full_attention"), 3),
        ("sdpa", ("full_attention", "sliding_attention"), 1),
        ("eager", ("sliding_attention", "full_attention"), 3),
        ("packtools_sdpa", ("sliding_attention", "full_attention"), 3),
    ],
)
def test_text_only_forward_with_zero_token_type_ids_equals_documents_alone(impl, layers, window):
    """A packed text-only row given Gemma 3's processor column token_type_ids (all zero: no image token) and no
    masks of its own was refused by the guard as 'image inputs' without ready-made masks. With no image token
    marked, transformers' packed masks have no image block to misplace: the logits equal each document run
    alone (sliding windows shorter than the documents), so it passes. A marked token, pixels, or ready-made masks
    on eager are still refused."""
    model = tiny_gemma3("eager" if impl == "eager" else "sdpa", layers=layers, window=window)
    if impl == "packtools_sdpa":
        from packtools.integrations.attention.segmented import register

        model.set_attn_implementation(register())
    guard_model(model)
    rng = np.random.default_rng(5)
    docs = [rng.integers(3, 290, n).tolist() for n in (6, 9, 1, 7)]
    batch = PaddingFreeCollator(0)([{"input_ids": sum(docs, []), "seq_lengths": [len(d) for d in docs]}])
    batch.pop("labels")
    zeros = torch.zeros_like(batch["input_ids"])
    with torch.no_grad():
        packed = model(**batch, token_type_ids=zeros).logits[0]
        at = 0
        for d in docs:
            ids = torch.tensor([d])
            alone = model(input_ids=ids, token_type_ids=torch.zeros_like(ids), use_cache=False).logits[0]
            assert float((packed[at : at + len(d)] - alone).abs().max()) < 1e-5
            at += len(d)
        marked = zeros.clone()
        marked[0, 8] = 1
        with pytest.raises(PackingError, match="got image inputs without each document's masks ready-made"):
            model(**batch, token_type_ids=marked)
        pixels = torch.zeros(1, 3, 56, 56)
        with pytest.raises(PackingError, match="got image inputs without each document's masks ready-made"):
            model(**batch, token_type_ids=zeros, pixel_values=pixels)


@pytest.mark.parametrize("impl", ["eager", "sdpa", "packtools_sdpa"])
def test_one_document_with_ready_made_masks(impl):
    # a batch of one document still carries MultimodalCollator's masks, which the backend reads as they are: on
    # eager the guard let it through (it checked packed batches only) and eager added the booleans to its scores
    # (logits 0.46 away from the sample alone, no error); per-document masks on eager stopped with a TypeError
    from packtools.integrations.attention.segmented import register

    model = tiny_gemma3("eager" if impl == "eager" else "sdpa")
    if impl == "packtools_sdpa":
        model.set_attn_implementation(register())
    first = samples()[0]
    row = _packed_row([first])
    ids = torch.tensor([first["input_ids"]])
    with torch.no_grad():
        alone = model(
            input_ids=ids, token_type_ids=(ids == IMAGE).long(), use_cache=False,
            pixel_values=torch.tensor(first["pixel_values"]),
        ).logits  # fmt: skip
    unguarded = copy.deepcopy(model)
    guard_model(model)
    for form in ("dense", "per_document"):
        batch = MultimodalCollator(model, 0, image_masks=form)([row])
        batch.pop("labels")
        if impl == "eager" or (impl, form) == ("sdpa", "per_document"):
            with pytest.raises(PackingError, match=r"masks (ready-made|per document).*attn_implementation="):
                model(**batch)
            continue
        with torch.no_grad():
            assert float((model(**batch).logits - alone).abs().max()) < 1e-5, form
    if impl == "eager":  # unguarded: the per-document mask itself refuses being added to the scores
        batch = MultimodalCollator(model, 0, image_masks="per_document")([row])
        batch.pop("labels")
        with pytest.raises(PackingError, match="reads masks as whole-row tensors"):
            unguarded(**batch)


@pytest.mark.parametrize("token_type_ids", ["zeros", None])
def test_image_tokens_without_pixels_are_refused(token_type_ids):
    """A packed Gemma 3 row whose input_ids hold image placeholder tokens (the config's image_token_id) with no
    pixel_values, given an all-zero token_type_ids (accepted since img49 as 'text only') or none, trained the
    placeholders as text with no error (the images' columns dropped, their tokens kept). Refused now by name; a
    row without placeholder tokens still passes."""
    from test_vision_refusals import gemma3_documents

    model = tiny_gemma3("sdpa")
    guard_model(model)
    docs, _ = gemma3_documents()
    batch = PaddingFreeCollator(0)(
        [{"input_ids": torch.cat(docs).tolist(), "seq_lengths": [len(d) for d in docs]}]
    )
    given = {} if token_type_ids is None else {"token_type_ids": torch.zeros_like(batch["input_ids"])}
    with pytest.raises(
        PackingError, match=rf"placeholder token {IMAGE} \(image_token_id; at index \(0, 5\).*no pixel"
    ):
        model(**batch, **given)
    text = [d[d != IMAGE] for d in docs]
    rows = PaddingFreeCollator(0)(
        [{"input_ids": torch.cat(text).tolist(), "seq_lengths": [len(d) for d in text]}]
    )
    given = {} if token_type_ids is None else {"token_type_ids": torch.zeros_like(rows["input_ids"])}
    assert torch.isfinite(model(**rows, **given).loss)


def test_isolation_probe_tokens_avoid_the_image_placeholder():
    """The isolation probe's random tokens held Gemma 3's image token for 17 of 200 seeds (tiny vocabulary): a text
    probe with placeholders and no pixels, which guard_model now refuses (test_image_tokens_without_pixels_are_
    refused), so the probe itself would fail. Its tokens skip the config's placeholder ids."""
    from packtools.integrations.attention.isolation import _probe_tokens

    model = tiny_gemma3("sdpa")
    tokens = np.concatenate([_probe_tokens(model, 24, np.random.default_rng(seed)) for seed in range(200)])
    assert IMAGE not in tokens and tokens.min() >= 0
