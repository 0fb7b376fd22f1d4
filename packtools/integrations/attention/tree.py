"""Attention that sees exactly the tree of a prompt-shared batch, registered with transformers.

``"packtools_tree"`` is a transformers attention function.  A call that carries a
:class:`~packtools.batches.tree.TreeLayout` (the ``packtools_tree`` keyword a model's forward passes down to
its attention layers) runs each segment's queries against its unit's prefix keys followed by its own keys,
causal with the queries aligned to the end of the keys: a completion attends to its prompt and causally to
itself, never to a sibling or another unit.

* CPU (and any device without flash-attn, or in fp32): ``scaled_dot_product_attention`` per segment, the
  prefix's keys and values put in front of the segment's own: exact.
* CUDA with flash-attn and fp16/bf16: one ``flash_attn_varlen_func`` over the flat queries and the gathered
  keys (``kv_index``), ``cu_seqlens_q`` / ``cu_seqlens_k`` apart, ``causal=True`` (flash-attn >= 2.1 aligns
  the causal mask bottom-right when a segment has more keys than queries).  Written to flash-attn's
  documented contract; not yet run on a GPU here.

Every other call (a plain or padding-free batch, generation) goes to packtools' per-sequence ``sdpa``
(:mod:`packtools.integrations.attention.segmented`), which falls back to transformers' ``sdpa``.

:func:`check_tree_model` refuses, by name, models the tree cannot serve: layers that mix tokens outside
attention (hybrid linear attention, SSM, convolutions), sliding-window or chunked layers, ALiBi, attention
sinks or logit softcapping, and models whose forward takes no ``position_ids``.  :func:`use_tree_attention`
switches a model after those checks and probes it (:func:`check_tree_isolation`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._optional import require
from ...batches.tree import TREE_KEY, TreeLayout, tree_segments, unshared_index
from ...compat import set_attr
from ...compat.transformers import register_attention, set_attention
from ...errors import PackingError
from .backends import attention_implementation, base_model, forward_accepts, token_mixing_layers, uses_alibi
from .isolation import ProbeDiffs, autocast_inside, compute_dtype, max_abs_diff
from .segmented import AttentionCall, keyed_attention

TREE_ATTENTION = "packtools_tree"
_ORIGINAL = "_packtools_tree_original_attn"


def _flash_varlen() -> Any:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _refuse_call(module: Any, kwargs: dict[str, Any]) -> None:
    name = type(module).__name__
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise PackingError(f"{name}: attention softcapping or sinks are not supported by the tree attention.")
    if getattr(module, "sliding_window", None) is not None:
        raise PackingError(f"{name} has a sliding window, which the tree attention does not apply.")


def _tree_attention(call: AttentionCall, tree: Any) -> tuple[Any, None]:
    """transformers attention function (``query``/``key``/``value`` are ``[1, heads, tokens, dim]``).

    >>> import numpy as np, torch
    >>> from packtools.batches.tree import tree_segments
    >>> seg, branch = tree_segments(np.array([3]), np.array([2]), np.array([1, 2]))  # [p0 p1][p2 c][p2 r r]
    >>> tree = TreeLayout.build(seg, branch, np.array([2]))
    >>> q, k, v = torch.randn(3, 1, 2, 7, 4)
    >>> out, _ = tree_attention_forward(None, q, k, v, None, packtools_tree=tree)
    >>> rejected = [0, 1, 4, 5, 6]  # the prompt, then the rejected branch: what it sees alone
    >>> alone, _ = tree_attention_forward(None, q[:, :, rejected], k[:, :, rejected], v[:, :, rejected], None)
    >>> out.shape, torch.allclose(out[:, 4:], alone[:, 2:], atol=1e-6)
    (torch.Size([1, 7, 2, 4]), True)
    """
    if not isinstance(tree, TreeLayout):  # run as one causal row, every completion would see its siblings
        raise PackingError(
            f"{TREE_KEY}={type(tree).__name__} reached the tree attention, which is not a TreeLayout; pass the "
            f"batch TreeCollator built (packtools.batches.tree) as it is, its {TREE_KEY} untouched.",
            param=TREE_KEY,
        )
    module, query, key, value = call.module, call.query, call.key, call.value
    dropout, scaling = call.dropout, call.scaling
    torch = require("torch", "packtools tree attention")
    _refuse_call(module, call.kwargs)
    tree.reads.consumed(module)  # what sequence_logps checks: a tree attention ran this layout
    if query.shape[0] != 1 or query.shape[2] != tree.total or key.shape[2] != tree.total:
        raise PackingError(
            f"the tree attention got {tuple(query.shape)} queries for a tree of {tree.total} tokens in one row; "
            f"pass the prompt-shared batch as TreeCollator builds it."
        )
    flash = _flash_varlen()
    if flash is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1).index_select(0, tree.kv_index)
        v = value[0].transpose(0, 1).index_select(0, tree.kv_index)
        out = flash(
            q,
            k,
            v,
            tree.cu_q,
            tree.cu_k,
            tree.max_q,
            tree.max_k,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
        )
        return out[None], None
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # One split per tensor (its backward is one concatenation), not a slice per segment (each slice's
    # backward writes a zero tensor the size of the whole row).
    lengths = tree.segments[:, 1].tolist()
    qs, ks, vs = (t.split(lengths, dim=2) for t in (query, key, value))
    segment_at = {start: i for i, start in enumerate(tree.segments[:, 0].tolist())}
    outs = []
    for i, (_, q_len, pre_start, pre_len) in enumerate(tree.segments.tolist()):
        if pre_len == 0:
            outs.append(sdpa(qs[i], ks[i], vs[i], dropout_p=dropout, scale=scaling, is_causal=True))
            continue
        prefix = segment_at.get(pre_start)
        # the unit's prefix segment, as packtools builds, else any other span of keys a layout names
        if prefix is not None and lengths[prefix] == pre_len:
            k_pre, v_pre = ks[prefix], vs[prefix]
        else:
            k_pre, v_pre = (
                key[:, :, pre_start : pre_start + pre_len],
                value[:, :, pre_start : pre_start + pre_len],
            )
        k = torch.cat([k_pre, ks[i]], dim=2)
        v = torch.cat([v_pre, vs[i]], dim=2)
        mask = tree.mask(q_len, pre_len, query.device, query.dtype)
        outs.append(sdpa(qs[i], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.transpose(1, 2).contiguous(), None


#: The transformers attention function: :func:`_tree_attention` for a call carrying a tree layout, else
#: packtools' per-sequence ``sdpa``.
tree_attention_forward = keyed_attention(TREE_KEY, _tree_attention, "tree_attention_forward")


def register(*, owner: Any = None) -> str:
    """Register :data:`TREE_ATTENTION` with transformers (attention and mask functions); returns the name.

    >>> register()
    'packtools_tree'
    """
    return register_attention(TREE_ATTENTION, tree_attention_forward, owner=owner)


def check_tree_model(model: Any) -> None:
    """Raise :class:`PackingError` naming why the tree attention cannot serve ``model`` (see module docstring)."""
    base = base_model(model)
    name = type(base).__name__
    config = getattr(base, "config", None)
    if config is None or not hasattr(base, "set_attn_implementation"):
        raise PackingError(
            f"{name} is not a transformers model with a switchable attention; it cannot share prompts."
        )
    if getattr(config, "sub_configs", None):
        raise PackingError(
            f"{name} has a composite (multimodal) config; prompt sharing supports text models only."
        )
    # layers run per document count too: that would cut a prompt off its completions
    mixers = token_mixing_layers(model, include_handled=True)
    if mixers:
        raise PackingError(
            f"{name} has layers that mix tokens outside attention ({mixers[:3]}: linear attention, state-space "
            f"or convolution); they would run a prompt-shared row as one sequence (a completion would see its "
            f"sibling). Use share_prompt=False (pairs packed unshared)."
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = list(getattr(text, "layer_types", None) or [])
    windowed = [t for t in layer_types if t != "full_attention"]
    window = getattr(text, "sliding_window", None)
    if windowed or (window is not None and getattr(text, "use_sliding_window", True)):
        raise PackingError(
            f"{name} has sliding-window or chunked attention layers ({sorted(set(windowed)) or f'window {window}'}); "
            f"the tree attention applies full causal attention over the prompt and cannot apply the window. Use "
            f"share_prompt=False, or set config.sliding_window=None if every sequence is shorter than the window."
        )
    if uses_alibi(model):
        raise PackingError(
            f"{name} uses ALiBi position biases, which the tree attention does not apply; use share_prompt=False."
        )
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise PackingError(f"{name} caps attention logits (softcapping); the tree attention does not.")
    if not forward_accepts(base, "position_ids", named=True):
        raise PackingError(
            f"{name}.forward takes no position_ids, so its completions cannot continue at the prompt's length "
            f"(absolute positions from the token order would be wrong); use share_prompt=False."
        )


def _logits(model: Any, **kwargs: Any) -> Any:
    out = model(**kwargs, use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0]


def check_tree_isolation(model: Any, seed: int = 0) -> float:
    """Run a small prompt-shared batch through ``model`` (on the tree attention); raise unless it is exact.

    Two units (a pair and a group of three): every completion's logits must equal those of its prompt +
    completion run alone, and perturbing a sibling's tokens or another unit's must move none of them.
    Returns the largest difference seen.  No gradients; the model's train/eval mode is restored.
    """
    torch = require("torch", "packtools.integrations.attention.tree.check_tree_isolation")
    base = base_model(model)
    rng = np.random.default_rng(seed)
    vocab = int(getattr(base.config.get_text_config(), "vocab_size", 64))
    prompts, groups = np.array([5, 4]), np.array([2, 3])
    completions = rng.integers(2, 6, int(groups.sum()))
    seg, branch = tree_segments(prompts, groups, completions)
    layout = TreeLayout.build(seg, branch, groups)
    total = layout.total
    param = next(base.parameters())
    tokens = torch.from_numpy(rng.integers(3, max(vocab - 1, 4), total)).to(param.device)
    positions = torch.from_numpy(layout.positions()).to(param.device)[None]
    index, lengths = unshared_index(seg, branch)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            dev = layout.to(param.device)
            with autocast_inside(
                base
            ) as seen:  # the precision the forward computes in (accelerate's wrapper)
                tree = _logits(model, input_ids=tokens[None], position_ids=positions, **{TREE_KEY: dev})[0]
            probe = ProbeDiffs(compute_dtype(base, seen=seen))
            for b, (s, n) in enumerate(zip(starts, lengths)):
                where = torch.from_numpy(index[s : s + n]).to(param.device)
                alone = _logits(model, input_ids=tokens[where][None])[0]
                diff = probe.exceeds(tree[where], alone)
                if diff is not None:
                    raise PackingError(
                        f"{type(base).__name__} with the tree attention: completion {b} of the probe differs from "
                        f"the same prompt + completion run alone by {diff:.3g}; it cannot share prompts exactly "
                        f"(use share_prompt=False, and please report the model)."
                    )
            # Perturb everything outside branch 0's own sequence: its logits must not move.
            own = np.zeros(total, bool)
            own[index[starts[0] : starts[0] + lengths[0]]] = True
            moved = tokens.clone()
            other = torch.from_numpy(~own).to(param.device)
            moved[other] = (moved[other] + 1) % vocab
            again = _logits(model, input_ids=moved[None], position_ids=positions, **{TREE_KEY: dev})[0]
            mine = torch.from_numpy(own).to(param.device)
            diff = max_abs_diff(again[mine], tree[mine])
            if diff > probe.tol:
                raise PackingError(
                    f"{type(base).__name__} with the tree attention: changing a sibling completion or another unit "
                    f"moved a completion's logits by {diff:.3g}; tokens leak across the tree."
                )
    finally:
        base.train(was_training)
    return probe.worst


def use_tree_attention(model: Any, check_isolation: bool = True, *, owner: Any = None) -> str:
    """Switch ``model`` to :data:`TREE_ATTENTION` after :func:`check_tree_model`; probe it unless told not to.

    The model's earlier implementation is switched back if the probe fails.  With an ``owner`` (a trainer) the
    switch and the registration are recorded, so ``packtools.integrations.unprepare(owner)`` undoes them.
    Returns the new name.
    """
    check_tree_model(model)
    base = base_model(model)
    before = attention_implementation(model)
    if before != TREE_ATTENTION:
        if owner is None:
            object.__setattr__(base, _ORIGINAL, before)
        else:
            set_attr(base, _ORIGINAL, before, owner=owner)
        set_attention(base, register(owner=owner), owner=owner)
    if attention_implementation(model) != TREE_ATTENTION:
        raise PackingError(
            f"{type(base).__name__} keeps its own attention; it cannot run the tree attention."
        )
    if check_isolation:
        try:
            check_tree_isolation(model)
        except PackingError:
            set_attention(base, vars(base).get(_ORIGINAL, before))
            raise
    return TREE_ATTENTION
