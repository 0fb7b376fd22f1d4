"""Shared helpers for the model-level tests: a tiny random Llama, packed data, the one-by-one reference."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packtools.testing import tiny_model as tiny_arch  # noqa: E402, F401  (a family's tiny model, by name)

VOCAB = 97
PAD = 0


def tiny_config(impl: str | None = "sdpa", *, hidden_size: int = 64, **extra) -> dict:
    """The sizes of every tiny model of the tests: 2 layers, ``hidden_size`` (64) with an MLP twice as wide, 4
    heads over 2 key/value heads, vocabulary ``VOCAB`` and 256 positions unless ``extra`` says otherwise."""
    config = dict(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
    )
    if impl is not None:
        config["attn_implementation"] = impl
    return {**config, **extra}


def tiny_llama(impl: str = "sdpa", seed: int = 0):
    """A 2-layer Llama (hidden 64, grouped-query attention) with random fp32 weights."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny_config(impl))).float()


def sequences(n: int = 24, seed: int = 0, max_len: int = 20, masks: bool = True) -> list[dict]:
    """Random sequences (token ids 1..VOCAB-1); every third one has a completion mask over a prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, max_len + 1))
        row = {"input_ids": rng.integers(1, VOCAB, length).tolist()}
        if masks:
            prompt = int(rng.integers(0, length)) if i % 3 == 0 else 0
            row["completion_mask"] = [0] * prompt + [1] * (length - prompt)
        out.append(row)
    return out


def seq_labels(row: dict) -> list[int]:
    """Labels of one unpacked sequence: its tokens, -100 where the completion mask is 0."""
    mask = row.get("completion_mask", [1] * len(row["input_ids"]))
    return [t if m else -100 for t, m in zip(row["input_ids"], mask)]


def split_rows(features: list[dict]) -> list[dict]:
    """Cut packed rows back into their sequences with plain Python (independent of the collator)."""
    out = []
    for row in features:
        lengths = list(row.get("seq_lengths") or [len(row["input_ids"])])
        start = 0
        for n in lengths:
            seq = {"input_ids": list(row["input_ids"][start : start + n])}
            if "completion_mask" in row:
                seq["completion_mask"] = list(row["completion_mask"][start : start + n])
            out.append(seq)
            start += n
    return out


def predicted(seqs: list[dict]) -> int:
    """Tokens a causal LM predicts over these sequences (the first token of each is never a target)."""
    return sum(sum(1 for lab in seq_labels(s)[1:] if lab != -100) for s in seqs)


def one_by_one_backward(model, seqs: list[dict], num_items: int) -> float:
    """Run each sequence alone (batch 1, no padding), loss summed over tokens / ``num_items``; backward."""
    total = 0.0
    for s in seqs:
        ids = torch.tensor([s["input_ids"]])
        labels = torch.tensor([seq_labels(s)])
        out = model(input_ids=ids, labels=labels, use_cache=False, num_items_in_batch=num_items)
        out.loss.backward()
        total += out.loss.item()
    return total


def grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def params(model) -> dict:
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}


def plain_sgd_options(lr: float = 1.0) -> dict:
    """Trainer options of an exact comparison: lr ``lr`` constant, no clipping or weight decay, on the CPU,
    nothing saved, logged or shown."""
    return dict(
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )


def sgd_train_args(output_dir, lr: float, cls=None, **overrides):
    """``TrainingArguments`` (or ``cls``) of an exact SGD run: batch 2, accumulation 2, one epoch, lr ``lr``
    constant, no clipping or decay, no saving or logging, seed 0; ``overrides`` on top."""
    cls = cls or transformers.TrainingArguments
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=1,
        optim="sgd",
        seed=0,
        **plain_sgd_options(lr),
    )
    kwargs.update(overrides)
    return cls(**kwargs)


class FirstStep(transformers.TrainerCallback):
    """Keeps the parameter change of the first optimizer step."""

    def __init__(self, model):
        self.model = model
        self.before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
        self.delta = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.delta = {
                k: self.before[k] - p.detach() for k, p in self.model.named_parameters() if k in self.before
            }


class Recorder:
    """Wraps a collator and keeps the rows of every batch, in the order the trainer asked for them."""

    def __init__(self, inner):
        self.inner = inner
        self.batches: list[list[dict]] = []

    def __call__(self, features):
        from packtools.integrations.trainers.collator_check import in_check

        if not in_check():  # prepare_trainer's collator check and probe are not training batches
            self.batches.append([{k: list(v) for k, v in f.items()} for f in features])
        return self.inner(features)


def reference_training(model, batches: list[list[dict]], accumulation: int, lr: float) -> None:
    """SGD on the sequences of the recorded batches run one by one, token-weighted per accumulation window."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for start in range(0, len(batches), accumulation):
        seqs = [s for batch in batches[start : start + accumulation] for s in split_rows(batch)]
        one_by_one_backward(model, seqs, predicted(seqs))
        opt.step()
        opt.zero_grad()


def one_by_one_gap(
    model, start, batches: list[list[dict]], accumulation: int, lr: float
) -> tuple[float, float]:
    """How far the trained ``model`` is from ``start`` trained on the sequences of ``batches`` one by one
    (:func:`reference_training`), and from ``start`` itself (how far training moved it)."""
    reference = copy.deepcopy(start)
    reference_training(reference, batches, accumulation, lr)
    return max_diff(params(model), params(reference)), max_diff(params(model), params(start))


# The preference trainers' tests (test_dpo.py, test_kto.py, test_reward.py): word-level text, a tokenizer of it.
EOS = 1


def tiny_preference_model(family: str = "llama", impl: str = "sdpa", seed: int = 0, num_labels: int = 0):
    """A 2-layer Llama or Qwen3 (hidden 64, grouped-query attention, eos 1) with random fp32 weights.

    A causal LM, or with ``num_labels`` a sequence classifier with that many labels.
    """
    torch.manual_seed(seed)
    common = tiny_config(impl, eos_token_id=EOS, **({"num_labels": num_labels} if num_labels else {}))
    if family == "qwen3":
        cls = transformers.Qwen3ForSequenceClassification if num_labels else transformers.Qwen3ForCausalLM
        return cls(transformers.Qwen3Config(head_dim=16, **common)).float()
    cls = transformers.LlamaForSequenceClassification if num_labels else transformers.LlamaForCausalLM
    return cls(transformers.LlamaConfig(**common)).float()


def word_tokenizer(vocab_size: int = VOCAB):
    """A word-level tokenizer: ``w2`` .. ``w{vocab_size - 1}`` are tokens 2.., ``<pad>`` 0, ``<eos>`` 1."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def random_words(rng):
    """``words(k)``: k random word tokens of ``rng``, as text."""

    def words(k):
        return " ".join(f"w{t}" for t in rng.integers(2, VOCAB, k))

    return words


def text_pairs(n, seed=0, max_prompt=8, max_completion=14, margin=False):
    """Pairs with a shared prompt and skewed completion lengths, as text of word tokens (``margin``: one each)."""
    rng = np.random.default_rng(seed)
    words = random_words(rng)
    rows = []
    for _ in range(n):
        row = {
            "prompt": words(int(rng.integers(1, max_prompt + 1))),
            "chosen": " " + words(int(rng.integers(1, max_completion + 1))),
            "rejected": " " + words(int(rng.integers(1, max_completion + 1))),
        }
        if margin:
            row["margin"] = float(rng.uniform(-1.0, 2.0))
        rows.append(row)
    return rows


def lora_causal_config():
    """Rank-4 LoRA on q_proj and v_proj, no dropout."""
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def exact_step_args(tmp_path, **config) -> dict:
    """Trainer arguments of an exact comparison: fp32 on CPU, plain SGD at lr 1, no clipping, no logging."""
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        bf16=False,
        optim="sgd",
        seed=0,
        **plain_sgd_options(),
    )
    kwargs.update(config)
    return kwargs


def loss_metrics_grads(trainer, batch):
    """One micro-batch through a TRL trainer's own compute_loss: loss, the metrics it logged, gradients."""
    trainer.model.train()
    trainer.model.zero_grad()
    for values in trainer._metrics["train"].values():
        values.clear()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}, grads
