"""Vision-language models trained packed through Trainer + prepare_trainer equal the samples run one by one.

Tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL from configs (sdpa and eager, CPU, fp32); samples with 0, 1 and 3 images
of different sizes and text-only ones.  The reference runs each sample alone through the model's own path (it
computes its positions itself from mm_token_type_ids and image_grid_thw).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _hf_models import plain_sgd_options
from _vl_models import (
    FAMILIES,
    IMAGE,
    MERGE,
    PATCH,
    TEMPORAL,
    VEND,
    VSTART,
    mixed_samples,
    tiny_vl,
    torch,
    transformers,
)

from packtools import PaddingFreeCollator, prepare_trainer
from packtools.batches.mrope import MropeSpec
from packtools.batches.vision import MultimodalCollator
from packtools.errors import PackingError
from packtools.integrations.attention.mixers import run_mixers_per_document
from packtools.integrations.multimodal.models import check_vision_isolation

datasets = pytest.importorskip("datasets")


def packed_rows(samples: list[dict]) -> list[dict]:
    """Samples 0-2 in one row, 3-4 in another; images in row order."""
    rows = []
    for part in (samples[:3], samples[3:]):
        row = {
            "input_ids": [t for s in part for t in s["input_ids"]],
            "seq_lengths": [len(s["input_ids"]) for s in part],
        }
        images = [s for s in part if "pixel_values" in s]
        if images:
            row["pixel_values"] = np.concatenate([s["pixel_values"] for s in images]).tolist()
            row["image_grid_thw"] = np.concatenate([s["image_grid_thw"] for s in images]).tolist()
        rows.append(row)
    return rows


def one_by_one(model, samples: list[dict]) -> tuple[float, dict]:
    """Token-weighted loss and gradients of the samples run alone (image tokens never learned; a sample with
    ``assistant_masks`` learns only where it is 1)."""

    def labels_of(s):
        ids = torch.tensor([s["input_ids"]])
        labels = ids.masked_fill(ids == IMAGE, -100)
        if "assistant_masks" in s:
            labels = labels.masked_fill(torch.tensor([s["assistant_masks"]]) == 0, -100)
        return ids, labels

    model.zero_grad()
    counts = []
    for s in samples:
        _, labels = labels_of(s)
        counts.append(int((labels[0, 1:] != -100).sum()))
    total = sum(counts)
    loss_sum = 0.0
    for s in samples:
        ids, labels = labels_of(s)
        extra = {}
        if "pixel_values" in s:
            extra = dict(
                pixel_values=torch.tensor(s["pixel_values"]),
                image_grid_thw=torch.tensor(s["image_grid_thw"]),
                mm_token_type_ids=(ids == IMAGE).int(),
            )
        out = model(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=total, **extra)
        out.loss.backward()
        loss_sum += float(out.loss.detach())
    return loss_sum, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def trainer_for(model, rows, tmp_path, collator=None, **overrides):
    args = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=len(rows),
        max_steps=1,
        optim="sgd",
        **plain_sgd_options(),
    )
    args.update(overrides)
    return transformers.Trainer(
        model,
        transformers.TrainingArguments(**args),
        train_dataset=datasets.Dataset.from_list(rows),
        data_collator=collator if collator is not None else MultimodalCollator(model, 0),
    )


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_training_step_equals_one_by_one(family, impl, tmp_path):
    samples = mixed_samples(3)
    model = tiny_vl(family, impl)
    reference = copy.deepcopy(model)
    trainer = prepare_trainer(trainer_for(model, packed_rows(samples), tmp_path))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    result = trainer.train()
    ref_loss, ref_grads = one_by_one(reference, samples)
    assert abs(result.training_loss - ref_loss) < 1e-5
    # SGD with lr 1, no clipping, no decay: the step is minus the gradient.
    diffs = [
        float((before[k] - p.detach() - ref_grads[k]).abs().max())
        for k, p in model.named_parameters()
        if k in ref_grads
    ]
    assert len(diffs) == len(ref_grads) and max(diffs) < 1e-5
    visual = [k for k in ref_grads if ".visual." in k]
    assert visual and all(float(ref_grads[k].abs().max()) > 0 for k in visual[:3])  # the vision tower learns


def _loss(model, batch) -> float:
    with torch.no_grad():
        return float(model(**batch).loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_controls_2d_or_whole_row_positions_change_the_loss(family):
    model = tiny_vl(family, "sdpa").eval()
    run_mixers_per_document(model)  # Qwen3.5's gated DeltaNet layers, per document (no change to the others)
    samples = mixed_samples(3)
    batch = MultimodalCollator(model, 0)(packed_rows(samples))
    right = _loss(model, batch)
    ref, _ = one_by_one(copy.deepcopy(model), samples)
    assert abs(right - ref) < 1e-5
    ids = batch["input_ids"]
    whole, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == IMAGE).int(), image_grid_thw=batch["image_grid_thw"]
    )
    wrong = {
        "2-D per-document positions": {**batch, "position_ids": batch["position_ids"][0]},
        "3-D positions over the whole row": {**batch, "position_ids": whole},
        "the model's own positions (over the whole row)": {
            k: v for k, v in batch.items() if k != "position_ids"
        },
        "per-document t/h/w without the text row": {**batch, "position_ids": batch["position_ids"][1:]},
    }
    for name, bad in wrong.items():
        assert abs(_loss(model, bad) - right) > 1e-4, name
    # Whole-row t/h/w beside the per-document text row shift each document's three rows by one constant, which
    # rotary embeddings cancel: the same loss. What separates documents is the text row.
    shifted = {**batch, "position_ids": torch.cat([batch["position_ids"][:1], whole])}
    assert not torch.equal(shifted["position_ids"], batch["position_ids"])
    assert abs(_loss(model, shifted) - right) < 1e-5


def test_text_only_rows_of_qwen2_vl_need_the_text_row():
    """Why prepare_trainer wants MultimodalCollator even for text-only rows: Qwen2-VL expands 2-D position_ids to
    3 rows with no text row, so transformers builds no per-document mask and packed documents see each other."""
    model = tiny_vl("qwen2_vl", "sdpa").eval()
    samples = [s for s in mixed_samples(8) if "pixel_values" not in s] + [
        {"input_ids": list(range(3, 20))},
        {"input_ids": list(range(30, 41))},
    ]
    rows = [
        {
            "input_ids": [t for s in samples for t in s["input_ids"]],
            "seq_lengths": [len(s["input_ids"]) for s in samples],
        }
    ]
    ref, _ = one_by_one(copy.deepcopy(model), samples)
    right = MultimodalCollator(model, 0)(rows)
    assert abs(_loss(model, right) - ref) < 1e-5
    text = PaddingFreeCollator(0)(rows)
    assert text["position_ids"].shape == (1, right["input_ids"].shape[1])
    assert abs(_loss(model, text) - ref) > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_runs_through_the_vision_tower_and_catches_a_leak(family):
    model = tiny_vl(family, "eager")
    run_mixers_per_document(model)
    report = check_vision_isolation(model, MultimodalCollator(model, 0))
    assert not report.leaks and report.perturb_diff == 0.0 and "pixel_values" in report.keys

    class WholeRow(MultimodalCollator):  # 2-D positions: image tokens get text positions
        def __call__(self, features):
            batch = super().__call__(features)
            batch["position_ids"] = batch["position_ids"][0]
            return batch

    with pytest.raises(PackingError, match="does not keep packed multimodal samples apart"):
        check_vision_isolation(model, WholeRow(model, 0))


def test_refusals_by_name(tmp_path):
    model = tiny_vl("qwen2_5_vl")
    rows = packed_rows(mixed_samples(3))
    with pytest.raises(PackingError, match="MultimodalCollator"):
        prepare_trainer(trainer_for(model, rows, tmp_path, collator=PaddingFreeCollator(0)))
    other = MultimodalCollator(MropeSpec("qwen2_5_vl", IMAGE, None, 4), 0)
    with pytest.raises(PackingError, match="built for"):
        prepare_trainer(trainer_for(model, rows, tmp_path, collator=other))
    with pytest.raises(PackingError, match="context_parallel=2 with a vision-language model"):
        prepare_trainer(trainer_for(model, rows, tmp_path), context_parallel=2)
    # Llava (verified: 1-D positions, tests/test_vision_llava.py) with another collator, and an unverified
    # vision-language model (Mistral 3: Pixtral's images of any size) of the same tiny sizes
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    text = transformers.LlamaConfig(vocab_size=64, **sizes)
    vision = transformers.CLIPVisionConfig(image_size=8, patch_size=4, **sizes)
    llava = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=60)
    )
    rows = [{"input_ids": [1, 2, 3], "seq_lengths": [3]}]
    with pytest.raises(
        PackingError, match="LlavaForConditionalGeneration is a vision-language model.*MultimodalCollator"
    ):
        prepare_trainer(trainer_for(llava, rows, tmp_path, collator=PaddingFreeCollator(0)))
    mistral3 = transformers.Mistral3ForConditionalGeneration(
        transformers.Mistral3Config(
            text_config=transformers.MistralConfig(vocab_size=64, head_dim=16, **sizes),
            vision_config=transformers.PixtralVisionConfig(image_size=8, patch_size=4, head_dim=16, **sizes),
            image_token_index=60,
        )
    )
    with pytest.raises(PackingError, match="'mistral3'.*not verified"):
        prepare_trainer(trainer_for(mistral3, rows, tmp_path, collator=PaddingFreeCollator(0)))


def test_a_users_wrapper_around_the_multimodal_collator(tmp_path):
    """A wrapper of one's own (here: recording each batch) is opaque to packtools: refused with the way to show
    what it wraps, and with the MultimodalCollator as its ``.collator`` it trains exactly as the collator alone."""
    samples = mixed_samples(3)
    model = tiny_vl("qwen2_5_vl")
    reference = copy.deepcopy(model)
    inner = MultimodalCollator(model, 0)
    seen = []

    def recording(features):
        seen.append(len(features))
        return inner(features)

    with pytest.raises(PackingError, match="wraps one of your own.*`.collator` attribute"):
        prepare_trainer(trainer_for(model, packed_rows(samples), tmp_path, collator=recording))

    class Recording:
        def __init__(self, collator):
            self.collator = collator

        def __call__(self, features):
            return recording(features)

    trainer = prepare_trainer(trainer_for(model, packed_rows(samples), tmp_path, collator=Recording(inner)))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    result = trainer.train()
    ref_loss, ref_grads = one_by_one(reference, samples)
    assert seen and abs(result.training_loss - ref_loss) < 1e-5
    params = dict(model.named_parameters())
    diffs = [float((before[k] - params[k].detach() - g).abs().max()) for k, g in ref_grads.items()]
    assert len(diffs) > 10
    assert max(diffs) < 1e-5
    # packtools' own collator needs no hint
    with pytest.raises(PackingError, match="MultimodalCollator") as refused:
        prepare_trainer(trainer_for(model, packed_rows(samples), tmp_path, collator=PaddingFreeCollator(0)))
    assert "wraps one of your own" not in str(refused.value)


def _dataset(samples: list[dict]):
    return datasets.Dataset.from_list(
        [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in s.items()} for s in samples]
    )


def test_pack_dataset_places_samples_whole_with_their_images_in_row_order():
    from packtools import pack_dataset

    samples = mixed_samples(4) + mixed_samples(5)
    samples = [
        {
            **s,
            "pixel_values": s.get("pixel_values", np.zeros((0, 24), np.float32)),
            "image_grid_thw": s.get("image_grid_thw", np.zeros((0, 3), np.int64)),
        }
        for s in samples
    ]
    ds = _dataset(samples).shuffle(seed=3)  # a row mapping (indices) in front of the table
    order = [int(i) for i in ds._indices.column(0).to_pylist()]
    packed = pack_dataset(ds, 64)
    seen = []
    for row in packed:
        start, patch, image = 0, 0, 0
        for n in row["seq_lengths"]:
            ids = row["input_ids"][start : start + n]
            src = next(i for i in order if samples[i]["input_ids"] == ids and i not in seen)
            seen.append(src)
            grid = samples[src]["image_grid_thw"]
            patches = samples[src]["pixel_values"]
            assert np.array_equal(
                np.asarray(row["image_grid_thw"][image : image + len(grid)]).reshape(-1, 3), grid
            )
            assert np.allclose(
                np.asarray(row["pixel_values"][patch : patch + len(patches)]).reshape(-1, 24), patches
            )
            start, patch, image = start + n, patch + len(patches), image + len(grid)
        assert patch == len(row["pixel_values"]) and image == len(row["image_grid_thw"])
    assert sorted(seen) == list(range(len(samples)))
    model = tiny_vl("qwen2_vl")
    batch = MultimodalCollator(model, 0)(list(packed))  # the packed rows collate (images checked per row)
    assert batch["image_grid_thw"].shape[0] == sum(len(s["image_grid_thw"]) for s in samples)
    assert max(len(r["seq_lengths"]) for r in packed) > 1
    ref, _ = one_by_one(
        copy.deepcopy(model),
        [{k: v for k, v in s.items() if len(s["image_grid_thw"]) or k == "input_ids"} for s in samples],
    )
    assert abs(_loss(model, batch) - ref) < 1e-5
    for strategy in ("bfd_split", "wrapped"):
        with pytest.raises(PackingError, match="bfd"):
            pack_dataset(ds, 64, strategy)
    with pytest.raises(
        PackingError, match=r"^sample \d+ has \d+ tokens .* > max_length=20 .*never truncated"
    ):
        pack_dataset(ds, 20)
    with pytest.raises(PackingError, match="lose their images"):
        pack_dataset(ds, 64, columns=["input_ids"])
    broken = _dataset([{**samples[0], "image_grid_thw": [[1, 2, 2]]}])
    with pytest.raises(PackingError, match="patches"):
        pack_dataset(broken, 64)
    with pytest.raises(PackingError, match="IterableDataset"):
        pack_dataset(_dataset(samples).to_iterable_dataset(), 64)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_padding_and_token_budget_batches_stay_exact(family, tmp_path):
    samples = mixed_samples(6)
    model = tiny_vl(family, "sdpa")
    rows = packed_rows(samples)
    batch = MultimodalCollator(model, 0, pad_to_multiple_of=16)(rows)
    width = batch["input_ids"].shape[1]
    assert width % 16 == 0 and batch["position_ids"].shape == (4, 1, width)
    pad = int(batch["cu_seq_lens_q"][-1] - batch["cu_seq_lens_q"][-2])
    assert torch.equal(batch["position_ids"][:, 0, width - pad :], torch.arange(pad).expand(4, pad))
    ref, _ = one_by_one(copy.deepcopy(model), samples)
    assert abs(_loss(model.eval(), batch) - ref) < 1e-5
    # prepare_trainer(max_tokens=...): token-budget batches of packed multimodal rows, one step, exact
    model.train()
    reference = copy.deepcopy(model)
    trainer = prepare_trainer(trainer_for(model, rows, tmp_path), max_tokens=200)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    trainer.train()
    _, grads = one_by_one(reference, samples)
    assert (
        max(float((before[k] - p.detach() - grads[k]).abs().max()) for k, p in model.named_parameters())
        < 1e-5
    )


def test_dpo_refuses_a_vision_language_model(monkeypatch):
    """Verified for SFT packing only: the padding-free DPO forwards carry no pixels and no 3-D positions."""
    from types import SimpleNamespace

    from packtools.integrations.preference import dpo as trl

    for checked_before in ("_check_trainer", "check_loss_path", "check_step_methods"):  # a real DPOTrainer's
        monkeypatch.setattr(trl, checked_before, lambda trainer, *caller: None)
    # TrainingArguments as a real DPOTrainer has them (NEFTune off: prepare_dpo_trainer reads it first)
    args = SimpleNamespace(neftune_noise_alpha=None)
    trainer = SimpleNamespace(model=tiny_vl("qwen2_vl"), ref_model=None, args=args)
    with pytest.raises(PackingError, match="multimodal model: packtools' padding-free DPO"):
        trl.prepare_dpo_trainer(trainer, check_isolation=False, segmented_sdpa=False, share_prompt=False)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_per_document_mixers_keep_a_sample_with_images_whole(family):
    """A sample run through Qwen3.5's own path (no position_ids: the model computes its (3, B, T) temporal /
    height / width rows, no text row) is one document.  The per-document mixers read documents from the first
    row, the temporal one, which stays put over an image: they cut the sample at every image token and ran the
    gated DeltaNet on the pieces, 2e-2 in the logits with no error (the isolation probe's reference, and any
    unpacked forward with images on a prepared model). Now only a return to (0, 0, 0) starts a document."""
    model = tiny_vl(family, "sdpa").eval()
    sample = mixed_samples(3)[2]  # three images of different sizes
    ids = torch.tensor([sample["input_ids"]])
    inputs = dict(
        input_ids=ids,
        pixel_values=torch.tensor(sample["pixel_values"]),
        image_grid_thw=torch.tensor(sample["image_grid_thw"]),
        mm_token_type_ids=(ids == IMAGE).int(),
        use_cache=False,
    )
    with torch.no_grad():
        plain = model(**inputs).logits
        run_mixers_per_document(model)
        assert float((model(**inputs).logits - plain).abs().max()) < 1e-6


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_guarded_own_loop_equals_one_by_one(family):
    """A loop of one's own: run_mixers_per_document (Qwen3.5's gated DeltaNet; nothing on Qwen3-VL), guard_model,
    MultimodalCollator's batch with the token count of the whole batch: loss and every gradient as one by one."""
    from packtools.integrations.trainers.guard import guard_model

    samples = mixed_samples(3)
    model = tiny_vl(family, "sdpa")
    reference = copy.deepcopy(model)
    run_mixers_per_document(model)
    guard_model(model)
    batch = MultimodalCollator(model, 0)(packed_rows(samples))
    count = int((batch["labels"][..., 1:] != -100).sum())
    out = model(**batch, num_items_in_batch=count)
    out.loss.backward()
    ref_loss, ref_grads = one_by_one(reference, samples)
    assert abs(float(out.loss.detach()) - ref_loss) < 1e-5
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads)
    assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads) < 1e-5


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_with_gradient_checkpointing_equals_one_by_one(family, tmp_path):
    """Checkpointed decoder layers run Qwen3.5's per-document DeltaNet layers again in backward: still exact."""
    samples = mixed_samples(3)
    model = tiny_vl(family, "sdpa")
    reference = copy.deepcopy(model)
    trainer = prepare_trainer(trainer_for(model, packed_rows(samples), tmp_path, gradient_checkpointing=True))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    result = trainer.train()
    ref_loss, ref_grads = one_by_one(reference, samples)
    assert abs(result.training_loss - ref_loss) < 1e-5
    diffs = [float((before[k] - p.detach() - ref_grads[k]).abs().max()) for k, p in model.named_parameters()]
    assert max(diffs) < 1e-5


def test_per_document_mixers_leave_an_embeds_forward_after_images_whole():
    """A forward given inputs_embeds alone after one with images: Qwen3.5 positions it arange + rope_deltas (3 rows,
    the deltas negative, so they count up through 0). The per-document DeltaNet layers cut the row at that 0 while
    attention ran it whole: 2e-2 in the logits against the unprepared model, no error."""
    model = tiny_vl("qwen3_5", "sdpa").eval()
    plain = copy.deepcopy(model)
    run_mixers_per_document(model)
    sample = mixed_samples(3)[2]
    ids = torch.tensor([sample["input_ids"]])
    images = dict(
        input_ids=ids,
        pixel_values=torch.tensor(sample["pixel_values"]),
        image_grid_thw=torch.tensor(sample["image_grid_thw"]),
        mm_token_type_ids=(ids == IMAGE).int(),
        use_cache=False,
    )
    text = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = []
        for m in (model, plain):
            m(**images)  # leaves the model's rope_deltas negative
            assert int(m.model.rope_deltas.min()) < 0
            logits.append(m(inputs_embeds=m.get_input_embeddings()(text), use_cache=False).logits)
    assert float((logits[0] - logits[1]).abs().max()) < 1e-6


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_documents_that_start_or_end_with_an_image_stay_whole(family):
    """Documents whose first token is an image token (t/h/w all 0 at the start), one of an image alone, and
    documents of 0, 1 and 2 images in one packed row: loss and every gradient as one by one (the per-document
    DeltaNet layers cut the row exactly at the documents)."""
    from packtools.integrations.trainers.guard import guard_model

    rng = np.random.default_rng(5)

    def sample(ids, grids):
        row = {"input_ids": [int(i) for i in ids]}
        if grids:
            width = 3 * TEMPORAL * PATCH * PATCH
            row["pixel_values"] = rng.standard_normal((sum(t * h * w for t, h, w in grids), width)).astype(
                np.float32
            )
            row["image_grid_thw"] = np.asarray(grids, np.int64)
        return row

    def image(t, h, w):
        return [IMAGE] * (t * h * w // (MERGE * MERGE))

    samples = [
        sample([*image(1, 4, 4), 5, 6, 7], [(1, 4, 4)]),  # an image first
        sample([20, 21, 22], []),
        sample(image(1, 2, 4), [(1, 2, 4)]),  # an image alone
        sample([VSTART, *image(1, 2, 2), VEND], [(1, 2, 2)]),
        sample(
            [36, VSTART, *image(1, 4, 2), VEND, 37, VSTART, *image(1, 2, 2), VEND, 38], [(1, 4, 2), (1, 2, 2)]
        ),
    ]
    row = {
        "input_ids": [t for s in samples for t in s["input_ids"]],
        "seq_lengths": [len(s["input_ids"]) for s in samples],
    }
    with_images = [s for s in samples if "pixel_values" in s]
    row["pixel_values"] = np.concatenate([s["pixel_values"] for s in with_images]).tolist()
    row["image_grid_thw"] = np.concatenate([s["image_grid_thw"] for s in with_images]).tolist()
    model = tiny_vl(family, "sdpa")
    reference = copy.deepcopy(model)
    run_mixers_per_document(model)
    guard_model(model)
    batch = MultimodalCollator(model, 0)([row])
    count = int((batch["labels"][..., 1:] != -100).sum())
    out = model(**batch, num_items_in_batch=count)
    out.loss.backward()
    ref_loss, ref_grads = one_by_one(reference, samples)
    assert abs(float(out.loss.detach()) - ref_loss) < 1e-5
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads)
    assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads) < 1e-5
