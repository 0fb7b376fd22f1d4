"""An own-loop context-parallel run refuses on every rank of the CP group or on none.

The guard's first-batch probe ran on the first batch whose positions restart on *this* rank; under CP a rank
holding the middle chunks of a document sees no restart, so on a family the probe refuses (OPT) rank 0 raised
while rank 1 went on into the CP attention's all-gather and waited for it (a hang until the collective's
timeout; here gloo reported the peer gone).  Now the first CP shard is probed on every rank and the verdict
agreed over the CP group before anyone raises; the length-dependent RoPE check judges every rank's positions
from the layout they share (tests/test_family_sweep.py).  Two processes, gloo, CPU."""

from __future__ import annotations

import datetime

import _launch
import pytest

pytestmark = pytest.mark.slow  # two spawned processes (gloo)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROW = {
    "input_ids": [5, 6, 7, 8],
    "seq_lengths": [4],
}  # one document: rank 1's chunks (positions 1, 2) never restart


def _model(family):
    torch.manual_seed(0)
    if family == "opt":
        config = transformers.OPTConfig(
            vocab_size=97, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=32, pad_token_id=0,
        )  # fmt: skip
        return transformers.OPTForCausalLM._from_config(config, attn_implementation="sdpa").float()
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").float()


#: (model family, the rank whose probe alone is made to fail, or -1, and how: "refuse" raises a PackingError,
#: "crash" a RuntimeError): run in turn by the same two processes.
SCENARIOS = (("opt", -1, ""), ("llama", 0, "refuse"), ("llama", -1, ""), ("llama", 0, "crash"))


def _worker(rank, store, queue):
    import torch.distributed as dist

    # a file store in the test's own folder: no port to pick, none another process could take or share
    init = f"file://{store}"
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    from packtools import PaddingFreeCollator
    from packtools.batches.context_parallel import ContextParallelCollator
    from packtools.errors import PackingError
    from packtools.integrations.attention import isolation
    from packtools.integrations.attention.context_parallel import use_cp_attention
    from packtools.integrations.parallel.layout import RankLayout
    from packtools.integrations.parallel.shard_loss import model_inputs
    from packtools.integrations.trainers.guard import guard_model

    def refuse(*args, **kwargs):
        raise PackingError("a probe refusal on this rank only")

    def crash(*args, **kwargs):
        raise RuntimeError("a probe crash on this rank only")

    real = isolation.check_isolation
    layout = RankLayout(dp_rank=0, dp_size=1, cp_rank=rank, cp_size=2).with_cp_group()
    for index, (family, fail_on, how) in enumerate(SCENARIOS):
        # this rank's probe alone fails: the agreement, not the model, is under test
        isolation.check_isolation = {"refuse": refuse, "crash": crash}[how] if rank == fail_on else real
        model = _model(family).train()
        use_cp_attention(model)
        guard_model(model)
        batch = ContextParallelCollator(PaddingFreeCollator(0), layout=layout)([ROW])
        try:
            model(**model_inputs(batch, model))
            queue.put((index, rank, "trained", batch["position_ids"].tolist()))
        except PackingError as err:
            queue.put((index, rank, "PackingError", str(err)))
        except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it unless expected
            queue.put((index, rank, type(err).__name__, str(err)[:300]))
            if "on this rank only" not in str(err):
                break
        dist.barrier()  # both ranks report before the next scenario
    # rank 0 alone checks a plain packed batch first (no CP: its probe passes, on rank 0 only); the first CP shard
    # must still be agreed on by both ranks (before: rank 0 skipped the CP probe as done, and rank 1 waited in
    # the agreement's all-reduce while rank 0 went on into the all-gather)
    isolation.check_isolation = real
    model = _model("llama").train()
    use_cp_attention(model)
    guard_model(model)
    if rank == 0:
        model(**PaddingFreeCollator(0)([dict(ROW, seq_lengths=[2, 2])]))
    batch = ContextParallelCollator(PaddingFreeCollator(0), layout=layout)([ROW])
    try:
        model(**model_inputs(batch, model))
        queue.put((len(SCENARIOS), rank, "trained", ""))
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails on it
        queue.put((len(SCENARIOS), rank, type(err).__name__, str(err)[:300]))
    dist.destroy_process_group()


def test_every_rank_of_the_cp_group_refuses_or_none_does(tmp_path):
    """OPT (which the probe refuses) is refused on both ranks, rank 1's positions restarting nowhere; a refusal
    of rank 0's probe alone is agreed on by rank 1, and so is any other error of it (a RuntimeError: before,
    rank 0 raised past the agreement and rank 1 waited in its all-reduce until gloo's timeout); a model the
    probe accepts trains on both.  Failed before:
    rank 0 refused OPT and rank 1 waited in the CP attention's all-gather (gloo then reported rank 0 gone, or
    the test's timeout a hang)."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, tmp_path / "store", queue)) for r in range(2)]
    got = {}
    with _launch.launch_lock():  # never alongside another multi-process job of the run (tests/_launch.py)
        for p in procs:
            p.start()
        try:
            while len(got) < 2 * (len(SCENARIOS) + 1):
                index, rank, what, detail = queue.get(
                    timeout=240
                )  # nothing within it: a hang, the test fails
                got[index, rank] = (what, detail)
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
    for rank in (0, 1):
        what, detail = got[0, rank]
        assert what == "PackingError" and "OPTForCausalLM does not keep packed sequences apart" in detail, got
    assert got[1, 0][0] == "PackingError" and "this rank only" in got[1, 0][1], got
    assert got[1, 1][0] == "PackingError" and "on another rank of the CP group" in got[1, 1][1], got
    assert got[2, 0][0] == got[2, 1][0] == "trained", got
    assert got[2, 1][1] == [[1, 2]]  # rank 1's positions restart nowhere: it was probed all the same
    # rank 0's probe raised no PackingError (before: rank 0 raised past the agreement's all-reduce, and rank 1
    # waited in it for ever): rank 0 raises its own error, rank 1 a PackingError naming the other rank
    assert got[3, 0] == ("RuntimeError", "a probe crash on this rank only"), got
    assert got[3, 1][0] == "PackingError" and "on another rank of the CP group" in got[3, 1][1], got
    last = len(SCENARIOS)  # a plain packed batch probed on rank 0 alone first: the CP shard still agreed
    assert got[last, 0][0] == got[last, 1][0] == "trained", got
