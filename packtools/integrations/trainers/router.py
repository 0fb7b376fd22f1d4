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


def router_loss_on(model: Any) -> bool:
    """Whether ``model``'s own loss adds a MoE router loss: its text config has ``output_router_logits`` and its
    :func:`router_coefficient` is not 0.

    >>> from types import SimpleNamespace as N
    >>> router_loss_on(N(config=N(output_router_logits=True, router_aux_loss_coef=0.01)))
    True
    """
    return bool(getattr(_text_config(model), "output_router_logits", False) and router_coefficient(model))


def trainer_router_loss_on(trainer: Any) -> bool:
    """Whether ``trainer`` trains a MoE router loss: TRL's trainers decide it themselves (``aux_loss_enabled``:
    their own ``router_aux_loss_coef``, with ``output_router_logits=True`` passed to every forward and
    ``coef * outputs.aux_loss`` added to the loss, whatever the model's own copy of the coefficient), else the
    model's :func:`router_loss_on`.

    >>> from types import SimpleNamespace as N
    >>> trainer_router_loss_on(N(aux_loss_enabled=True, model=N(config=N(router_aux_loss_coef=0.0))))
    True
    """
    return bool(getattr(trainer, "aux_loss_enabled", False)) or router_loss_on(trainer.model)


def check_router_filler(model: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse a packed forward (``kwargs``) whose rows end in filler while ``model`` computes its router loss
    (``output_router_logits=True`` given, as TRL's trainers do, which weight ``outputs.aux_loss`` themselves;
    else its config's, with a :func:`router_coefficient` other than 0).  Filler: the last document of a row (from
    ``cu_seq_lens_q`` for one row, else where ``position_ids`` last restart) of at least 2 tokens, all of them the
    model's ``pad_token_id`` with no label trained -- what packtools' collators append.  A 1-token tail is not
    told from a 1-token document and passes; without a ``pad_token_id`` nothing is checked."""
    routed = kwargs.get("output_router_logits")
    config = _text_config(model)
    if routed is None:  # the model's own setting: its loss adds the router loss with its own coefficient
        routed = bool(getattr(config, "output_router_logits", False) and router_coefficient(model))
    # given at the forward (TRL's trainers), the caller weights outputs.aux_loss itself: on whatever the model's
    # own coefficient
    pad = getattr(config, "pad_token_id", None)
    ids, labels, pos = kwargs.get("input_ids"), kwargs.get("labels"), kwargs.get("position_ids")
    if not routed or pad is None or getattr(ids, "ndim", 0) != 2:
        return
    cu = kwargs.get("cu_seq_lens_q")
    for row in range(ids.shape[0]):
        if cu is not None and ids.shape[0] == 1 and len(cu) > 2:
            start = int(cu[-2])
        elif getattr(pos, "ndim", 0) == 2 and pos.shape == ids.shape:
            zeros = (pos[row] == 0).nonzero()
            if len(zeros) < 2:  # one document in the row: the model's own, nothing appended
                continue
            start = int(zeros[-1])
        else:
            return
        tail = ids[row, start:]
        trained = labels is not None and bool((labels[row, start:] != -100).any())
        if tail.shape[0] >= 2 and not trained and bool((tail == pad).all()):
            raise PackingError(
                f"row {row} of a packed batch ends in {tail.shape[0]} filler tokens (pad_token_id={pad}, no "
                f"label) while {type(base_model(model)).__name__} computes its MoE router loss "
                f"(output_router_logits): with no attention_mask in a packed batch, transformers counts them in "
                f"the router's load-balancing statistics, and the loss and gradients differ from the padded "
                f"batch's. Collate without padding (PaddingFreeCollator without pad_to_multiple_of / "
                f"pad_to_buckets, padding_free=True), or set output_router_logits=False (or "
                f"router_aux_loss_coef=0.0).",
                param="output_router_logits",
            )
