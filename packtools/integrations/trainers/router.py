"""A MoE model's router (load-balancing) loss on packed batches: when it is on, and filler tokens it would count.

transformers' MoE models add ``router_aux_loss_coef * load_balancing_loss_func(router_logits, ..., attention_mask)``
to their loss: expert counts and mean router probabilities over every token a forward routes, padding kept out
only through ``attention_mask``.  A packed batch has no mask (it would merge the packed sequences), so a
padding-free row of real tokens gives the padded batch's router loss, and a row ending in filler (the padding
segment of ``pad_to_multiple_of`` / ``pad_to_buckets``, the right-padding of ``padding_free=False`` rows) counts
the filler as routed tokens: another loss and other gradients, with no error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...errors import PackingError
from ..attention.backends import base_model

#: The names transformers 5.25's MoE models give the router loss's weight (their own copy, and their config's):
#: ``router_aux_loss_coef`` for most (Dbrx copies ``ffn_config.moe_loss_weight`` into it), ``aux_loss_coef`` for
#: JetMoE.
COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")

#: The ``model_type`` of transformers 5.25's models whose config declares ``output_router_logits`` and a router
#: coefficient while their forward computes no router loss (it returns the router logits, ``aux_loss`` stays
#: ``None``): Llama 4 (its text config ``llama4_text``, and the multimodal ``llama4``) and OpenAI's privacy filter
#: (token classification).  ``tests/test_moe_router_loss.py`` re-derives it from the installed transformers.
NO_ROUTER_LOSS = frozenset({"llama4", "llama4_text", "openai_privacy_filter"})


def _text_config(model: Any) -> Any:
    config = getattr(base_model(model), "config", None)
    return getattr(config, "get_text_config", lambda: config)()


def router_coefficient(model: Any) -> float:
    """The weight ``model``'s forward gives its router loss: the model's own copy (``router_aux_loss_coef``, or
    JetMoE's ``aux_loss_coef``, taken from its config when it was built, and read by its forward), else its text
    config's; 0 if none.

    >>> from types import SimpleNamespace as N
    >>> router_coefficient(N(config=N(router_aux_loss_coef=0.01))), router_coefficient(N(config=N()))
    (0.01, 0)
    """
    owner, config = base_model(model), _text_config(model)
    for name in COEFFICIENTS:
        if hasattr(owner, name) or hasattr(config, name):
            return getattr(owner, name, getattr(config, name, 0)) or 0
    return 0


def computes_router_loss(model: Any) -> bool:
    """Whether ``model``'s forward computes a router loss at all when asked for its router logits: not for the
    :data:`NO_ROUTER_LOSS` families (Llama 4 returns its router logits and no ``aux_loss``), whose config or
    outer model (``llama4``) names the type.

    >>> from types import SimpleNamespace as N
    >>> computes_router_loss(N(config=N(model_type="llama4_text"))), computes_router_loss(N(config=N()))
    (False, True)
    """
    types = {getattr(getattr(base_model(model), "config", None), "model_type", None)}
    types.add(getattr(_text_config(model), "model_type", None))
    return not types & NO_ROUTER_LOSS


def router_loss_on(model: Any) -> bool:
    """Whether ``model``'s own loss adds a MoE router loss: its text config has ``output_router_logits``, its
    :func:`router_coefficient` is not 0, and it :func:`computes_router_loss` (Llama 4 does not).

    >>> from types import SimpleNamespace as N
    >>> router_loss_on(N(config=N(output_router_logits=True, router_aux_loss_coef=0.01)))
    True
    """
    return bool(
        getattr(_text_config(model), "output_router_logits", False)
        and router_coefficient(model)
        and computes_router_loss(model)
    )


def trainer_router_loss_on(trainer: Any) -> bool:
    """Whether ``trainer`` trains a MoE router loss: TRL's trainers decide it themselves (``aux_loss_enabled``:
    their own ``router_aux_loss_coef``, with ``output_router_logits=True`` passed to every forward and
    ``coef * outputs.aux_loss`` added to the loss, whatever the model's own copy of the coefficient), else the
    model's :func:`router_loss_on`.

    >>> from types import SimpleNamespace as N
    >>> trainer_router_loss_on(N(aux_loss_enabled=True, model=N(config=N(router_aux_loss_coef=0.0))))
    True
    """
    # no aux_loss to count filler in (TRL's own step fails on None)
    if not computes_router_loss(trainer.model):
        return False
    return bool(getattr(trainer, "aux_loss_enabled", False)) or router_loss_on(trainer.model)


def check_router_filler(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse a packed forward (``kwargs``) whose rows end in filler while ``model`` computes its router loss
    (``output_router_logits=True`` given, as TRL's trainers do, which weight ``outputs.aux_loss`` themselves;
    else its config's, with a :func:`router_coefficient` other than 0; never for a model that
    :func:`computes_router_loss` not).

    The documents of a row come from ``cu_seq_lens_q`` (one row) or from where ``position_ids`` restart (of Qwen-VL's
    ``(4, B, T)`` ones, their text row).  Filler
    is the run of documents that ends a row (never its first), each made of the model's ``pad_token_id`` only,
    with no label trained: packtools' padding segment (positions 0, 1, 2, ...) and TRL's padding (one 1-token
    document per pad token), however short.  A real document of nothing but ``pad_token_id`` at a row's end is
    refused with them: it trains no token, and is not told from filler.  A row whose last document has no label
    trained and is not the config's pad is refused too, naming ``pad_token_id``, where it may be filler of a pad
    id the config does not know (a collator's filler is one id repeated): such a document of one id, however
    short, when the config has no ``pad_token_id``, one of at least 2 tokens when it names another (1 such token
    is not told from a 1-token document and passes).  An untrained last document of several ids is no filler and
    passes (``bfd`` keeps documents whose kept part trains nothing).  A batch without ``labels`` is judged by the
    pad id alone."""
    routed = kwargs.get("output_router_logits")
    if routed is None:  # the model's own setting: its loss adds the router loss with its own coefficient
        routed = router_loss_on(model)
    # given at the forward (TRL's trainers), the caller weights outputs.aux_loss itself: on whatever the model's
    # own coefficient
    ids, labels, pos = kwargs.get("input_ids"), kwargs.get("labels"), kwargs.get("position_ids")
    if not routed or not computes_router_loss(model) or getattr(ids, "ndim", 0) != 2:
        return
    pad = getattr(_text_config(model), "pad_token_id", None)
    cu = kwargs.get("cu_seq_lens_q")
    if getattr(pos, "ndim", 0) == 3 and pos.shape[0] == 4:  # Qwen-VL's (4, B, T): its text row
        pos = pos[0]  # ((3, B, T) without cu_seq_lens_q is refused by the guard: no per-document mask)
    for row in range(ids.shape[0]):
        if cu is not None and ids.shape[0] == 1 and len(cu) > 2:
            starts = [int(c) for c in (cu.tolist() if hasattr(cu, "tolist") else cu)[:-1]]  # one host copy
        elif getattr(pos, "ndim", 0) == 2 and pos.shape == ids.shape:
            starts = (pos[row] == 0).nonzero().flatten().tolist()
        else:
            return
        end, filler = ids.shape[1], 0
        for start in reversed(starts[1:]):  # a row starts with a document
            if labels is not None and bool((labels[row, start:end] != -100).any()):
                break  # trained: a document
            tokens = ids[row, start:end]
            if pad is not None and bool((tokens == pad).all()):
                filler, end = filler + end - start, start
                continue
            if not filler and labels is not None and bool((tokens == tokens[0]).all()):
                # an untrained last document of one repeated id, not the config's pad: filler of another pad id?
                # (a collator's filler is one id: a document of several ids is none and passes)
                if pad is None:
                    _refuse_unknown_pad(model, row, end - start, None)
                if end - start >= 2:  # (1 token of another id than the config's: not told from a document)
                    _refuse_unknown_pad(model, row, end - start, (pad, int(tokens[0])))
            break
        if filler:
            raise PackingError(
                f"row {row} of a packed batch ends in {filler} filler tokens (pad_token_id={pad}, no label) "
                f"while {type(base_model(model)).__name__} computes its MoE router loss (output_router_logits): "
                f"with no attention_mask in a packed batch, transformers counts them in the router's "
                f"load-balancing statistics, and the loss and gradients differ from the padded batch's. Collate "
                f"without padding (PaddingFreeCollator without pad_to_multiple_of / pad_to_buckets, "
                f"padding_free=True; TRL's collator without pad_to_multiple_of), or set "
                f"output_router_logits=False (or router_aux_loss_coef=0.0). A document of nothing but "
                f"pad_token_id there trains no token: leave it out of the rows.",
                param="output_router_logits",
            )


def _refuse_unknown_pad(model: Any, row: int, tokens: int, ids: tuple[int, int] | None) -> None:
    """Refuse a row's untrained last document that may be filler of a pad id the config does not name (``ids``:
    the config's ``pad_token_id`` and the document's one token id; ``None``: the config has no pad id)."""
    why = (
        "its config has no pad_token_id"
        if ids is None
        else f"it is {tokens} times token {ids[1]}, not the config's pad_token_id={ids[0]}"
    )
    raise PackingError(
        f"row {row} of a packed batch ends in a document of {tokens} tokens with no label trained while "
        f"{type(base_model(model)).__name__} computes its MoE router loss (output_router_logits), and {why}: "
        f"it may be the collator's filler, which transformers would count in the router's load-balancing "
        f"statistics (a packed batch has no attention_mask), and nothing tells it from a document. Set "
        f"model.config.pad_token_id to the collator's pad_token_id, or set output_router_logits=False (or "
        f"router_aux_loss_coef=0.0).",
        param="pad_token_id",
    )


def check_logits_z_loss(model: Any) -> None:
    """Refuse a model whose loss adds a logits z-loss (Bamba's ``z_loss_coefficient`` > 0) beside packed batches.

    transformers 5.25's Bamba adds ``z_loss_coefficient * logits.logsumexp(-1).pow(2).mean()``: a mean over every
    position of the batch, its padding included (no mask, no label reads it).  A padded batch counts its padding
    positions, a padding-free row only its real tokens, and a row ending in filler its filler too: measured on
    the tiny Bamba (6 documents), z = 21.4020 padded, 21.3697 padding-free, 21.3384 with ``pad_to_multiple_of=64``
    (and another value for each document alone), so no packed batch trains the padded batch's loss."""
    coefficient = getattr(base_model(model), "z_loss_coefficient", None)
    if coefficient is None:
        coefficient = getattr(_text_config(model), "z_loss_coefficient", 0)
    if coefficient:
        raise PackingError(
            f"z_loss_coefficient={coefficient} on {type(base_model(model)).__name__}: its z-loss is a mean of "
            f"logsumexp(logits)^2 over every position of the batch, padding included, so packed rows (real "
            f"tokens only, or with filler) give another loss and other gradients than the padded batch, with no "
            f"error. Set z_loss_coefficient=0.0 on the model and its config (transformers' default), or train "
            f"without packing.",
            param="z_loss_coefficient",
        )
