"""The data-parallel rank and size of a run, read from accelerate's mesh (F3): TP/CP peers share batches.

In-process: the arithmetic over a real ``ParallelismConfig`` with a stand-in mesh (``get_local_rank`` of
each named dimension, what torch's ``DeviceMesh`` answers), DeepSpeed AutoTP, ``RankLayout.from_mesh`` and
the refusals by name.  accelerate itself refuses ``ParallelismConfig`` on CPU ("only compatible with FSDP2,
Multi{Device} or DeepSpeed, got MULTI_CPU"), so no real ``Accelerator`` with a TP mesh runs here; torch's own
TP over a real ``DeviceMesh`` (gloo, 2 and 4 processes) fed through ``RankLayout.from_mesh`` is
``tests/test_tp_training.py``.
"""

from types import SimpleNamespace as NS

import pytest

from packtools.errors import PackingError
from packtools.integrations.parallel.layout import RankLayout, rank_layout
from packtools.integrations.trainers.loader import make_sampler

accelerate = pytest.importorskip("accelerate")
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402


class Mesh:
    """Stand-in for torch's DeviceMesh over processes laid out as accelerate builds it (row-major)."""

    def __init__(self, names, shape, index):
        self.mesh_dim_names, self.shape, self.index = names, shape, index

    def get_local_rank(self, dim):
        coords, rest = {}, self.index
        for name, size in reversed(list(zip(self.mesh_dim_names, self.shape))):
            coords[name], rest = rest % size, rest // size
        return coords[dim]


def trainer(index, world, config=None, mesh=None, deepspeed=None):
    accelerator = NS(parallelism_config=config, torch_device_mesh=mesh)
    if deepspeed is not None:
        accelerator.state = NS(deepspeed_plugin=NS(deepspeed_config=deepspeed))
    args = NS(world_size=world, process_index=index, seed=0, data_seed=None, per_device_train_batch_size=2)
    return NS(args=args, accelerator=accelerator, is_deepspeed_enabled=deepspeed is not None)


def test_plain_processes_are_the_data_parallel_group():
    assert rank_layout(trainer(3, 4)) == RankLayout(3, 4)


def test_tensor_parallel_peers_share_a_data_parallel_rank():
    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    layouts = [rank_layout(trainer(i, 4, config, Mesh(("dp_shard", "tp"), (2, 2), i))) for i in range(4)]
    assert [(lay.dp_rank, lay.dp_size, lay.tp_size) for lay in layouts] == [
        (0, 2, 2),
        (0, 2, 2),
        (1, 2, 2),
        (1, 2, 2),
    ]
    # The per-rank loaders: TP peers draw the same batches, the two DP ranks disjoint ones.
    batches = [list(make_sampler(trainer(i, 4, config), range(10), None, layouts[i])) for i in range(4)]
    assert batches[0] == batches[1] and batches[2] == batches[3]
    assert not {i for b in batches[0] for i in b} & {i for b in batches[2] for i in b}
    # Negative control: the process count as the DP group gives TP peers different rows.
    wrong = [list(make_sampler(trainer(i, 4), range(10), None, RankLayout(i, 4))) for i in range(2)]
    assert wrong[0] != wrong[1]


def test_hybrid_replicate_and_shard_ranks():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    names, shape = ("dp_replicate", "dp_shard", "tp"), (2, 2, 2)
    ranks = [rank_layout(trainer(i, 8, config, Mesh(names, shape, i))).dp_rank for i in range(8)]
    assert ranks == [0, 0, 1, 1, 2, 2, 3, 3]


def test_deepspeed_autotp():
    ds = {"tensor_parallel": {"autotp_size": 2}}
    assert [rank_layout(trainer(i, 4, deepspeed=ds)).dp_rank for i in range(4)] == [0, 0, 1, 1]
    assert rank_layout(trainer(1, 4, deepspeed={})).dp_rank == 1


def test_packtools_context_parallel_groups_consecutive_processes():
    layouts = [rank_layout(trainer(i, 4), context_parallel=2) for i in range(4)]
    assert [(lay.dp_rank, lay.cp_rank) for lay in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(PackingError, match="context_parallel=3 does not divide the 4 processes"):
        rank_layout(trainer(0, 4), context_parallel=3)


def test_unhandled_layouts_are_refused_by_name():
    cp = ParallelismConfig(dp_shard_size=2, cp_size=2)
    mesh = Mesh(("dp_shard", "cp"), (2, 2), 0)
    with pytest.raises(PackingError, match=r"cp_size=2.*accelerate's context parallelism"):
        rank_layout(trainer(0, 4, cp, mesh))
    # with packtools' own CP asked for too: still refused (Trainer would run accelerate's CP on top of it)
    for size in (2, 4):
        with pytest.raises(PackingError, match=r"cp_size=2.*set cp_size=1 and pass"):
            rank_layout(trainer(3, 4, cp, Mesh(("dp_shard", "cp"), (2, 2), 3)), context_parallel=size)
    tp = ParallelismConfig(tp_size=2)
    with pytest.raises(PackingError, match=r"context_parallel=2 with an accelerate ParallelismConfig \(tp=2"):
        rank_layout(trainer(0, 2, tp, Mesh(("tp",), (2,), 0)), context_parallel=2)  # never dropped silently
    with pytest.raises(PackingError, match=r"sp_size=2.*Ulysses"):
        rank_layout(trainer(0, 2, ParallelismConfig(sp_size=2), mesh))
    with pytest.raises(PackingError, match="no device mesh"):
        rank_layout(trainer(0, 2, ParallelismConfig(tp_size=2), None))
    with pytest.raises(PackingError, match="does not cover the 4 processes"):
        rank_layout(trainer(0, 4, ParallelismConfig(tp_size=2), Mesh(("tp",), (2,), 0)))


def test_layout_from_a_torch_device_mesh():
    """A plain loop's layout from the mesh itself: data-parallel dimensions row-major, TP/CP peers share."""
    layouts = [RankLayout.from_mesh(Mesh(("dp", "tp"), (2, 2), i)) for i in range(4)]
    assert [(lay.dp_rank, lay.dp_size, lay.tp_size) for lay in layouts] == [
        (0, 2, 2),
        (0, 2, 2),
        (1, 2, 2),
        (1, 2, 2),
    ]
    names, shape = ("dp_replicate", "dp_shard", "cp", "tp"), (2, 2, 2, 2)
    layouts = [RankLayout.from_mesh(Mesh(names, shape, i)) for i in range(16)]
    assert [lay.dp_rank for lay in layouts] == [i // 4 for i in range(16)]
    assert [lay.cp_rank for lay in layouts] == [(i // 2) % 2 for i in range(16)]
    assert {(lay.dp_size, lay.cp_size, lay.tp_size, lay.world) for lay in layouts} == {(4, 2, 2, 16)}
    assert RankLayout.from_mesh(Mesh(("tp",), (2,), 1)) == RankLayout(
        0, 1, tp_size=2, source="torch DeviceMesh"
    )
    # The same answer as accelerate's mesh read through its ParallelismConfig.
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    mesh_names, mesh_shape = ("dp_replicate", "dp_shard", "tp"), (2, 2, 2)
    for i in range(8):
        via_accelerate = rank_layout(trainer(i, 8, config, Mesh(mesh_names, mesh_shape, i)))
        via_torch = RankLayout.from_mesh(Mesh(mesh_names, mesh_shape, i))
        assert (via_torch.dp_rank, via_torch.dp_size) == (via_accelerate.dp_rank, via_accelerate.dp_size)
    # A dimension packtools cannot place (pipeline stages, experts, unnamed) is refused by name.
    with pytest.raises(PackingError, match=r"\('dp', 'pp'\).*\['pp'\] it does not know"):
        RankLayout.from_mesh(Mesh(("dp", "pp"), (2, 2), 0))
    with pytest.raises(PackingError, match="unnamed"):
        RankLayout.from_mesh(Mesh(None, (2,), 0))


def test_prepare_dpo_trainer_refuses_accelerates_context_parallelism_by_name(tmp_path):
    pytest.importorskip("trl")
    from test_dpo import build

    from packtools import prepare_dpo_trainer

    trainer = build(tmp_path)
    config = ParallelismConfig(dp_shard_size=1, cp_size=2)
    trainer.accelerator.state.parallelism_config = config  # what accelerate holds under a CP launch
    try:
        with pytest.raises(
            PackingError,
            match=r"cp_size=2.*accelerate's context parallelism.*pair's sequences.*context_parallel=2 to.*prepare_dpo_trainer",
        ):
            prepare_dpo_trainer(trainer)
    finally:
        trainer.accelerator.state.parallelism_config = None
    assert trainer.model.config._attn_implementation == "sdpa"  # left as TRL built it


def test_a_trainer_counting_fewer_processes_than_the_process_group_is_refused(monkeypatch):
    """DeepSpeed on the CPU (2 gloo processes): TrainingArguments.world_size and the accelerator said 1 on both,
    so no loader sharded the rows and one epoch trained every row on both processes while DeepSpeed averaged the
    gradients over 2, with no error.  Failed before: rank_layout gave RankLayout(0, 1)."""
    dist = pytest.importorskip("torch.distributed")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(
        PackingError, match=r"counts 1 process.*torch.distributed runs 2.*2 times per epoch"
    ) as err:
        rank_layout(trainer(0, 1, deepspeed={}))
    assert err.value.param == "world_size"
    assert "DeepSpeed averages the gradients" in str(err.value)
    # torchrun with gloo on the CPU without use_cpu=True: accelerate's state is NO, so no DDP averages anything;
    # the refusal said "the gradients are averaged over all 2" there too
    with pytest.raises(
        PackingError, match=r"torch.distributed runs 2.*2 copies of one run.*use_cpu=True"
    ) as err:
        rank_layout(trainer(0, 1))
    assert "averag" not in str(err.value)
    assert rank_layout(trainer(1, 2)) == RankLayout(1, 2)  # the group and the trainer agree: nothing refused
