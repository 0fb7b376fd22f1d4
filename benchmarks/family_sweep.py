"""Every causal-LM family of transformers that ``packtools.testing.FAMILIES`` does not list, trained packed as a
user would: exact, or refused by name before training -- never a silent leak.

Usage::

    python benchmarks/family_sweep.py                      # every family missing from FAMILIES, sdpa and eager
    python benchmarks/family_sweep.py jamba deepseek_v4 --backends eager

Each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose class is not in :data:`packtools.testing.FAMILIES`
is built tiny from its config class with random float32 weights: the sizes of :data:`packtools.testing.SMALL` and of
:data:`GENERIC` where the config takes them (head_dim 8, 4 experts, windows / chunks / top-k / compress rates of 4
to 16 tokens so they matter on short rows, no dropout), a sliding layer where the family has sliding and full
layers only, and :data:`EXTRA` where a family needs its own.  Eight documents of 3 to 31 tokens are packed into
rows of 64 by ``pack_dataset`` and trained two ways:

* ``trainer``: ``transformers.Trainer`` with ``PaddingFreeCollator``, ``prepare_trainer`` (its collator check and
  probe; ``sdpa`` becomes ``packtools_sdpa``), one SGD step at lr 1; the parameter change against the gradient of
  the documents run one by one (token-mean loss over the batch).
* ``loop``: a loop of one's own, ``run_mixers_per_document`` + ``guard_model`` (the probe at the first packed batch)
  on the backend as loaded; the summed token loss and its gradients against the documents one by one.

A cell is ``exact`` (within 1e-5, relative to the largest gradient when above 1), ``refused`` (``PackingError``
before the step), ``random`` (a family whose training step samples, :data:`STOCHASTIC`), ``skip`` (transformers cannot build it tiny, or lacks the backend; the reason), or ``LEAK``
(trained with no error, off by more: a silent leak; the script exits with status 1).  The documents are longer
than the probe's (5, 9, 3, 7 tokens), so a leak the probe cannot see on its short rows shows here.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import signal
import sys
import tempfile
import warnings
from typing import Any

from packtools.testing import FAMILIES, SMALL, Family

TOLERANCE = 1e-5
LENGTHS = (23, 5, 31, 12, 9, 17, 3, 26)
ROW = 64
#: Sizes set wherever a config class takes the name.
GENERIC: dict[str, Any] = dict(
    SMALL,
    **dict.fromkeys(("d_model", "n_embd", "n_embed", "embed_dim"), 32),
    **dict.fromkeys(("ffn_dim", "n_inner", "d_inner", "decoder_ffn_dim", "d_ff"), 64),
    **dict.fromkeys(("n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    **dict.fromkeys(("n_head", "n_heads", "num_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("n_positions", "n_ctx", "max_seq_len"), 128),
    **dict.fromkeys(("sliding_window", "attention_chunk_size", "window_size", "keep_window_size", "index_topk"), 4),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "top_k"), 2),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "moe_intermediate_size", "shared_expert_intermediate_size"), 16),
    **dict.fromkeys(("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), 8),
    **dict.fromkeys(("n_group", "topk_group", "first_k_dense_replace", "mamba_n_groups", "n_groups"), 1),
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8, chunk_size=8, state_size=8,
    ssm_state_size=8, mamba_d_conv=4, conv_kernel=4, expand=2, is_decoder=True, bos_token_id=1, eos_token_id=2,
    **dict.fromkeys(
        ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
         "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout"),
        0.0,
    ),
)  # fmt: skip
_MLA = {"num_key_value_heads": 4}  # multi-head latent attention: as many key/value heads as query heads
#: What a family needs beyond GENERIC (shapes its validators require; its own token-mixing layers in use).
EXTRA: dict[str, dict[str, Any]] = {
    **dict.fromkeys(
        ("axk1", "axk2", "deepseek_v2", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "longcat_flash", "minicpm3",
         "youtu"),
        _MLA,
    ),
    "codegen": {"rotary_dim": 4},
    "gptj": {"rotary_dim": 4},
    "dots1": {"n_shared_experts": 1},
    "dots3_note_text": {"num_key_value_heads": 4},
    "gpt_neo": {"attention_types": [[["local", "global"], 1]]},
    "mamba2": {"num_heads": 4, "head_dim": 16},
    "zaya": {"num_experts_per_tok": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0, "layer_types": ["sliding_attention", "full_attention"],
                     "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 101, "laurel_rank": 4},
    "gemma4_unified_text": {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 101,
                            "global_head_dim": 8},
    "modernbert-decoder": {"local_attention": 4, "global_attn_every_n_layers": 2},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "attention_window_size": 4},
    "zamba": {"layers_block_type": ["mamba", "hybrid"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "deepseek_v4": {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                    "layer_types": ["heavily_compressed_attention", "sliding_attention"],
                    "mlp_layer_types": ["moe", "moe"]},
}  # fmt: skip
#: Families whose mapped config is not the one their causal LM takes.
CONFIG = {"emu3": "Emu3TextConfig"}
#: Families whose training step is random by design: the packed step and the one-by-one reference draw differently.
STOCHASTIC = {
    "phimoe": "its sparsemixer router samples experts in training mode (exact with the sampling off)"
}
#: Multimodal wrappers too large to build tiny here in a minute (vision towers of default size).
SLOW = (
    "blt",
    "gemma3",
    "gemma4",
    "gemma4_unified",
    "gemma3n",
    "gemma4_unified_assistant",
    "mllama",
    "got_ocr2",
)


def missing_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal

    known = {f.model for f in FAMILIES}
    return [t for t, cls in causal.items() if (cls if isinstance(cls, str) else cls[0]) not in known]


def family(model_type: str) -> Family:
    """The tiny family of ``model_type`` (a :class:`packtools.testing.Family`, for ``tiny_model``)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal

    model = causal[model_type] if isinstance(causal[model_type], str) else causal[model_type][0]
    config = CONFIG.get(model_type, CONFIG_MAPPING_NAMES[model_type])
    config_cls = getattr(transformers, config)
    names = set(inspect.signature(config_cls.__init__).parameters) | set(
        getattr(config_cls, "attribute_map", {})
    )
    names |= set(getattr(config_cls, "__dataclass_fields__", {}))
    kwargs = {k: v for k, v in GENERIC.items() if k in names}
    kwargs.update(EXTRA.get(model_type, {}))
    if "layer_types" in names and "sliding_window" in names and "layer_types" not in kwargs:
        try:
            types = set(config_cls(**kwargs).layer_types or ())
        except Exception:  # noqa: BLE001 - the family's validators: keep its own layer types
            types = set()
        if types and types <= {"full_attention", "sliding_attention"}:
            kwargs["layer_types"] = ["sliding_attention", "full_attention"]
            if "use_sliding_window" in names:
                kwargs["use_sliding_window"] = True
    return Family(model_type, model, config, kwargs, model_type)


def _documents(vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(1)
    return [rng.integers(3, min(vocab, 101), n).tolist() for n in LENGTHS]


def _gap(got: list[Any], reference: list[Any]) -> float:
    pairs = [(a, b) for a, b in zip(got, reference) if a is not None and b is not None]
    scale = max(1.0, max(float(b.abs().max()) for _, b in pairs))
    return max(float((a - b).abs().max()) for a, b in pairs) / scale


def _one_by_one(model: Any, docs: list[list[int]], params: list[Any], mean: bool) -> list[Any]:
    """Gradients of the documents' summed token loss, run one at a time (divided by the tokens if ``mean``)."""
    import torch

    targets = sum(len(d) - 1 for d in docs)
    total: list[Any] = [None] * len(params)
    for doc in docs:
        ids = torch.tensor([doc])
        logits = model(input_ids=ids, use_cache=False).logits.float()[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum") / (
            targets if mean else 1
        )
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        total = [g if t is None else (t if g is None else t + g) for t, g in zip(total, grads)]
    return total


def trainer_cell(model_type: str, backend: str) -> tuple[str, str]:
    import datasets
    import transformers

    from packtools import PackingError, PaddingFreeCollator, pack_dataset, prepare_trainer
    from packtools.testing import tiny_model

    model = tiny_model(family(model_type), backend)
    docs = _documents(model.config.get_text_config().vocab_size)
    packed = pack_dataset(datasets.Dataset.from_list([{"input_ids": d} for d in docs]), ROW)
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
        try:
            prepare_trainer(trainer)
        except PackingError as err:
            return "refused", str(err).split("\n")[0]
        trainer.train()
    params = [p for p in start.parameters() if p.requires_grad]
    step = [
        a.detach() - b.detach() for a, b in zip(params, (p for p in model.parameters() if p.requires_grad))
    ]
    start.train()
    gap = _gap(step, _one_by_one(start, docs, params, mean=True))
    return ("exact" if gap <= TOLERANCE else "LEAK"), f"{gap:.1e}"


def loop_cell(model_type: str, backend: str) -> tuple[str, str]:
    import datasets
    import torch

    from packtools import PackingError, PaddingFreeCollator, pack_dataset
    from packtools.integrations.attention.backends import adapt_collator
    from packtools.integrations.attention.mixers import run_mixers_per_document
    from packtools.integrations.trainers.guard import guard_model
    from packtools.testing import tiny_model

    model = tiny_model(family(model_type), backend)
    docs = _documents(model.config.get_text_config().vocab_size)
    packed = pack_dataset(datasets.Dataset.from_list([{"input_ids": d} for d in docs]), ROW)
    try:
        run_mixers_per_document(model)
        guard_model(model)
        batch = dict(adapt_collator(PaddingFreeCollator(0), model)(list(packed)))
        labels = batch.pop("labels")
        model.train()
        logits = model(**batch).logits.float()
    except PackingError as err:
        return "refused", str(err).split("\n")[0]
    params = [p for p in model.parameters() if p.requires_grad]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )
    got = torch.autograd.grad(loss, params, allow_unused=True)
    gap = _gap(list(got), _one_by_one(model, docs, params, mean=False))
    return ("exact" if gap <= TOLERANCE else "LEAK"), f"{gap:.1e}"


def _timeout(*_: Any) -> None:
    raise TimeoutError("took over a minute")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "model_types", nargs="*", help="default: every causal-LM model type missing from FAMILIES"
    )
    parser.add_argument("--backends", nargs="*", default=["sdpa", "eager"])
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, _timeout)
    leaks = 0
    for model_type in args.model_types or [t for t in missing_families() if t not in SLOW]:
        for backend in args.backends:
            for way, cell in (("trainer", trainer_cell), ("loop", loop_cell)):
                signal.alarm(60)
                try:
                    status, detail = cell(model_type, backend)
                except Exception as err:  # noqa: BLE001 - transformers cannot build or run it tiny: say why
                    status, detail = (
                        "skip",
                        f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                    )
                finally:
                    signal.alarm(0)
                if status == "LEAK" and model_type in STOCHASTIC:
                    status, detail = "random", f"{detail}: {STOCHASTIC[model_type]}"
                leaks += status == "LEAK"
                print(f"{model_type:26s} {backend:6s} {way:8s} {status:8s} {detail[:150]}", flush=True)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
