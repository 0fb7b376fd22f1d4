"""Layers that pool fixed windows of the row (DeepSeek-V4's compressed attention) are refused from the config.

The sweep of transformers' causal-LM families outside ``packtools.testing.FAMILIES`` (benchmarks/family_sweep.py)
found DeepSeek-V4 training packed rows with no error and per-document gradients far from the documents run one by
one: its compressors pool every ``compress_rates[type]`` consecutive tokens of a row into one key/value, across the
packed documents, and a document's queries read the row's first windows by their ``position_ids``.  The isolation
probe's rows (5 + 9 and 3 + 7 tokens) never fill a window of heavily compressed attention (128 tokens in the real
model, 16 here), so ``prepare_trainer`` and ``guard_model`` let it through.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)

from packtools import PackingError, PaddingFreeCollator  # noqa: E402
from packtools.integrations import check_isolation  # noqa: E402
from packtools.integrations.attention.backends import check_attention_implementation  # noqa: E402
from packtools.integrations.trainers.guard import guard_model  # noqa: E402
from packtools.testing import SMALL  # noqa: E402

HCA = "heavily_compressed_attention"


def tiny_v4(layer_types):
    config = transformers.DeepseekV4Config(
        **{
            **SMALL,
            "head_dim": 8,
            "q_lora_rank": 16,
            "sliding_window": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "index_topk": 4,
            "compress_rates": {"compressed_sparse_attention": 4, HCA: 16},
            "layer_types": layer_types,
            "mlp_layer_types": ["moe"] * len(layer_types),
        }
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.DeepseekV4ForCausalLM(config).float().eval()


def packed_against_alone(model, lengths=(20, 20)):
    """Largest logit difference of the last document of one packed row against it alone."""
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 101, (n,), generator=gen).tolist() for n in lengths]
    batch = PaddingFreeCollator(0)([{"input_ids": sum(docs, []), "seq_lengths": list(lengths)}])
    with torch.no_grad():
        packed = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).logits[0, -lengths[-1] :]
        alone = model(input_ids=torch.tensor([docs[-1]]), use_cache=False).logits[0]
    return float((packed - alone).abs().max())


def test_the_pooled_windows_leak_where_the_probe_sees_nothing():
    model = tiny_v4([HCA, HCA])
    assert not check_isolation(model, raise_on_leak=False).leaks  # the probe's rows never fill a window
    # a 40-token row fills two windows; the second document's later queries read the first: the first document
    assert packed_against_alone(model) > 1e-3


@pytest.mark.parametrize("layer_types", [[HCA, HCA], ["sliding_attention", "compressed_sparse_attention"]])
def test_guard_model_and_the_prepare_functions_refuse_it_by_name(layer_types):
    model = tiny_v4(layer_types)
    pooled = next(t for t in layer_types if t != "sliding_attention")
    with pytest.raises(PackingError, match=rf"layers .*{pooled}.*Train this model unpacked"):
        guard_model(model)
    with pytest.raises(PackingError, match=rf"pool every few consecutive tokens.*{pooled}"):
        check_attention_implementation(model)  # what prepare_trainer, prepare_dpo_trainer, ... call first


def test_sliding_layers_alone_are_not_refused_and_stay_exact():
    model = tiny_v4(["sliding_attention", "sliding_attention"])
    assert check_attention_implementation(model) == "eager"
    guard_model(model)
    assert packed_against_alone(model) < 1e-5
