"""The plain PyTorch DPO loop of docs/preference.md (benchmarks/dpo_loop.py) trains like the pairs computed one sequence at a
time, with the loss of each optimizer step the mean over all its pairs."""

import copy
import math

import numpy as np
import pytest
from _hf_models import Recorder, max_diff, params, tiny_llama, torch
from _scripts import script

from packtools.dpo import PreferenceCollator, pack_preference

datasets = pytest.importorskip("datasets")
F = torch.nn.functional
BETA, LR = 0.5, 0.1


def pairs(n, seed):
    rng = np.random.default_rng(seed)
    rows = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for _ in range(n):
        for key, hi in (("prompt_ids", 8), ("chosen_ids", 14), ("rejected_ids", 14)):
            rows[key].append(rng.integers(1, 97, int(rng.integers(1, hi + 1))).tolist())
    return datasets.Dataset.from_dict(rows)


def sequence_alone(model, row_ids, row_mask):
    """log p of one sequence's completion tokens, the sequence run alone (plain log_softmax)."""
    logits = model(input_ids=torch.tensor([row_ids]), use_cache=False).logits[0, :-1]
    picked = logits.log_softmax(-1).gather(-1, torch.tensor(row_ids[1:])[:, None])[:, 0]
    return (picked * torch.tensor(row_mask[1:], dtype=picked.dtype)).sum()


def reference_training(model, ref_model, batches, accumulation):
    """SGD on the recorded rows' pairs, each sequence run alone, loss = mean over the pairs of each window."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for start in range(0, len(batches), accumulation):
        window = [row for batch in batches[start : start + accumulation] for row in batch]
        terms = []
        for row in window:
            offset = 0
            seqs = []
            for n in row["seq_lengths"]:
                seqs.append(
                    (row["input_ids"][offset : offset + n], row["completion_mask"][offset : offset + n])
                )
                offset += n
            for (c_ids, c_mask), (r_ids, r_mask) in zip(seqs[0::2], seqs[1::2]):
                with torch.no_grad():
                    ref_margin = sequence_alone(ref_model, c_ids, c_mask) - sequence_alone(
                        ref_model, r_ids, r_mask
                    )
                margin = sequence_alone(model, c_ids, c_mask) - sequence_alone(model, r_ids, r_mask)
                terms.append(-F.logsigmoid(BETA * (margin - ref_margin)))
        torch.stack(terms).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("accumulation", [1, 3])
def test_loop_matches_pairs_one_sequence_at_a_time(accumulation):
    loop = script("dpo_loop")
    packed = pack_preference(pairs(12, seed=3), 48, shuffle=True, seed=1)
    recorder = Recorder(PreferenceCollator(0))
    loader = torch.utils.data.DataLoader(packed, batch_size=1, shuffle=True, collate_fn=recorder)
    model = tiny_llama("sdpa")
    start = copy.deepcopy(model)
    ref_model = tiny_llama("sdpa", seed=1).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = loop.train_dpo(model, ref_model, loader, optimizer, beta=BETA, accumulation_steps=accumulation)
    assert len(losses) == math.ceil(len(recorder.batches) / accumulation)
    sizes = {len(b[0]["seq_lengths"]) for b in recorder.batches}
    assert len(sizes) > 1  # micro-batches with different numbers of pairs
    reference = copy.deepcopy(start)
    reference_training(reference, ref_model, recorder.batches, accumulation)
    # Several SGD steps (lr 0.1) of float32 rounding: up to ~1.3e-5 on some CPUs. The per-micro-batch mean
    # (test_mean_per_micro_batch_is_caught) is off by ~1.8e-2.
    assert max_diff(params(model), params(reference)) < 1e-4
    assert max_diff(params(model), params(start)) > 1e-3


def test_mean_per_micro_batch_is_caught():
    """Negative control: each micro-batch averaged over its own pairs, then over the micro-batches (the
    weighting that flipped a peer's gradient), does not match the reference."""
    from packtools.dpo import sequence_logps

    packed = pack_preference(pairs(12, seed=3), 48, shuffle=True, seed=1)
    recorder = Recorder(PreferenceCollator(0))
    batches = list(torch.utils.data.DataLoader(packed, batch_size=1, collate_fn=recorder))[:3]
    assert len({(len(b["cu_seq_lens_q"]) - 1) // 2 for b in batches}) > 1
    model = tiny_llama("sdpa")
    start = copy.deepcopy(model)
    ref_model = tiny_llama("sdpa", seed=1).requires_grad_(False)
    for batch in batches:
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "cu_seq_lens_q", "max_length_q")}
        inputs.update(cu_seq_lens_k=batch["cu_seq_lens_k"], max_length_k=batch["max_length_k"])
        policy, _ = sequence_logps(
            model(**inputs, use_cache=False).logits, batch["labels"], batch["cu_seq_lens_q"]
        ).pairs()
        with torch.no_grad():
            ref_logits = ref_model(**inputs, use_cache=False).logits
            ref, _ = sequence_logps(ref_logits, batch["labels"], batch["cu_seq_lens_q"]).pairs()
        margins = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
        (-F.logsigmoid(BETA * margins).mean() / len(batches)).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    reference = copy.deepcopy(start)
    reference_training(reference, ref_model, recorder.batches[:3], 3)
    assert max_diff(params(model), params(reference)) > 1e-4
