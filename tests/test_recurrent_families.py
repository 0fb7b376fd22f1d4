"""Pure recurrent models (Mamba, Falcon-Mamba, Mamba-2) and WhisperForCausalLM train packed and exact, or are refused
by name (RWKV, xLSTM).

transformers 5.25 (found by benchmarks/family_sweep.py): ``check_attention_implementation`` refused Mamba-2 and
WhisperForCausalLM ("forward takes no position_ids") although Mamba-2 has no attention to read them and Whisper's
forward hands them to its decoder through ``**kwargs``; MambaForCausalLM / FalconMambaForCausalLM hand their
backbone no keyword arguments at all, so their Mamba layers ran the packed row as one sequence (refused by the
probe); WhisperForCausalLM's own loss does not shift its labels, so a packed Trainer step trained each token to
predict itself.  Each packed step here -- documents longer than the convolution (4) and the scan's chunk (8), two
rows in the loop of one's own, gradient checkpointing on and off -- equals the documents run one by one.
"""

from __future__ import annotations

import copy
import tempfile

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from packtools import PackingError, PaddingFreeCollator, pack_dataset, prepare_trainer  # noqa: E402
from packtools.integrations.attention.mixers import document_mixers, run_mixers_per_document  # noqa: E402
from packtools.integrations.trainers.guard import guard_model  # noqa: E402

VOCAB = 101
_SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
)
_MAMBA = dict(_SIZES, state_size=8, conv_kernel=4, expand=2)
#: model_type: (causal LM class, config class, config)
MODELS = {
    "mamba": ("MambaForCausalLM", "MambaConfig", _MAMBA),
    "falcon_mamba": ("FalconMambaForCausalLM", "FalconMambaConfig", _MAMBA),
    "mamba2": (
        "Mamba2ForCausalLM",
        "Mamba2Config",
        dict(_MAMBA, num_heads=4, head_dim=16, n_groups=1, chunk_size=8),
    ),
    "whisper": (
        "WhisperForCausalLM",
        "WhisperConfig",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            decoder_layers=2,
            decoder_attention_heads=4,
            decoder_ffn_dim=64,
            encoder_layers=1,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            max_target_positions=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            dropout=0.0,
        ),  # fmt: skip
    ),
}
#: Two rows of 70 tokens; every document but one is longer than the convolution (4) and the chunk (8).
ROWS = ((23, 5, 31, 11), (9, 17, 18, 26))
TOLERANCE = 1e-5
#: TrainingArguments' switch for gradient checkpointing (renamed activation_checkpointing in transformers 5.25)
_FIELDS = getattr(transformers.TrainingArguments, "__dataclass_fields__", {})
CHECKPOINTING = {
    "activation_checkpointing" if "activation_checkpointing" in _FIELDS else "gradient_checkpointing": True
}


def build(model_type: str, impl: str = "eager"):
    model_cls, config_cls, kwargs = MODELS[model_type]
    config = getattr(transformers, config_cls)(**kwargs)
    config._attn_implementation = impl
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).float()


def documents(seed: int = 1) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in row] for row in ROWS]


def gap(got, reference) -> float:
    pairs = [(a, b) for a, b in zip(got, reference) if a is not None and b is not None]
    scale = max(1.0, max(float(b.abs().max()) for _, b in pairs))
    return max(float((a - b).abs().max()) for a, b in pairs) / scale


def one_by_one(model, docs: list[list[int]], params, divide: int = 1):
    """The summed next-token loss of each document run alone (divided by ``divide``), and its gradients."""
    total_loss, total = 0.0, [None] * len(params)
    for doc in docs:
        ids = torch.tensor([doc])
        logits = model(input_ids=ids, use_cache=False).logits.float()[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum") / divide
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        total_loss += float(loss.detach())
        total = [g if t is None else (t if g is None else t + g) for t, g in zip(total, grads)]
    return total_loss, total


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_own_loop_two_rows_equals_one_by_one(model_type, checkpointing):
    model = build(model_type)
    if checkpointing:  # activation_checkpointing_enable in transformers 5.25, gradient_... before
        enable = (
            getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        )
        enable()
    model.train()
    run_mixers_per_document(model)
    guard_model(model)  # the probe at the first packed batch
    rows = documents()
    ids = torch.tensor([sum(row, []) for row in rows])
    positions = torch.tensor([[p for doc in row for p in range(len(doc))] for row in rows])
    targets = torch.tensor([[t for doc in row for t in (*doc[1:], -100)] for row in rows])
    logits = model(input_ids=ids, position_ids=positions).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    ref_loss, ref_grads = one_by_one(model, [doc for row in rows for doc in row], params)
    assert abs(float(loss) - ref_loss) <= TOLERANCE * max(1.0, abs(ref_loss))
    assert gap(list(grads), ref_grads) <= TOLERANCE


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_prepare_trainer_step_equals_one_by_one(model_type):
    """One SGD step (lr 1) of a Trainer with PaddingFreeCollator and gradient checkpointing, prepared by
    prepare_trainer (its probe included): the parameter change is the one-by-one gradient of the token-mean loss."""
    datasets = pytest.importorskip("datasets")
    model = build(model_type)
    docs = [doc for row in documents() for doc in row]
    packed = pack_dataset(datasets.Dataset.from_list([{"input_ids": d} for d in docs]), 64)
    start = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=len(packed), max_steps=1, optim="sgd", learning_rate=1.0,
            lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to=[], use_cpu=True,
            save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0, **CHECKPOINTING,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=packed, data_collator=PaddingFreeCollator(0)
        )
        prepare_trainer(trainer)
        if model_type != "whisper":
            assert document_mixers(model) is not None and document_mixers(model).modes
        trainer.train()
    params = [p for p in start.parameters() if p.requires_grad]
    step = [
        a.detach() - b.detach() for a, b in zip(params, (p for p in model.parameters() if p.requires_grad))
    ]
    start.train()
    _, reference = one_by_one(start, docs, params, divide=sum(len(d) - 1 for d in docs))
    assert gap(step, reference) <= TOLERANCE


@pytest.mark.parametrize(
    ("model_cls", "config_cls", "kwargs"),
    [
        ("RwkvForCausalLM", "RwkvConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2)),
        (
            "xLSTMForCausalLM",
            "xLSTMConfig",
            dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4),
        ),
    ],
)
def test_recurrent_models_packtools_cannot_split_are_refused_by_name(model_cls, config_cls, kwargs):
    config = getattr(transformers, config_cls)(**kwargs)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config)
    for check in (lambda: guard_model(model), lambda: _prepare(model)):
        with pytest.raises(PackingError, match="recurrent model with no attention.*cannot run per document"):
            check()


def _prepare(model):
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=1)
        trainer = transformers.Trainer(model=model, args=args, data_collator=PaddingFreeCollator(0))
        prepare_trainer(trainer)


def test_an_attention_model_whose_positions_reach_nothing_is_still_refused():
    """The static refusal stays for a model with attention whose forward names no position_ids and whose decoder
    does not either (the exemptions are a model with no attention, and **kwargs reaching a decoder that names
    them)."""
    from packtools.integrations.attention.backends import check_attention_implementation

    class Decoder(torch.nn.Module):
        def forward(self, input_ids=None, **kwargs): ...

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Cfg", (), {"_attn_implementation": "eager", "model_type": "toy"})()
            self.decoder = Decoder()
            self.attn = torch.nn.Module()
            self.attn.is_causal = True

        def get_decoder(self):
            return self.decoder

        def forward(self, input_ids=None, **kwargs): ...

    with pytest.raises(PackingError, match="takes no position_ids"):
        check_attention_implementation(Model())


def test_mamba1_blocks_never_take_the_varlen_kernel_path(monkeypatch):
    """Mamba-1 blocks call their mixer with the hidden states, cache and mask only (transformers 5.25), so the
    seq_idx of the varlen path would never reach a kernel: they run per document even with the kernels installed."""
    from types import SimpleNamespace

    from packtools.integrations.attention import mixers

    monkeypatch.setattr(mixers.importlib.util, "find_spec", lambda name: object())  # every kernel "installed"
    cuda = SimpleNamespace(type="cuda")
    blocks = {name: type(name, (), {})() for name in ("MambaBlock", "FalconMambaBlock", "Mamba2Block")}
    assert [mixers.kernel_ready(block, cuda) for block in blocks.values()] == [False, False, True]


@pytest.mark.parametrize("model_type", ["mamba", "mamba2"])
def test_an_interrupted_packed_forward_leaves_no_boundaries_for_the_next_backbone_call(model_type):
    """A KeyboardInterrupt inside a packed forward (Ctrl-C in a notebook) runs no always-called forward hook, so the
    forward's documents stayed on run_mixers_per_document's stack; the backbone called on its own afterwards (TRL's
    reward and value models call ``model.backbone``) then ran an unpacked row cut at the old documents' boundaries,
    with no error."""
    model = build(model_type)
    reference = copy.deepcopy(model)
    run_mixers_per_document(model)
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([list(range(10)) * 2])

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = model.backbone.layers[0].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model(input_ids=ids, position_ids=positions, use_cache=False)
    handle.remove()
    other = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model.backbone(other, use_cache=False).last_hidden_state
        want = reference.backbone(other, use_cache=False).last_hidden_state
        assert gap(got, want) < TOLERANCE
        # the packed forward still runs its documents apart
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        halves = torch.cat(
            [reference(input_ids=ids[:, :10]).logits, reference(input_ids=ids[:, 10:]).logits], 1
        )
        assert gap(packed, halves) < TOLERANCE


def test_own_loop_whisper_labels_from_the_collator_are_refused_and_shifted_ones_pass():
    """WhisperForCausalLM's own loss scores position i against labels[i]: with PaddingFreeCollator's labels (the
    tokens themselves) a loop of one's own under guard_model trained each token to predict itself, with no error
    (packed loss 4.24 against the documents' 4.61).  Labels shifted by the caller still pass."""
    model = build("whisper")
    guard_model(model)
    docs = [doc for row in documents() for doc in row][:4]
    row = {"input_ids": [t for d in docs for t in d], "seq_lengths": [len(d) for d in docs]}
    batch = PaddingFreeCollator(0)([row])
    with pytest.raises(PackingError, match="predict itself"):
        model(**batch)
    labels = batch.pop("labels")
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    model(**batch, labels=shifted)  # the caller's own shift: Whisper's loss is then a next-token loss
    model(**batch)  # no labels: the caller computes the loss from the logits


def test_whisper_labels_scored_by_trls_fused_lm_head_pass():
    """TRL's fused LM head (DPO's and GRPO's forwards: ``fused_lm_head=True``) scores next-token labels itself and
    never hands them to the model's loss: the guard's unshifted-labels refusal refused DPO on the Whisper decoder
    (docs/models.md's matrix: 'refused' where it is exact)."""
    from trl.trainer.utils import add_fused_lm_head

    model = build("whisper")
    add_fused_lm_head(model)
    guard_model(model)
    docs = [doc for row in documents() for doc in row][:4]
    row = {"input_ids": [t for d in docs for t in d], "seq_lengths": [len(d) for d in docs]}
    batch = PaddingFreeCollator(0)([row])
    batch.pop("labels")
    out = model(**batch, labels=batch["input_ids"], fused_lm_head=True)
    assert tuple(out.log_probs.shape) == (1, batch["input_ids"].shape[1] - 1)  # a log-prob per next token
