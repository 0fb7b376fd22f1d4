"""Prompt-shared packing: pairs ``[P][C][R]`` and groups ``[P][C_1]...[C_G]``, the prompt once, exact.

The packer is checked against the input (every token once, prompts written once, rows within max_length);
the tree attention against each prompt + completion run alone (with negative controls: a completion that
sees its sibling, a position off by one, a key gather off by one); TRL's DPO on prompt-shared rows against
TRL's padded DPO on the same pairs (loss, metrics, gradients within 1e-5); a policy-gradient loss on groups
against each prompt + completion alone; and the refusal of each model kind the tree cannot serve.
"""

import os
import re
import sys
import warnings

import numpy as np
import pyarrow as pa
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _hf_models import tiny_arch, tiny_llama  # noqa: E402

from packtools import PackingError  # noqa: E402
from packtools.batches.tree import TREE_KEY, TreeLayout, tree_row, unshared_index  # noqa: E402
from packtools.core.pairs import UnitOptions, pack_pairs  # noqa: E402
from packtools.dpo import TreeCollator, pack_groups, pack_preference, sequence_logps  # noqa: E402
from packtools.integrations.attention.tree import (  # noqa: E402
    check_tree_model,
    tree_attention_forward,
    use_tree_attention,
)
from packtools.integrations.data.drops import TokensDroppedWarning  # noqa: E402

TOL = 1e-5
VOCAB = 97


def random_pairs(n, seed=0, max_prompt=12, max_completion=8):
    rng = np.random.default_rng(seed)

    def toks(lo, hi):
        return rng.integers(2, VOCAB, int(rng.integers(lo, hi + 1))).tolist()

    return pa.table(
        {
            "prompt_ids": [toks(1, max_prompt) for _ in range(n)],
            "chosen_ids": [toks(1, max_completion) for _ in range(n)],
            "rejected_ids": [toks(1, max_completion) for _ in range(n)],
            "pair": list(range(n)),
        }
    )


def sequences_of(rows):
    """Every (pair or group index, completion) -> its prompt + completion, read back from the packed rows."""
    out = []
    for i, row in enumerate(rows):
        ids, mask, seg, branch = tree_row(row, i)
        index, lengths = unshared_index(seg, branch)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for s, n in zip(starts, lengths):
            out.append((ids[index[s : s + n]].tolist(), mask[index[s : s + n]].tolist()))
    return out


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), max_length=st.integers(12, 48), seed=st.integers(0, 10_000))
def test_packer_every_token_once_prompt_once_rows_fit(n, max_length, seed):
    table = random_pairs(n, seed, max_prompt=10, max_completion=6)
    rows, report = pack_pairs(
        table, max_length, columns=["pair"], options=UnitOptions("drop"), share_prompt=True
    )
    d = rows.to_pylist()
    assert all(len(r["input_ids"]) <= max_length for r in d)
    kept = [p for r in d for p in r["pair"]]
    assert len(kept) == len(set(kept)) == report.units_out  # each pair once
    prompts, chosen, rejected = (
        table.column(c).to_pylist() for c in ("prompt_ids", "chosen_ids", "rejected_ids")
    )
    # The row holds P + C + R + 1 tokens per pair: the prompt once (its last token heads both completions).
    assert sum(len(r["input_ids"]) for r in d) == sum(
        len(prompts[p]) + len(chosen[p]) + len(rejected[p]) + 1 for p in kept
    )
    seqs = sequences_of(d)
    want = []
    for p in kept:
        for comp in (chosen[p], rejected[p]):
            want.append((prompts[p] + comp, [0] * len(prompts[p]) + [1] * len(comp)))
    assert seqs == want  # every token of every kept pair, in order, nothing else
    fits = [p for p in range(n) if len(prompts[p]) + len(chosen[p]) + len(rejected[p]) + 1 <= max_length]
    assert sorted(kept) == fits and report.units_dropped == n - len(fits)
    assert report.tokens_unshared - report.tokens_kept == sum(len(prompts[p]) - 1 for p in kept)
    cut, cut_report = pack_pairs(
        table, max_length, columns=["pair"], share_prompt=True
    )  # overlong="truncate"
    assert all(len(r) <= max_length for r in cut.column("input_ids").to_pylist())
    assert cut_report.units_out == n and sorted(p for r in cut.column("pair").to_pylist() for p in r) == list(
        range(n)
    )
    for (seq, mask), p in zip(
        sequences_of(cut.to_pylist()), [p for r in cut.column("pair").to_pylist() for p in r for _ in (0, 1)]
    ):
        k = len(seq) - sum(mask)  # kept prompt: its end; kept completion: its start
        assert seq[:k] == prompts[p][len(prompts[p]) - k :] and sum(mask) >= 1


def test_truncation_keeps_prompt_end_and_completion_starts_and_reports():
    table = pa.table(
        {"prompt_ids": [list(range(2, 32))], "chosen_ids": [[40] * 10], "rejected_ids": [[50] * 3]}
    )
    with pytest.warns(TokensDroppedWarning, match="1 of 1 pairs truncated.*raise max_length") as said:
        rows, report = pack_preference(table, 24, share_prompt=True, return_report=True)
    assert said[0].filename == __file__  # the caller's line
    (chosen, cm), (rejected, rm) = sequences_of(rows.to_pylist())
    assert len(rows[0][0]) <= 24 and report.prompts_truncated == 1 and report.units_truncated == 1
    kp = rows.column("prompt_lengths").to_pylist()[0][0]
    assert chosen[:kp] == list(range(32 - kp, 32)) and set(chosen[kp:]) == {40} and rejected[kp:] == [50] * 3
    assert report.tokens_dropped == (30 + 13) - (kp + len(chosen) - kp + 3)


def test_groups_pack_with_completion_columns_aligned():
    rng = np.random.default_rng(1)
    groups = [
        [rng.integers(2, VOCAB, int(rng.integers(1, 5))).tolist() for _ in range(g)] for g in (3, 1, 4, 2)
    ]
    prompts = [rng.integers(2, VOCAB, int(rng.integers(1, 9))).tolist() for _ in groups]
    adv = [[float(i * 10 + j) for j in range(len(g))] for i, g in enumerate(groups)]
    table = pa.table({"prompt_ids": prompts, "completion_ids": groups, "adv": adv, "gid": [0, 1, 2, 3]})
    rows, report = pack_groups(table, 40, columns=["gid"], completion_columns=["adv"], return_report=True)
    d = rows.to_pylist()
    order = [g for r in d for g in r["gid"]]
    assert sorted(order) == [0, 1, 2, 3]
    assert [a for r in d for a in r["adv"]] == [a for g in order for a in adv[g]]
    want = [(prompts[g] + c, [0] * len(prompts[g]) + [1] * len(c)) for g in order for c in groups[g]]
    assert sequences_of(d) == want
    assert report.tokens_unshared - report.tokens_kept == sum(
        (len(groups[g]) - 1) * (len(prompts[g]) - 1) for g in range(4)
    )
    with pytest.raises(PackingError, match="one per completion"):
        pack_groups(table.set_column(2, "adv", pa.array([[1.0]] * 4)), 40, completion_columns=["adv"])


def test_groups_of_a_selected_dataset_are_checked_and_named_within_the_selection():
    """A ``Dataset.select`` leaving out a row with an empty group packs as the selected rows do as a table (it
    was refused for a row the dataset does not hold); a selected empty group, or a per-completion column of the
    wrong size, is refused by its place in the dataset, not in the table under it."""
    datasets = pytest.importorskip("datasets")
    from packtools.profiling.shared import shared_prompt_savings

    table = pa.table(
        {
            "prompt_ids": [[5, 6], [7], [8, 9, 10], [11]],
            "completion_ids": [[[2], [3, 4]], [], [[5]], [[6], [7]]],
            "adv": [[1.0, 2.0], [], [3.0], [5.0, 6.0]],
        }
    )
    ds = datasets.Dataset(table)
    kept = ds.select([3, 0])
    got = pack_groups(kept, 32, completion_columns=["adv"], shuffle=False).to_list()
    want = pack_groups(table.take([3, 0]), 32, completion_columns=["adv"], shuffle=False).to_pylist()
    assert got == want and sorted(a for r in got for a in r["adv"]) == [1.0, 2.0, 5.0, 6.0]
    assert shared_prompt_savings(kept) == shared_prompt_savings(table.take([3, 0]))
    with pytest.raises(PackingError, match="row 1: completion_ids holds no completion"):
        pack_groups(ds.select([0, 1]), 32)
    with pytest.raises(PackingError, match="row 1: completion_ids holds no completion"):
        shared_prompt_savings(ds.select([0, 1]))
    wrong = datasets.Dataset(table.set_column(2, "adv", pa.array([[1.0, 2.0], [], [3.0, 4.0], [5.0, 6.0]])))
    with pytest.raises(PackingError, match="row 2: 'adv' has 2 values for 1 completions"):
        pack_groups(wrong.select([3, 0, 2]), 32, completion_columns=["adv"])
    # outside the selection too (the values would be read shifted): named as the table's row
    with pytest.raises(
        PackingError, match=r"row 2 of the table under the dataset \(not selected\): 'adv' has 2"
    ):
        pack_groups(wrong.select([3, 0]), 32, completion_columns=["adv"])


# ---------------------------------------------------------------------------------------------------------
# The tree attention, in a plain loop


def tree_model(impl="sdpa"):
    model = tiny_llama(impl)
    use_tree_attention(model)
    return model


def alone_logps(model, seqs):
    out = []
    for ids, mask in seqs:
        lp = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        picked = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        out.append(picked[torch.tensor(mask[1:]).bool()].sum())
    return torch.stack(out)


def test_plain_loop_pairs_equal_each_sequence_alone():
    model = tree_model()
    rows = pack_preference(random_pairs(10, 3), 64, share_prompt=True).to_pylist()
    batch = TreeCollator()(rows)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], **{TREE_KEY: batch[TREE_KEY]}
        ).logits
        got = sequence_logps(logits, batch["labels"], batch[TREE_KEY])
        want = alone_logps(model, sequences_of(rows))
    pairs, tokens = got.pairs()
    assert pairs.shape == (10, 2) and float((got.logps - want).abs().max()) < TOL
    assert int(tokens.sum()) == sum(sum(m) for _, m in sequences_of(rows))


def pg_loss(model, batch, adv):
    out = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], **{TREE_KEY: batch[TREE_KEY]}
    )
    return -(adv * sequence_logps(out.logits, batch["labels"], batch[TREE_KEY]).logps).sum()


def test_groups_policy_gradient_loss_and_gradients_equal_each_completion_alone():
    rng = np.random.default_rng(4)
    groups = [[rng.integers(2, VOCAB, int(rng.integers(1, 6))).tolist() for _ in range(3)] for _ in range(4)]
    prompts = [rng.integers(2, VOCAB, int(rng.integers(2, 12))).tolist() for _ in groups]
    adv = [rng.normal(size=3).tolist() for _ in groups]
    table = pa.table({"prompt_ids": prompts, "completion_ids": groups, "adv": adv})
    rows = pack_groups(table, 96, completion_columns=["adv"]).to_pylist()
    batch = TreeCollator(completion_columns=["adv"])(rows)
    model = tree_model()
    loss = pg_loss(model, batch, batch["adv"])
    loss.backward()
    got = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    want_loss = -(batch["adv"] * alone_logps(model, sequences_of(rows))).sum()
    want_loss.backward()
    assert abs(loss.item() - want_loss.item()) < TOL
    assert max(float((got[k] - p.grad).abs().max()) for k, p in model.named_parameters()) < TOL
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], **{TREE_KEY: batch[TREE_KEY]}
        )
        view, _ = sequence_logps(out.logits, batch["labels"], batch[TREE_KEY]).groups()
    assert view.shape == (4, 3)


def layer_inputs(seed=0):
    rng = np.random.default_rng(seed)
    rows = pack_preference(random_pairs(4, seed), 64, share_prompt=True).to_pylist()
    layout = TreeCollator()(rows)[TREE_KEY]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, layout.total, 8, generator=g) for _ in range(3))
    return rows, layout, q, k, v, rng


def varlen_reference(q, k, v, layout):
    """FlashAttention varlen's contract on the CPU: queries by cu_q, gathered keys by cu_k, causal aligned
    bottom-right.  What the CUDA path hands flash_attn_varlen_func."""
    kg, vg = k[0].transpose(0, 1)[layout.kv_index], v[0].transpose(0, 1)[layout.kv_index]
    qf = q[0].transpose(0, 1)
    outs = []
    cq, ck = layout.cu_q.tolist(), layout.cu_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks = qf[cq[i] : cq[i + 1]].transpose(0, 1), kg[ck[i] : ck[i + 1]].transpose(0, 1)
        vs = vg[ck[i] : ck[i + 1]].transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = torch.arange(lk)[None] <= torch.arange(lq)[:, None] + (lk - lq)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1)
        )
    return torch.cat(outs)[None]


def test_cpu_path_equals_the_varlen_contract_and_a_gather_off_by_one_fails():
    _, layout, q, k, v, _ = layer_inputs()
    out, _ = tree_attention_forward(None, q, k, v, None, **{TREE_KEY: layout})
    assert float((out - varlen_reference(q, k, v, layout)).abs().max()) < 1e-6
    shifted = layout.kv_index.clone()
    shifted[layout.cu_k[1] :] = (shifted[layout.cu_k[1] :] - 1).clamp(min=0)  # the gather index off by one
    wrong = varlen_reference(q, k, v, TreeLayout(**{**layout.__dict__, "kv_index": shifted}))
    assert float((out - wrong).abs().max()) > 1e-3


@pytest.mark.parametrize("payload", [{"kv_index": [0, 1]}, (1, 2), "tree", False])
def test_a_tree_keyword_that_is_no_tree_layout_is_refused(payload):
    """Only a TreeLayout (or no tree keyword) is a call the tree attention can serve: anything else under the
    keyword (a layout turned into a dict or tuple by a batch transform) is refused by name, never run as plain
    causal attention over the whole row, where every completion would see its siblings."""
    _, _, q, k, v, _ = layer_inputs()
    with pytest.raises(PackingError, match=f"{TREE_KEY}=.*not a TreeLayout"):
        tree_attention_forward(None, q, k, v, None, **{TREE_KEY: payload})


def run_tree(model, rows, layout=None, positions=None):
    batch = TreeCollator()(rows)
    layout = batch[TREE_KEY] if layout is None else layout
    positions = batch["position_ids"] if positions is None else positions
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=positions, **{TREE_KEY: layout}).logits
        return sequence_logps(logits, batch["labels"], layout).logps, batch


def test_negative_controls_sibling_visible_or_position_off_by_one_fail():
    model = tree_model()
    rows = pack_preference(random_pairs(6, 5), 64, share_prompt=True).to_pylist()
    with torch.no_grad():
        want = alone_logps(model, sequences_of(rows))
    got, batch = run_tree(model, rows)
    assert float((got - want).abs().max()) < TOL
    layout = batch[TREE_KEY]
    # A rejected completion that can see its sibling: its keys are the prefix *and* the chosen branch.
    seg = layout.segments.copy()
    rejected = np.flatnonzero(layout.is_branch)[1]
    seg[rejected, 3] += seg[rejected - 1, 1]
    leak = TreeLayout.build(seg, layout.is_branch, layout.group_sizes)
    assert float((run_tree(model, rows, layout=leak)[0] - want).abs().max()) > 1e-3
    # A position off by one on the completions (continuing at P + 1 instead of P).
    positions = batch["position_ids"].clone()
    positions[0, int(seg[rejected, 0]) :] += 1
    assert float((run_tree(model, rows, positions=positions)[0] - want).abs().max()) > 1e-3


# ---------------------------------------------------------------------------------------------------------
# A tree batch on a model that was never switched to the tree attention is refused, not silently wrong


def forward_logits(model, batch, layout=None):
    layout = batch[TREE_KEY] if layout is None else layout
    return model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], **{TREE_KEY: layout}
    ).logits


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_plain_loop_on_an_unswitched_model_is_refused_before_the_loss(impl, monkeypatch):
    rows = pack_preference(random_pairs(6, 7), 64, share_prompt=True).to_pylist()
    plain = tiny_llama(impl)  # never given to use_tree_attention
    batch = TreeCollator()(rows)
    logits = forward_logits(plain, batch)  # runs: transformers' backends ignore the tree keyword
    with pytest.raises(PackingError, match=r"sequence_logps: no model ran .*use_tree_attention\(model\)"):
        sequence_logps(logits, batch["labels"], batch[TREE_KEY])
    # Negative control: without the check the same call returns log-probs that are wrong (not those of
    # each prompt + completion alone), with nothing raised.
    from packtools.batches.tree import TreeReads

    monkeypatch.setattr(TreeReads, "take", lambda self, output, reader: None)
    with torch.no_grad():
        want = alone_logps(plain, sequences_of(rows))
    wrong = sequence_logps(logits, batch["labels"], batch[TREE_KEY]).logps.detach()
    assert float((wrong - want).abs().max()) > 1e-2


def test_one_model_as_reference_and_policy_reads_twice_and_a_mixed_pair_is_refused():
    rows = pack_preference(random_pairs(6, 8), 64, share_prompt=True).to_pylist()
    model = tree_model()
    with torch.no_grad():
        want = alone_logps(model, sequences_of(rows))
    batch = TreeCollator()(rows)
    layout = batch[TREE_KEY]
    # Both forwards first, then both reads (and the policy's output read twice): no false alarm.
    with torch.no_grad():
        ref = forward_logits(model, batch)
    policy = forward_logits(model, batch)
    got = [sequence_logps(x, batch["labels"], layout).logps for x in (ref, policy, policy)]
    assert all(float((g - want).abs().max()) < TOL for g in got)
    assert layout.reads.forwards == 0 and layout.reads.layers == 2 * 2  # two forwards of two layers
    (-got[1].sum()).backward()  # and a loss backpropagates through it
    # One model on the tree and a reference that was not switched: the second new output is refused.
    batch = TreeCollator()(rows)
    tree_out = forward_logits(model, batch)
    with torch.no_grad():
        plain_out = forward_logits(tiny_llama(), batch)
    sequence_logps(tree_out, batch["labels"], batch[TREE_KEY])
    with pytest.raises(PackingError, match="read more often than a model ran it"):
        sequence_logps(plain_out, batch["labels"], batch[TREE_KEY])


def test_gradient_checkpointing_recompute_is_not_a_forward():
    rows = pack_preference(random_pairs(4, 9), 64, share_prompt=True).to_pylist()
    model = tree_model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = TreeCollator()(rows)
    layout = batch[TREE_KEY]
    logps = sequence_logps(forward_logits(model, batch), batch["labels"], layout).logps
    calls = layout.reads.layers
    (-logps.sum()).backward()
    assert calls == 2 and layout.reads.layers == calls and layout.reads.forwards == 0
    with pytest.raises(PackingError, match="use_tree_attention"):  # backward gave no credit for a new read
        sequence_logps(torch.zeros(layout.total, VOCAB), batch["labels"], layout)


def test_tree_batch_on_packtools_sdpa_is_refused_at_the_forward():
    from packtools.integrations import use_segmented_sdpa

    model = tiny_llama()
    use_segmented_sdpa(model)
    batch = TreeCollator()(pack_preference(random_pairs(3, 1), 64, share_prompt=True).to_pylist())
    with pytest.raises(PackingError, match="use_tree_attention"):
        forward_logits(model, batch)


# ---------------------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    "arch, impl, match",
    [
        ("Falcon-H1", "sdpa", "mix tokens outside attention"),
        ("Qwen3-Next", "sdpa", "mix tokens outside attention"),
        ("Mistral", "sdpa", "sliding-window"),
        ("Gemma 2", "eager", "sliding-window"),
    ],
)
def test_refuses_models_it_cannot_serve(arch, impl, match):
    model = tiny_arch(arch, impl)
    with pytest.raises(PackingError, match=match):
        use_tree_attention(model)
    assert model.config._attn_implementation == impl  # left as it came


@pytest.mark.parametrize("arch", ["GPT-2", "Qwen3"])
def test_accepts_models_it_serves_exactly(arch):
    """GPT-2's learned absolute positions are right when the completions continue at P (positions passed)."""
    model = tiny_arch(arch, "sdpa")
    assert use_tree_attention(model) == "packtools_tree"
    assert model.config._attn_implementation == "packtools_tree"


def test_refuses_alibi_and_models_without_position_ids():
    bloom = transformers.BloomForCausalLM(
        transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2)
    )
    with pytest.raises(PackingError, match="ALiBi"):
        check_tree_model(bloom)

    class NoPositions(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):  # takes no position_ids
            return super().forward(input_ids=input_ids)

    model = NoPositions(tiny_llama().config)
    with pytest.raises(PackingError, match="takes no position_ids"):
        check_tree_model(model)


def test_probe_refuses_a_model_whose_attention_ignores_the_tree(monkeypatch):
    """A model that skips the attention interface (here: the tree keyword dropped) leaks; the probe says so."""
    from packtools.integrations.attention import tree as tree_attention

    real = tree_attention.tree_attention_forward

    def ignoring(module, q, k, v, mask, **kwargs):
        kwargs.pop(TREE_KEY, None)
        return real(module, q, k, v, mask, **kwargs)

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "packtools_tree", ignoring)
    model = tiny_llama()
    with pytest.raises(PackingError, match="differs from the same prompt"):
        use_tree_attention(model)
    assert model.config._attn_implementation == "sdpa"


# ---------------------------------------------------------------------------------------------------------
# TRL: prepare_dpo_trainer on prompt-shared rows equals TRL's padded DPO

trl = pytest.importorskip("trl")
import test_dpo as dpo  # noqa: E402

from packtools import prepare_dpo_trainer  # noqa: E402


class BackboneTokens:
    """Records the number of tokens of every backbone call."""

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.calls = []
        base.model.register_forward_pre_hook(
            lambda m, a, kw: self.calls.append(kw["input_ids"].shape), with_kwargs=True
        )


def engage_checkpointing(trainer):
    """Turn on the gradient checkpointing ``args`` ask for (Trainer does it only in ``train()``, and these
    tests call ``compute_loss``); returns a list recording the first attention layer's calls, else None."""
    if not trainer.args.gradient_checkpointing:
        return None
    trainer.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
    )
    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    assert base.is_gradient_checkpointing
    calls = []
    base.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls


def shared_trainer(tmp_path, **config):
    trainer = dpo.build(tmp_path, n=16, **config)
    columns = ["ref_chosen_logps", "ref_rejected_logps"] if trainer.precompute_ref_logps else []
    indexed = trainer.train_dataset.add_column("pair", list(range(len(trainer.train_dataset))))
    packed = pack_preference(indexed, 64, columns=[*columns, "pair"], share_prompt=True)
    return prepare_dpo_trainer(trainer, train_dataset=packed), packed


@pytest.mark.parametrize(
    "case",
    [
        "sigmoid-sdpa",
        "ipo-eager-ld_alpha",
        "precompute_ref_log_probs",
        "lora",
        "gradient_checkpointing",
        "lora-checkpointing-precompute",
    ],
)
def test_trl_on_shared_rows_equals_trl_padded(tmp_path, case):
    prepared, packed = shared_trainer(tmp_path, **dpo.CASES[case])
    assert prepared.model.config._attn_implementation == "packtools_tree"
    reference = dpo.build(tmp_path, n=16, **dpo.CASES[case])
    recomputed = [engage_checkpointing(t) for t in (prepared, reference)][0]
    rows = [packed[0], packed[1]]
    pairs = [i for r in rows for i in r["pair"]]
    recorder = BackboneTokens(prepared.model)
    batch = prepared.data_collator(rows)
    got = dpo.loss_metrics_grads(prepared, batch)
    want = dpo.loss_metrics_grads(reference, dpo.trl_batch(reference, pairs))
    dpo.assert_same(want, got)
    dpo.assert_untied(reference, want, pairs)
    if recomputed is not None:  # the policy's layers really ran again in the backward pass
        assert len(recomputed) > len(recorder.calls), (len(recomputed), len(recorder.calls))
    # The backbone ran P + C + R + 1 tokens per pair (the prompt once), not 2P + C + R.
    prompt = [len(reference.train_dataset[i]["prompt_ids"]) for i in pairs]
    comp = [len(reference.train_dataset[i][k]) for i in pairs for k in ("chosen_ids", "rejected_ids")]
    shared = sum(prompt) + sum(comp) + len(pairs)
    assert recorder.calls and all(tuple(c) == (1, shared) for c in recorder.calls)
    assert shared < 2 * sum(prompt) + sum(comp)


def test_trl_shared_lora_checkpointing_negative_control_recompute_off_by_one(tmp_path, monkeypatch):
    """The LoRA + checkpointing equality above can fail: a backward recompute whose attention hides one
    prefix key from each completion (a gather off by one, only in the recompute) moves the gradients."""
    case = dpo.CASES["lora-checkpointing-precompute"]
    prepared, packed = shared_trainer(tmp_path, **case)
    reference = dpo.build(tmp_path, n=16, **case)
    for t in (prepared, reference):
        engage_checkpointing(t)
    rows = [packed[0], packed[1]]
    pairs = [i for r in rows for i in r["pair"]]
    batch = prepared.data_collator(rows)
    exact = TreeLayout.mask

    def off_by_one(self, q_len, pre_len, device, dtype):
        mask = exact(self, q_len, pre_len, device, dtype)
        if pre_len > 1 and torch._C._current_graph_task_id() != -1:  # in the backward recompute only
            mask = mask.clone()
            mask[:, 0] = float("-inf")
        return mask

    monkeypatch.setattr(TreeLayout, "mask", off_by_one)
    got = dpo.loss_metrics_grads(prepared, batch)
    want = dpo.loss_metrics_grads(reference, dpo.trl_batch(reference, pairs))
    assert abs(got[0] - want[0]) < TOL  # the forward is exact...
    assert want[2].keys() == got[2].keys()
    assert max(float((got[2][k] - want[2][k]).abs().max()) for k in want[2]) > 1e-4  # ...the gradients not


def test_trl_shared_precompute_negative_control_reference_columns_on_the_wrong_pairs(tmp_path):
    """The precompute comparison above can fail: a shared row whose reference log-probs go to its pairs in the
    wrong order moves the loss and the gradients (the mean rewards stay: the same columns, other pairs)."""
    prepared, packed = shared_trainer(tmp_path, **dpo.CASES["precompute_ref_log_probs"])
    reference = dpo.build(tmp_path, n=16, **dpo.CASES["precompute_ref_log_probs"])
    rows = [packed[0], packed[1]]
    assert len(rows[0]["pair"]) > 1
    pairs = [i for r in rows for i in r["pair"]]
    batch = prepared.data_collator(rows)
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        batch[key][[0, 1]] = batch[key][[1, 0]]  # the first row's first two pairs swapped
    want = dpo.loss_metrics_grads(reference, dpo.trl_batch(reference, pairs))
    got = dpo.loss_metrics_grads(prepared, batch)
    assert abs(got[0] - want[0]) > 1e-3, (got[0], want[0])
    assert max(float((got[2][k] - want[2][k]).abs().max()) for k in want[2]) > 1e-3


def test_trl_fold_refuses_a_model_switched_off_the_tree_after_prepare(tmp_path):
    prepared, packed = shared_trainer(tmp_path)
    batch = prepared.data_collator([packed[0], packed[1]])
    dpo.loss_metrics_grads(prepared, batch)  # on the tree: runs
    prepared.model.set_attn_implementation("sdpa")  # e.g. a user's later switch: the fold must not run wrong
    with pytest.raises(
        PackingError, match=r"prepare_dpo_trainer\(share_prompt=True\): no model ran .*use_tree"
    ):
        dpo.loss_metrics_grads(prepared, batch)


def test_trl_accumulation_on_shared_rows_is_the_mean_over_the_step(tmp_path):
    prepared, _ = shared_trainer(tmp_path, **dpo.ONE_LOGGED_STEP)
    dpo.check_step_is_the_whole_step(tmp_path, prepared)


def test_trl_share_prompt_on_trl_batches_and_refusal(tmp_path):
    """share_prompt=True without a packed dataset folds TRL's own batches; a hybrid model is refused."""
    padded = dpo.build(tmp_path)
    prepared = prepare_dpo_trainer(dpo.build(tmp_path), share_prompt=True)
    batch = padded.data_collator([padded.train_dataset[i] for i in range(4)])
    dpo.assert_same(dpo.loss_metrics_grads(padded, batch), dpo.loss_metrics_grads(prepared, batch))
    trainer = dpo.build(tmp_path)
    trainer.ref_model = tiny_arch("Falcon-H1", "sdpa")
    with pytest.raises(PackingError, match="FalconH1ForCausalLM"):  # refused before anything is switched
        prepare_dpo_trainer(trainer, share_prompt=True)
    assert trainer.model.config._attn_implementation == "sdpa"
    # The tree's own check runs on every model before any is switched: the policy stays as it was, unwrapped.
    from packtools.integrations.preference.shared_prompt import prepare_shared_prompt

    trainer = dpo.build(tmp_path)
    with pytest.raises(PackingError, match="sliding-window"):
        prepare_shared_prompt(trainer, [trainer.model, tiny_arch("Mistral", "sdpa")])
    assert trainer.model.config._attn_implementation == "sdpa"
    assert "_packtools_shared_prompt" not in vars(trainer.model)


def mistral_policy_trainer(tmp_path, monkeypatch, arch="Mistral", role="policy"):
    """TRL's DPOTrainer built with a tiny ``arch`` model as the policy (or reference), the other a Llama."""
    swap = 0 if role == "policy" else 1
    monkeypatch.setattr(
        dpo,
        "tiny_llama",
        lambda impl="sdpa", seed=0: tiny_arch(arch, impl) if seed == swap else tiny_llama(impl, seed),
    )
    trainer = dpo.build(tmp_path, n=8)
    monkeypatch.undo()
    return trainer


@pytest.mark.parametrize(
    "arch, role, match",
    [
        ("Mistral", "policy", "MistralForCausalLM has sliding-window"),
        ("Falcon-H1", "reference", "FalconH1ForCausalLM has layers that mix tokens outside attention"),
    ],
)
def test_prepare_dpo_trainer_refuses_what_the_tree_cannot_serve_by_its_own_check(
    tmp_path, monkeypatch, arch, role, match
):
    trainer = mistral_policy_trainer(tmp_path, monkeypatch, arch, role)
    packed = pack_preference(trainer.train_dataset, 64, share_prompt=True)
    model = trainer.model if role == "policy" else trainer.ref_model
    before = model.config._attn_implementation
    with pytest.raises(PackingError, match=match):
        prepare_dpo_trainer(trainer, train_dataset=packed)
    assert model.config._attn_implementation == before and trainer.model.config._attn_implementation == "sdpa"
    assert "_packtools_shared_prompt" not in vars(trainer.model)  # nothing wrapped
    # Negative control: with the tree's check disabled, the same call no longer refuses the model by name
    # (Mistral then gets through the generic checks and is stopped only by the tree's isolation probe, by
    # value; Falcon-H1 by the generic probe's message).
    from packtools.integrations.preference import shared_prompt as shared_dpo

    trainer = mistral_policy_trainer(tmp_path, monkeypatch, arch, role)
    monkeypatch.setattr(shared_dpo, "check_tree_model", lambda model: None)
    monkeypatch.setattr("packtools.integrations.attention.tree.check_tree_model", lambda model: None)
    monkeypatch.setattr("packtools.integrations.preference.dpo.check_tree_model", lambda model: None)
    with pytest.raises(PackingError) as caught:
        prepare_dpo_trainer(trainer, train_dataset=packed)
    assert not re.search(match, str(caught.value)), caught.value


def test_trl_train_keeps_prompt_lengths_through_remove_unused_columns(tmp_path):
    prepared, _ = shared_trainer(tmp_path, max_steps=1, remove_unused_columns=True)
    seen = []
    inner = prepared.data_collator

    def record(features):
        seen.append(sorted(features[0]))
        return inner(features)

    prepared.data_collator = record
    prepared.train()
    assert seen and all("prompt_lengths" in keys and "pair" not in keys for keys in seen)


def test_overlong_groups_truncate_shorter_completions_whole_first_or_drop():
    table = pa.table(
        {
            "prompt_ids": [list(range(2, 22)), [5, 6]],
            "completion_ids": [[[40] * 2, [41] * 30, [42] * 12], [[7], [8]]],
        }
    )
    with pytest.warns(
        TokensDroppedWarning, match=r"pack_groups: 1 of 2 groups truncated and 0 dropped.*raise max_length"
    ) as said:
        rows, report = pack_groups(table, 32, return_report=True)
    assert said[0].filename == __file__  # the caller's line
    assert all(len(r) <= 32 for r in rows.column("input_ids").to_pylist())
    seqs = sequences_of(rows.to_pylist())
    by_head = {tuple(s[-1:]): s for s, _ in seqs}
    kp = rows.column("prompt_lengths").to_pylist()
    p = next(x for r in kp for x in r if x != 2)
    assert p == 8  # max_length // 4: the prompt keeps its last 8 tokens
    assert by_head[(40,)][:p] == list(range(14, 22)) and by_head[(40,)][p:] == [40, 40]  # short one whole
    assert len(by_head[(41,)]) - p == len(by_head[(42,)]) - p  # the two long ones share the rest equally
    assert report.units_truncated == 1 and report.units_dropped == 0
    with pytest.warns(
        UserWarning, match=r"pack_groups: 0 of 2 groups truncated and 1 dropped.*raise max_length"
    ):
        dropped, report = pack_groups(table, 32, overlong="drop", return_report=True)
    assert report.units_dropped == 1 and dropped.column("prompt_lengths").to_pylist() == [[2]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out: nothing said
        whole, report = pack_groups(table, 128, return_report=True)
    assert report.units_truncated == report.units_dropped == 0 and whole.num_rows == 1
