"""Every image-text-to-text model type of transformers, built tiny and packed as a user would: exact, refused by
name before training, or skipped with the reason -- never a silent leak.

Usage::

    python benchmarks/vision_sweep.py                 # every type of MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    python benchmarks/vision_sweep.py llava gemma3

Each ``model_type`` is built from its config class with the sizes of :data:`VISION` / :data:`TEXT` set wherever
its sub-configs already hold the name (1-2 vision layers, hidden 32, images of 28-32 pixels), random float32
weights, within :data:`BUILD_SECONDS`; a type that cannot be built so is built at its default size on the meta
device (no weights), which is enough for the refusals below.  Three user paths:

* ``trainer``: ``transformers.Trainer`` with ``PaddingFreeCollator`` and ``prepare_trainer`` (sdpa and eager);
  a type not refused trains one SGD step on packed text documents, compared with the documents one by one.
* ``collator``: ``MultimodalCollator(model, 0)``.
* ``loop``: ``guard_model(model)`` (a loop of one's own).

A cell is ``refused`` (``PackingError``, first line kept), ``exact``, ``LEAK`` (trained with no error, off by more
than 1e-5: exit status 1), or ``skip`` (the reason).
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import sys
import tempfile
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from family_sweep import _documents, _gap, _one_by_one  # noqa: E402

BUILD_SECONDS = 90
#: A tiny build above this is built on the meta device instead (two copies are trained: memory).
MAX_PARAMETERS = 20_000_000
TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, vocab_size=512, max_position_embeddings=512, num_layers=2, d_model=32, d_ff=64, num_heads=4,
    moe_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    shared_expert_intermediate_size=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
)  # fmt: skip
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, depth=2, num_attention_heads=2, num_heads=2,
    num_key_value_heads=2, head_dim=16, embed_dim=32, out_hidden_size=32, image_size=28, patch_size=14,
    projection_dim=32, num_layers=2,
)  # fmt: skip
SUBCONFIGS = ("text_config", "llm_config", "language_config", "decoder_config", "thinker_config")
VISIONS = (
    "vision_config",
    "vision_tower_config",
    "audio_config",
    "speech_config",
    "video_config",
    "encoder_config",
)


def _shrink(config: Any, sizes: dict[str, Any]) -> None:
    for key, value in sizes.items():
        if (
            key in config.__dict__
            and isinstance(config.__dict__[key], int)
            and not isinstance(config.__dict__[key], bool)
        ):
            setattr(config, key, value)


def build(model_type: str, backend: str) -> tuple[Any, str]:
    """The tiny model (or a meta one at default size, with the reason), ``attn_implementation=backend``."""
    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as names

    cls_name = names[model_type] if isinstance(names[model_type], str) else names[model_type][0]
    cls = getattr(transformers, cls_name)
    config = transformers.AutoConfig.for_model(model_type)
    for name in SUBCONFIGS:
        if getattr(config, name, None) is not None:
            _shrink(getattr(config, name), TEXT)
    for name in VISIONS:
        if getattr(config, name, None) is not None:
            _shrink(getattr(config, name), VISION)
    _shrink(config, TEXT if not any(getattr(config, n, None) is not None for n in SUBCONFIGS) else {})
    config._attn_implementation = backend
    for sub in SUBCONFIGS + VISIONS:
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = backend
    torch.manual_seed(0)
    try:  # within the type's alarm (main): a build that runs past it is built on the meta device
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(config).parameters())
        if size > MAX_PARAMETERS:
            raise ValueError(f"{size / 1e6:.0f}M parameters at the sizes set (sizes this sweep does not set)")
        return cls(config).float(), "tiny"
    except Exception as err:  # noqa: BLE001 - the reason is the cell
        reason = f"tiny build failed: {type(err).__name__}: {str(err).splitlines()[0][:100]}"
    config = transformers.AutoConfig.for_model(model_type)
    config._attn_implementation = backend
    with torch.device("meta"):
        return cls(config), reason


def _refused(fn: Any) -> str | None:
    from packtools import PackingError

    try:
        fn()
    except PackingError as err:
        return "refused: " + str(err).split("\n")[0][:110]
    return None


def trainer_cell(model: Any) -> str:
    import datasets
    import transformers

    from packtools import PaddingFreeCollator, pack_dataset, prepare_trainer

    docs = _documents(model.config.get_text_config().vocab_size)
    packed = pack_dataset(datasets.Dataset.from_list([{"input_ids": d} for d in docs]), 64)
    start = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=len(packed), max_steps=1, optim="sgd", learning_rate=1.0,
            lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to=[], use_cpu=True,
            save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=packed, data_collator=PaddingFreeCollator(0)
        )
        refused = _refused(lambda: prepare_trainer(trainer))
        if refused:
            return refused
        trainer.train()
    params = [p for p in start.parameters() if p.requires_grad]
    step = [
        a.detach() - b.detach() for a, b in zip(params, (p for p in model.parameters() if p.requires_grad))
    ]
    start.train()
    gap = _gap(step, _one_by_one(start, docs, params, mean=True))
    return ("exact" if gap <= 1e-5 else "LEAK") + f" {gap:.1e}"


def loop_cell(model: Any) -> str:
    """A loop of one's own: ``guard_model``, one packed text batch of ``PaddingFreeCollator``; the summed token
    loss's gradients against the documents one by one."""
    import torch

    from packtools import PaddingFreeCollator
    from packtools.integrations.trainers.guard import guard_model

    docs = _documents(model.config.get_text_config().vocab_size)[:4]
    start = copy.deepcopy(model)
    params = [p for p in start.parameters() if p.requires_grad]
    start.train()
    reference = _one_by_one(start, docs, params, mean=False)
    model.train()

    def run() -> Any:
        guard_model(model)
        batch = PaddingFreeCollator(0)([{"input_ids": sum(docs, []), "seq_lengths": [len(d) for d in docs]}])
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, labels[0, 1:], reduction="sum", ignore_index=-100)
        return torch.autograd.grad(
            loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True
        )

    grads: list[Any] = []
    refused = _refused(lambda: grads.extend(run()))
    if refused:
        return refused
    gap = _gap(list(grads), reference)
    return ("exact" if gap <= 1e-5 else "LEAK") + f" {gap:.1e}"


def _guarded(cell: Any, model: Any) -> str:
    try:
        return cell(model)
    except Exception as err:  # noqa: BLE001 - transformers could not run the tiny model: the reason
        return f"skip: {type(err).__name__}: {str(err).splitlines()[0][:100] if str(err) else ''}"


def sweep(model_type: str, backend: str) -> dict[str, str]:
    from packtools.batches import MultimodalCollator

    model, how = build(model_type, backend)
    cells = {"build": how}
    cells["collator"] = _refused(lambda: MultimodalCollator(model, 0)) or "accepted"
    if how == "tiny":
        fresh = copy.deepcopy(model)
        cells["loop"] = _guarded(loop_cell, model)
        cells["trainer"] = _guarded(trainer_cell, fresh)
    else:
        from packtools.integrations.multimodal.models import check_multimodal_model

        cells["trainer"] = "(meta) " + (_refused(lambda: check_multimodal_model(model, None)) or "accepted")
    return cells


def _timeout(*_: Any) -> None:
    raise TimeoutError(f"over {BUILD_SECONDS} s")


def main(argv: list[str] | None = None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as names

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("types", nargs="*")
    parser.add_argument(
        "--part", type=int, nargs=2, default=(0, 1), metavar=("K", "N"), help="every N-th type from K"
    )
    parser.add_argument("--backends", nargs="+", default=["sdpa", "eager"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    signal.signal(signal.SIGALRM, _timeout)
    leaks = 0
    for model_type in (args.types or list(names))[args.part[0] :: args.part[1]]:
        for backend in args.backends:
            signal.alarm(BUILD_SECONDS)
            try:
                cells = sweep(model_type, backend)
            except Exception as err:  # noqa: BLE001
                cells = {
                    "skip": f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
                }
            finally:
                signal.alarm(0)
            leaks += any(str(v).startswith("LEAK") for v in cells.values())
            print(
                f"{model_type:28} {backend:6} " + " | ".join(f"{k}={v}" for k, v in cells.items()), flush=True
            )
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
