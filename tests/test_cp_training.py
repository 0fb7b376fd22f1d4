"""Context parallelism for real: torchrun + gloo, tiny Llama fp32, one SGD step against one process.

CP = 2 (2 processes, in the default run), CP = 4 and CP = 2 × DP = 2 (4 processes, slow): the parameter
update of one optimizer step equals one process on the same global batch within 1e-5 relative, on rows with
documents shorter than 2·CP, one long document and a single-document row; every target token is counted once.
Negative controls, each visibly another step: the whole row split as one sequence (documents see each
other), labels shifted after the split, the loss averaged per rank.  A shard cut for another CP rank is
refused by name.
"""

from __future__ import annotations

from pathlib import Path

import _launch
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
from _cp_fixtures import BATCHES, tiny_llama_fp32  # noqa: E402
from _tp_worker import step_loss  # noqa: E402

from packtools import PaddingFreeCollator  # noqa: E402
from packtools.integrations.attention import segmented  # noqa: E402


def launch(tmp_path, nproc: int, cp: int, worker: str = "_cp_worker.py", *extra: str) -> list[dict]:
    _launch.torchrun(nproc, worker, str(cp), *extra, str(tmp_path), log=tmp_path / "torchrun.log")
    name = "trainer.pt" if "trainer" in worker else "result.pt"
    return torch.load(tmp_path / name, weights_only=False)


def reference_step(lr: float = 1.0):
    """One process, all rows of every batch in one padding-free batch, global token mean, one SGD step."""
    model = tiny_llama_fp32()
    model.set_attn_implementation(segmented.register())
    rows = [row for batch in BATCHES for row in batch]
    batch = PaddingFreeCollator(0)(rows)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss, count = step_loss(model, batch)  # the padding-free row's summed next-token loss, its targets
    (loss / count).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return {k: before[k] - p.detach() for k, p in model.named_parameters()}, count


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def check(results: list[dict], cp: int) -> None:
    want, count = reference_step()
    # Every target counted once: the ranks' targets sum to the one process's.
    assert sum(r["targets_local"] for r in results) == count
    assert all(r["cp_count"] == r["targets_local"] for r in results)
    for r in results:  # every rank ends the step with the same parameters, equal to one process's step
        assert rel(r["cp"], want) < 1e-5
        assert rel(r["cp_balanced"], want) < 1e-5  # the chunk pairs balanced per document: the same step
    for control in ("whole_row", "shift_after", "rank_mean"):
        assert rel(results[0][control], want) > 1e-3, control
    assert all("was cut for CP rank" in r["refused"] for r in results)


def test_cp2_step_equals_one_process(tmp_path):
    check(launch(tmp_path, 2, 2), 2)


@pytest.fixture(scope="module")
def four_process_runs(tmp_path_factory):
    """CP = 4, then CP = 2 × DP = 2, on 4 processes in one launch (one xdist group: one worker launches it)."""
    out = tmp_path_factory.mktemp("cp-4")
    _launch.torchrun(4, "_cp_worker.py", "4,2", str(out), log=out / "torchrun.log")
    return {cp: torch.load(out / f"result-{cp}.pt", weights_only=False) for cp in (4, 2)}


@pytest.mark.slow
@pytest.mark.xdist_group("cp_4")
def test_cp4_step_equals_one_process(four_process_runs):
    check(four_process_runs[4], 4)


@pytest.mark.slow
@pytest.mark.xdist_group("cp_4")
def test_cp2_dp2_step_equals_one_process(four_process_runs):
    check(four_process_runs[2], 2)


def trainer_runs(out: Path, nproc: int, cp: int, *gas: int) -> dict[int, list[dict]]:
    """``tests/_cp_trainer_worker.py``'s runs, one per accumulation count, in one launch of ``nproc``."""
    _launch.torchrun(nproc, "_cp_trainer_worker.py", str(cp), ",".join(map(str, gas)), str(out),
                     log=out / "torchrun.log")  # fmt: skip
    return {ga: torch.load(out / f"trainer-{ga}.pt", weights_only=False) for ga in gas}


@pytest.fixture(scope="module")
def two_process_trainer_runs(tmp_path_factory):
    """CP=2 on 2 processes, GA 1 and GA 2, in one launch (one xdist group: one worker launches it)."""
    return trainer_runs(tmp_path_factory.mktemp("cp-trainer-2"), 2, 2, 1, 2)


@pytest.mark.slow
@pytest.mark.xdist_group("cp_trainer_2")
@pytest.mark.parametrize(("nproc", "cp", "ga"), [(2, 2, 1), (2, 2, 2), (4, 2, 1)])
def test_trainer_cp_step_equals_one_process(tmp_path, request, nproc, cp, ga):
    """prepare_trainer(trainer, context_parallel=CP) under torchrun: CP=2 (with and without gradient
    accumulation) and CP=2 x DP=2, one Trainer step equal to one process on the same global batch."""
    want, _ = reference_step()
    if nproc == 2:
        results = request.getfixturevalue("two_process_trainer_runs")[ga]
    else:
        results = trainer_runs(tmp_path, nproc, cp, ga)[ga]
    assert all(r["impl"] == "packtools_cp" for r in results)
    assert all(rel(r["delta"], want) < 1e-5 for r in results)


def test_shard_attention_of_every_rank_equals_the_unsplit_row():
    """One process: each rank's shard attention over the keys of all ranks (what the all-gather hands it)
    equals the unsplit row's per-document causal attention, forward and backward (gpu_check's part 3 on the
    CPU reference); negative control: the same tokens laid out as one document (a whole-row split) differ."""
    from _scripts import script

    check_cp, cp_shard_outputs = script("gpu_check").check_cp, script("gpu_check").cp_shard_outputs

    from packtools.batches import varlen_attention

    rows, ok = check_cp(torch, "cpu", torch.float32, [], seed=0)
    assert ok and len(rows) == 2
    lengths = [3, 20, 1, 9]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, 8, generator=g) for h in (4, 2, 2))
    grad = torch.randn(sum(lengths), 4, 8, generator=g)
    cu = torch.tensor([0, 3, 23, 24, 33], dtype=torch.int32)
    ref = varlen_attention(q, k, v, cu, cu, 20, 20, causal=True)
    whole, _ = cp_shard_outputs(torch, q, k, v, [sum(lengths)], 2, "reference", grad)
    assert float((whole - ref).abs().max()) > 1e-2


def test_cp_attention_refuses_what_it_does_not_apply():
    """A sliding window (Mistral) and token-mixing layers would be silently ignored on a CP shard: refused."""
    import transformers
    from _hf_models import tiny_config

    from packtools.batches.context_parallel import shard_row
    from packtools.errors import PackingError
    from packtools.integrations.attention.context_parallel import use_cp_attention
    from packtools.integrations.parallel.shard_loss import model_inputs

    batch = shard_row(list(range(2, 14)), list(range(2, 14)), [5, 7], 1, 0, 0)
    batch = {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in batch.items()}
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**tiny_config(sliding_window=4)))
    use_cp_attention(mistral)
    with pytest.raises(PackingError, match="sliding_window"):
        mistral(**model_inputs(batch))
    llama = tiny_llama_fp32()
    use_cp_attention(llama)
    reference = tiny_llama_fp32()
    reference.set_attn_implementation(segmented.register())
    full = PaddingFreeCollator(0)([{"input_ids": list(range(2, 14)), "seq_lengths": [5, 7]}])
    with torch.no_grad():  # CP size 1: the shard is the row; equal to the segmented backend on the same row
        got = llama(**model_inputs(batch)).logits
        want = reference(
            input_ids=full["input_ids"],
            position_ids=full["position_ids"],
            cu_seq_lens_q=full["cu_seq_lens_q"],
            cu_seq_lens_k=full["cu_seq_lens_k"],
            max_length_q=7,
            max_length_k=7,
            use_cache=False,
        ).logits
    src = torch.from_numpy(batch["packtools_cp"].layout.source(0))
    assert torch.allclose(got[0, src >= 0], want[0, src[src >= 0]], atol=1e-5)
    conv = tiny_llama_fp32()
    conv.model.layers[0].mixer = torch.nn.Conv1d(4, 4, 3)  # a layer mixing tokens outside attention
    with pytest.raises(PackingError, match="mixes tokens outside attention"):
        use_cp_attention(conv)


def test_evaluation_under_cp_is_refused_by_name(tmp_path):
    """Trainer's evaluation and test loaders shard rows over every process, so CP peers would hold different rows
    while packtools_cp gathers them as one (finding 2: predict leaked across ranks): refused when scheduled and
    when called (evaluate, predict and both loaders), never run silently; without CP the same calls run."""
    import datasets
    import transformers

    from packtools.errors import PackingError
    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.trainers.context_parallel import prepare_context_parallel

    rows = datasets.Dataset.from_list([{"input_ids": list(range(2, 14)), "seq_lengths": [5, 7]}])

    def trainer(**args):
        return transformers.Trainer(
            tiny_llama_fp32(),
            transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **args),
            train_dataset=rows,
            eval_dataset=rows,
            data_collator=PaddingFreeCollator(0),
        )

    layout = RankLayout(dp_rank=0, dp_size=1)
    with pytest.raises(PackingError, match=r"evaluation under context_parallel.*eval_strategy='steps'"):
        prepare_context_parallel(trainer(eval_strategy="steps", eval_steps=1), layout)
    from packtools.integrations.trainers.step import SFTStep, StepPlan, install_step

    scheduled_none = trainer()
    install_step(scheduled_none, SFTStep, StepPlan(RankLayout(dp_rank=0, dp_size=1, cp_size=2)))
    for call, what in [
        (scheduled_none.evaluate, "evaluate"),
        (lambda: scheduled_none.predict(rows), "predict"),
        (scheduled_none.get_eval_dataloader, "evaluation"),
        (lambda: scheduled_none.get_test_dataloader(rows), "prediction"),
    ]:
        with pytest.raises(PackingError, match=rf"{what}.* under context_parallel"):
            call()
    plain = trainer(remove_unused_columns=False)  # negative control: the step owner without CP evaluates
    install_step(plain, SFTStep, StepPlan(layout))
    assert "eval_loss" in plain.evaluate()


def test_losses_the_cp_loss_would_leave_out_are_refused_by_name(tmp_path):
    """The CP loss is the shards' token loss: label smoothing, a loss function of the user's own and a MoE router
    loss would be dropped from it silently; each is refused by name."""
    import datasets
    import transformers

    from packtools.errors import PackingError
    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.trainers.context_parallel import check_cp_trainer

    rows = datasets.Dataset.from_list([{"input_ids": list(range(2, 14)), "seq_lengths": [5, 7]}])
    layout = RankLayout(dp_rank=0, dp_size=1, cp_size=2)

    def trainer(model=None, **args):
        return transformers.Trainer(
            model or tiny_llama_fp32(),
            transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, **args),
            train_dataset=rows,
            data_collator=PaddingFreeCollator(0),
        )

    check_cp_trainer(trainer(), layout)  # the plain case passes
    with pytest.raises(PackingError, match="label_smoothing_factor"):
        check_cp_trainer(trainer(label_smoothing_factor=0.1), layout)
    own = trainer()
    own.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum()
    with pytest.raises(PackingError, match="compute_loss_func of your own"):
        check_cp_trainer(own, layout)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2, output_router_logits=True,
    )  # fmt: skip
    with pytest.raises(PackingError, match="MoE router loss"):
        check_cp_trainer(trainer(transformers.MixtralForCausalLM(config)), layout)
    # The CP padding would be counted as input tokens (64 for 55, adversarial round): refused by name.
    with pytest.raises(PackingError, match="include_num_input_tokens_seen='all'"):
        check_cp_trainer(trainer(include_num_input_tokens_seen="all"), layout)
    with pytest.raises(PackingError, match="average_tokens_across_devices=False"):
        check_cp_trainer(trainer(average_tokens_across_devices=False), layout)
    no_kwargs = trainer()
    no_kwargs.model_accepts_loss_kwargs = False
    with pytest.raises(PackingError, match="takes no loss kwargs"):
        check_cp_trainer(no_kwargs, layout)


def test_a_cp_shard_is_refused_by_any_attention_but_packtools_cp():
    """Review C2: a shard given to sdpa / packtools_sdpa (or through packtools' guard) would attend only within
    this rank's chunks, silently; each path refuses it by name.  A shard whose layout disagrees with the rank it
    was cut for is refused too; negative control: the same shard on packtools_cp runs."""
    from packtools.batches.context_parallel import shard_row
    from packtools.errors import PackingError
    from packtools.integrations.attention.context_parallel import use_cp_attention
    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.parallel.shard_loss import model_inputs
    from packtools.integrations.trainers.guard import guard_model

    layout = RankLayout(dp_rank=0, dp_size=1)  # CP size 1: one process can run the shard for real
    batch = shard_row(list(range(2, 14)), list(range(2, 14)), [5, 7], 1, 0, 0, bound=layout)
    batch = {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in batch.items()}
    sdpa = tiny_llama_fp32()
    with pytest.raises(PackingError, match="reached a model on 'sdpa' attention"):
        model_inputs(batch, sdpa)
    guard_model(sdpa)
    with pytest.raises(PackingError, match="reached a model on 'sdpa' attention"), torch.no_grad():
        sdpa(**model_inputs(batch))
    ours = tiny_llama_fp32()
    ours.set_attn_implementation(segmented.register())
    with pytest.raises(PackingError, match="reached the packtools_sdpa attention"), torch.no_grad():
        ours(**model_inputs(batch))
    cp = tiny_llama_fp32()
    use_cp_attention(cp)
    with torch.no_grad():
        assert cp(**model_inputs(batch, cp)).logits.shape[1] == batch["input_ids"].shape[1]
    other = RankLayout(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    wrong = shard_row(list(range(2, 14)), list(range(2, 14)), [5, 7], 1, 0, 0, bound=other)
    wrong = {k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in wrong.items()}
    with pytest.raises(PackingError, match="carries a layout of rank 1 of 2"), torch.no_grad():
        cp(**model_inputs(wrong, cp))


def test_the_step_owner_binds_a_workers_shard_to_its_layout_and_refuses_another():
    """A shard cut in a data-loader worker comes back with a copy of the layout (pickled without its process
    group): the step owner binds it to its own layout again; a shard of another layout is refused by name."""
    import pickle

    from packtools.batches.context_parallel import shard_row
    from packtools.errors import PackingError
    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.trainers.step import StepPlan, cp_loss_inputs

    layout = RankLayout(dp_rank=0, dp_size=1, cp_rank=1, cp_size=2)
    plan = StepPlan(layout)
    copied = pickle.loads(
        pickle.dumps(shard_row(list(range(2, 14)), list(range(2, 14)), [5, 7], 2, 1, 0, bound=layout))
    )
    assert copied["packtools_cp"].bound is not layout
    assert cp_loss_inputs(copied, plan)["packtools_cp"].bound is layout
    other = RankLayout(dp_rank=1, dp_size=2, cp_rank=1, cp_size=2)
    for bound in (other, None):
        batch = shard_row(list(range(2, 14)), list(range(2, 14)), [5, 7], 2, 1, 0, bound=bound)
        with pytest.raises(PackingError, match="cut for another parallel layout"):
            cp_loss_inputs(batch, plan)
