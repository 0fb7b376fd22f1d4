"""Loss normalizations under packing (``prepare_trainer(..., loss="token" | "sample" | "sqrt")``).

Each mode is defined by the unpacked computation: every document of the global batch run alone through the
model, its token losses weighted ``n_i ** (p - 1)`` and the sum divided by ``sum_i n_i ** p`` (``n_i`` its
targets; ``p`` 1, 0, 1/2).  One ``Trainer`` optimizer step on packed rows (SGD lr 1, no clipping: the parameter
change is the gradient) must give that loss and every gradient within 1e-5 (fp32, CPU): in one process with
gradient accumulation, under 2 processes (torchrun, gloo) with accumulation, and under context parallelism 2.
Negative control: the token mean where the sample mean was asked differs.  Also here, the adversarial round's
regressions of the CP trainer path: a subclass's ``compute_loss`` honoured (``loss * 0.0`` moves nothing), and
``predict`` refused by name.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import _launch  # noqa: E402
from _cp_fixtures import BATCHES, tiny_llama_fp32  # noqa: E402
from _loss_modes_trainer_worker import run_step  # noqa: E402

from packtools.errors import PackingError  # noqa: E402

ROWS = [row for batch in BATCHES for row in batch]
P = {"token": 1.0, "sample": 0.0, "sqrt": 0.5}


def unpacked(mode: str):
    """``(loss, {name: gradient})`` of the mode computed document by document (no packing at all)."""
    model = tiny_llama_fp32()
    p = P[mode]
    sums, counts = [], []
    for row in ROWS:
        start = 0
        for length in row["seq_lengths"]:
            doc = torch.tensor(row["input_ids"][start : start + length])[None]
            start += length
            if length < 2:
                continue  # nothing predicted: weighs nothing in any mode
            logits = model(input_ids=doc, use_cache=False).logits[0, :-1]
            sums.append(torch.nn.functional.cross_entropy(logits, doc[0, 1:], reduction="sum"))
            counts.append(length - 1)
    n = torch.tensor(counts, dtype=torch.float32)
    loss = sum(s * w for s, w in zip(sums, n.pow(p - 1.0), strict=True)) / n.pow(p).sum()
    loss.backward()
    return float(loss), {k: q.grad.detach().clone() for k, q in model.named_parameters()}


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def trainer_step(tmp_path, mode: str, ga: int = 2, cls=None, **prepare):
    """One optimizer step in one process: ``(loss, {name: parameter change})``."""
    cp = prepare.pop("context_parallel", None)
    result, _ = run_step(tmp_path, cp, ga, 1, mode, cls, **prepare)
    return result["loss"], result["delta"]


@pytest.fixture(scope="module")
def reference():
    return {mode: unpacked(mode) for mode in P}


@pytest.mark.parametrize("mode", list(P))
@pytest.mark.parametrize("max_tokens", [None, 128])
def test_each_mode_equals_the_unpacked_computation(tmp_path, reference, mode, max_tokens):
    """One process, 2 micro-batches (rows, or token-budget batches): loss and every gradient within 1e-5."""
    loss, delta = trainer_step(tmp_path, mode, max_tokens=max_tokens)
    want_loss, want = reference[mode]
    assert abs(loss - want_loss) < 1e-5 * max(1.0, abs(want_loss))
    assert rel(delta, want) < 1e-5
    assert max(float((delta[k] - want[k]).abs().max()) for k in want) < 1e-5


def test_the_modes_differ_negative_control(reference):
    """The token mean where the sample mean was asked is another step (and sqrt lies between)."""
    assert rel(reference["token"][1], reference["sample"][1]) > 1e-2
    assert rel(reference["sqrt"][1], reference["sample"][1]) > 1e-3
    assert rel(reference["sqrt"][1], reference["token"][1]) > 1e-3


def test_a_loss_of_the_trainers_own_is_refused_with_sample_and_sqrt(tmp_path):
    """sample/sqrt are computed by packtools: a compute_loss override, compute_loss_func or label smoothing would
    be replaced, so each is refused by name; with loss='token' the override is honoured."""

    class Halved(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 0.5

    with pytest.raises(PackingError, match=r"loss='sample'.*Halved.compute_loss"):
        trainer_step(tmp_path, "sample", cls=Halved)
    with pytest.raises(PackingError, match="loss must be one of"):
        trainer_step(tmp_path, "mean")
    _, delta = trainer_step(tmp_path, "token", cls=Halved)  # honoured: half the token step
    _, full = trainer_step(tmp_path, "token")
    assert rel(delta, {k: v * 0.5 for k, v in full.items()}) < 1e-5


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_context_parallel_must_be_a_positive_int(tmp_path, bad):
    with pytest.raises(PackingError, match="context_parallel must be a positive int"):
        trainer_step(tmp_path, "token", context_parallel=bad)


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """DP=2 and CP=2, both with accumulation 2, in one torchrun launch (one xdist group: one worker launches it)."""
    out = tmp_path_factory.mktemp("loss-modes-2")
    _launch.torchrun(2, "_loss_modes_trainer_worker.py", "1,2", "2", str(out), log=out / "torchrun.log")
    return {cp: torch.load(out / f"trainer-{cp}.pt", weights_only=False) for cp in (1, 2)}


@pytest.mark.xdist_group("loss_modes_2")
@pytest.mark.parametrize(("cp", "ga"), [(1, 2), (2, 2)])
def test_modes_under_two_processes_equal_the_unpacked_computation(
    tmp_path, reference, two_process_runs, cp, ga
):
    """torchrun, 2 processes: DP=2 with accumulation, and CP=2 with accumulation.  The parameters every rank
    ends with equal the unpacked step in every mode; the sample mean is not the token mean (negative control).
    Under CP=2 also: a subclass's compute_loss of ``loss * 0.0`` moves no parameter (it moved them by 0.16:
    finding 1), ``loss * 0.25`` gives a quarter of the step, predict is refused by name (finding 2), and a
    compute_loss that shifts the labels itself is refused by name, and so is any forward of the shard's tokens
    without its CP key (a compute_loss's, a teacher's, a training_step's); a teacher given the key is not."""
    results = two_process_runs[cp]
    for mode in P:
        want_loss, want = reference[mode]
        for r in results:
            assert rel(r[mode]["delta"], want) < 1e-5, mode
        # Trainer's logged loss is each process's share times the process count: their mean is the step's loss.
        assert abs(sum(r[mode]["loss"] for r in results) / len(results) - want_loss) < 1e-5 * want_loss
    assert rel(results[0]["sample"]["delta"], reference["token"][1]) > 1e-2
    if cp > 1:
        for r in results:
            assert max(float(d.abs().max()) for d in r["frozen"]["delta"].values()) == 0.0
            quarter = {k: v * 0.25 for k, v in r["token"]["delta"].items()}
            assert rel(r["quarter"]["delta"], quarter) < 1e-5
            assert r["predict"].startswith("PackingError: predict() under context_parallel")
            # a compute_loss of its own shifting the labels again (CP's are the shard's shifted targets) trained
            # each token on the token two ahead without an error (1.23 relative off the step): refused by name
            assert r["own_shift"].startswith("PackingError: OwnShift.compute_loss called the model"), r[
                "own_shift"
            ]
            # the shard forwarded without its CP key attended as if its chunks were adjacent (loss 4.49 for 4.52
            # on rank 0), with no error: refused by name
            assert r["own_nokey"].startswith("PackingError: OwnNoKey.compute_loss called the model"), r[
                "own_nokey"
            ]
            # the shard's tokens without the key in other forms and from other places trained with wrong
            # attention too, with no error (before: the embeddings 0.78 relative off the step of one process; a
            # sliced copy, a teacher given the shard's ids and positions, a training_step's forward: logits 0.5
            # off the keyed forward's): the guard refuses them all by name (check_packed_ids_forward)
            for name, owner in (
                ("own_embeds", "OwnEmbeds.compute_loss"),
                ("own_slice", "OwnSlice.compute_loss"),
                ("taught", "Taught.compute_loss"),
                ("own_step", "OwnStep.training_step"),
            ):
                assert r[name].startswith(f"PackingError: {owner} called the model on a context-parallel"), r[
                    name
                ]
            # a teacher on packtools_cp given the key is right (the student's logits) and trains the token step
            assert r["taught_keyed"]["gap"] < 1e-5
            assert rel(r["taught_keyed"]["delta"], r["token"]["delta"]) < 1e-6
        # TRL's SFTTrainer(loss_type="dft") under CP=2 trains DFT (it trained plain NLL: finding 1), equal to
        # the same trainer in one process without CP; negative control: DFT is not the NLL step.
        want_dft = run_step(tmp_path, None, ga, 1, dft=True)[0]["delta"]
        for r in results:
            assert rel(r["dft"]["delta"], want_dft) < 1e-5
        assert rel(want_dft, reference["token"][1]) > 1e-2


def test_every_other_loss_is_named_by_the_sample_and_sqrt_refusal():
    """A compute_loss_func of the user's own, Trainer's label smoother and a MoE router loss: each named in the
    refusal of loss='sample' (the same list the CP check refuses); a plain trainer passes."""
    from types import SimpleNamespace

    from packtools.integrations.trainers.step import check_loss_owner, other_losses

    moe = SimpleNamespace(
        get_text_config=lambda: SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.1)
    )

    def trainer(compute_loss_func=None, label_smoother=None, config=None):
        model = SimpleNamespace(config=config) if config else SimpleNamespace()
        args = SimpleNamespace(loss_type=None)
        return SimpleNamespace(
            compute_loss_func=compute_loss_func, label_smoother=label_smoother, model=model, args=args
        )

    assert other_losses(trainer()) == []
    check_loss_owner(trainer(), "sample")
    everything = trainer(lambda *a, **k: 0.0, object(), moe)
    assert len(other_losses(everything)) == 3
    with pytest.raises(
        PackingError,
        match=r"loss='sqrt'.*compute_loss_func of your own; label_smoothing_factor > 0 .*; a MoE router loss",
    ):
        check_loss_owner(everything, "sqrt")
    check_loss_owner(everything, "token")  # the trainer's own loss: honoured
