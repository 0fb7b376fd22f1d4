"""Shared helpers for the model-level tests: a tiny random Llama, packed data, the one-by-one reference."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 97
PAD = 0


def tiny_llama(impl: str = "sdpa", seed: int = 0):
    """A 2-layer Llama (hidden 64, grouped-query attention) with random fp32 weights."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        attn_implementation=impl,
    )
    return transformers.LlamaForCausalLM(config).float()


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


def model_matrix():
    """The compatibility-matrix script (benchmarks/model_matrix.py), loaded once as a module."""
    import importlib.util
    import sys
    from pathlib import Path

    if "model_matrix" not in sys.modules:
        script = Path(__file__).resolve().parents[1] / "benchmarks" / "model_matrix.py"
        spec = importlib.util.spec_from_file_location("model_matrix", script)
        module = importlib.util.module_from_spec(spec)
        sys.modules["model_matrix"] = module  # dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    return sys.modules["model_matrix"]


def tiny_arch(name: str, impl: str = "sdpa"):
    """A tiny random model of one architecture of the compatibility matrix."""
    matrix = model_matrix()
    return matrix.build(next(a for a in matrix.ARCHS if a.name == name), impl)
