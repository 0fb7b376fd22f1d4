"""Which processes of a run read the same batch: the data-parallel and context-parallel ranks, from the mesh.

Under accelerate's ``ParallelismConfig`` (tensor parallelism ``tp``, context parallelism ``cp``, sharded or
replicated data parallelism ``dp_shard`` / ``dp_replicate``) or DeepSpeed AutoTP, only the data-parallel
group reads different rows: tensor- and context-parallel peers must receive the *same* batch (they all-reduce
partial results of it, or hold pieces of it).  :func:`rank_layout` reads that layout once, from the public
state accelerate keeps (``Accelerator.parallelism_config``, ``Accelerator.torch_device_mesh`` and its
``get_local_rank``, DeepSpeed's ``tensor_parallel.autotp_size``), and hands it on as a :class:`RankLayout`
value: the per-rank loaders shard over ``dp_size`` at ``dp_rank``, and losses that DDP averages are scaled by
``dp_size``, never by the world size.  Without accelerate (a plain loop over torch's own tensor parallelism,
``parallelize_module`` on a ``DeviceMesh``), :meth:`RankLayout.from_mesh` reads the same from the mesh's named
dimensions; hand ``layout.dp_size`` / ``layout.dp_rank`` to the sampler as ``num_replicas`` / ``rank``.

A layout packtools does not handle is refused by name, never sharded silently: accelerate's own context
parallelism (torch's ``context_parallel`` shards a packed row as one causal sequence), DeepSpeed sequence
parallelism, a mesh whose sizes do not multiply to the world size (or a ``ParallelismConfig`` without one), and
torch's own tensor parallelism that neither accelerate nor DeepSpeed describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from ...errors import PackingError


@dataclass(frozen=True)
class RankLayout:
    """This process's place in the run: which data-parallel shard it reads and which context-parallel piece.

    ``world = dp_size * cp_size * tp_size``; processes with the same ``dp_rank`` read the same batch.

    It is the one owner of the run's parallel layout: besides the ranks it holds this process's
    context-parallel process group (``cp_group``, created once by :meth:`with_cp_group`, or the mesh's ``cp``
    group) and the balance choice (``balance``: each document's chunk pairs given to the ranks by their work,
    which ``packtools_cp`` reads from the shard).  The sampler, the CP collator (``ContextParallelCollator(...,
    layout=layout)``), the attention (through the shards the collator cuts, which carry the layout) and the
    loss all take it from here.

    >>> RankLayout(dp_rank=1, dp_size=2, tp_size=2).peers
    2
    """

    dp_rank: int
    dp_size: int
    cp_rank: int = 0
    cp_size: int = 1
    tp_size: int = 1
    source: str = "processes"
    balance: bool = True
    cp_group: Any = field(default=None, compare=False, repr=False)

    @property
    def peers(self) -> int:
        """How many processes read each batch (tensor- and context-parallel peers)."""
        return self.cp_size * self.tp_size

    @property
    def world(self) -> int:
        return self.dp_size * self.peers

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled without its process group (a group does not cross processes: a data-loader worker's shards
        come back carrying the layout's ranks, and the step owner binds them to its own layout again)."""
        return (type(self), tuple(getattr(self, f.name) for f in fields(self) if f.name != "cp_group"))

    def with_cp_group(self) -> RankLayout:
        """This layout with its CP process group created (consecutive processes ``[dp_rank * N, (dp_rank + 1) *
        N)``; every rank creates every group, in order, as ``torch.distributed.new_group`` requires).  One
        process, or ``cp_size == 1``: the layout itself (no group is needed)."""
        if self.cp_size == 1 or self.world == 1 or self.cp_group is not None:
            return self
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise PackingError(
                f"context_parallel={self.cp_size} over {self.world} processes needs torch.distributed initialized "
                f"(launch with torchrun / accelerate launch).",
                param="context_parallel",
            )
        mine = None
        for dp in range(self.dp_size):
            group = dist.new_group(list(range(dp * self.cp_size, (dp + 1) * self.cp_size)))
            if dp == self.dp_rank:
                mine = group
        return replace(self, cp_group=mine)

    @classmethod
    def from_mesh(cls, mesh: Any) -> RankLayout:
        """This process's layout on a torch ``DeviceMesh`` (a plain loop or torch's TP without accelerate).

        The mesh's named dimensions decide: ``dp`` / ``dp_replicate`` / ``dp_shard`` are data-parallel (the
        rank over them row-major, as the mesh lays them out), ``tp`` and ``cp`` are peers that read the same
        batch.  Any other dimension (``pp``, ``ep``, an unnamed mesh) is refused by name: packtools will not
        guess whether its processes share a batch.  Give the sampler ``num_replicas=layout.dp_size,
        rank=layout.dp_rank``.
        """
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        shape = tuple(int(s) for s in getattr(mesh, "shape", ()))
        unknown = [n for n in names if n not in _DP_DIMS + ("tp", "cp")]
        if not names or len(names) != len(shape) or unknown or len(set(names)) != len(names):
            raise PackingError(
                f"a DeviceMesh with dimensions {names or 'unnamed'} (shape {shape}): packtools reads the "
                f"data-parallel rank from dimensions named {', '.join(_DP_DIMS)} and the batch-sharing peers from "
                f"'tp' and 'cp'; {unknown or 'unnamed or repeated dimensions'} it does not know. Name the mesh's "
                f"dimensions (init_device_mesh(..., mesh_dim_names=...)) with these names only.",
                param="mesh",
            )
        size = dict(zip(names, shape))
        dp_rank, dp_size = 0, 1
        for name in names:
            if name in _DP_DIMS:
                dp_rank, dp_size = dp_rank * size[name] + _mesh_rank(mesh, names, name), dp_size * size[name]
        return cls(
            dp_rank=dp_rank,
            dp_size=dp_size,
            cp_rank=_mesh_rank(mesh, names, "cp"),
            cp_size=size.get("cp", 1),
            tp_size=size.get("tp", 1),
            source="torch DeviceMesh",
            cp_group=_mesh_group(mesh, "cp") if size.get("cp", 1) > 1 else None,
        )


#: Mesh dimensions that are data-parallel (accelerate's names and torch's usual ``dp``).
_DP_DIMS = ("dp", "dp_replicate", "dp_shard")


def _size(config: Any, name: str) -> int:
    value = getattr(config, name, 1)
    return 1 if value is None else int(value)


def _mesh_group(mesh: Any, dim: str) -> Any:
    """The process group of ``mesh``'s dimension ``dim`` (``DeviceMesh.get_group``; ``None`` without one)."""
    get = getattr(mesh, "get_group", None)
    return get(dim) if callable(get) else None


def _mesh_rank(mesh: Any, names: tuple[str, ...], dim: str) -> int:
    return int(mesh.get_local_rank(dim)) if dim in names else 0


def _from_parallelism_config(accelerator: Any, config: Any, context_parallel: int | None) -> RankLayout:
    tp, cp, sp = _size(config, "tp_size"), _size(config, "cp_size"), _size(config, "sp_size")
    replicate, shard = _size(config, "dp_replicate_size"), _size(config, "dp_shard_size")
    if sp > 1:
        raise PackingError(
            f"ParallelismConfig(sp_size={sp}): DeepSpeed sequence parallelism (Ulysses) splits rows with its own "
            f"all-to-all, a layout packtools does not check for packed rows. Use packtools' context parallelism "
            f"(prepare_trainer(..., context_parallel=N)) with sp_size=1.",
            param="parallelism_config",
        )
    if cp > 1:  # with or without context_parallel: Trainer would run accelerate's CP on top of packtools'
        raise PackingError(
            f"ParallelismConfig(cp_size={cp}): accelerate's context parallelism (torch's context_parallel) shards a "
            f"packed row as one causal sequence, so its documents (or a pair's sequences) attend to each other. "
            f"Let packtools shard the rows per document: set cp_size=1 and pass context_parallel={cp} to "
            f"prepare_trainer or prepare_dpo_trainer.",
            param="parallelism_config",
        )
    if context_parallel not in (None, 1):  # never dropped: packtools' CP groups are not on accelerate's mesh
        raise PackingError(
            f"context_parallel={context_parallel} with an accelerate ParallelismConfig (tp={tp}, "
            f"dp_shard={shard}, dp_replicate={replicate}): packtools' CP groups are consecutive processes, which "
            f"that device mesh does not know. Use context_parallel with plain DDP processes (no "
            f"ParallelismConfig), or the mesh without context_parallel.",
            param="context_parallel",
        )
    mesh = getattr(accelerator, "torch_device_mesh", None)
    if mesh is None or not hasattr(mesh, "get_local_rank"):
        raise PackingError(
            f"the accelerator has a ParallelismConfig (tp={tp}, cp={cp}) but no device mesh to read the "
            f"data-parallel rank from; packtools will not guess which processes share a batch.",
            param="parallelism_config",
        )
    # accelerate's mesh: a DeviceMesh over its enabled dimensions (dp_replicate, dp_shard, tp), read as any other
    return replace(RankLayout.from_mesh(mesh), source="ParallelismConfig device mesh")


def _refuse_unknown_mesh(model: Any) -> None:
    """Refuse a model split by torch's own tensor parallelism (DTensor parameters over a mesh of several
    processes, not only data-parallel dimensions) that neither accelerate's ``ParallelismConfig`` nor DeepSpeed
    describes: the processes would be taken for data-parallel replicas, and TP peers would read different rows.
    (Not called under FSDP, whose DTensors are sharded over the data-parallel processes.)"""
    import sys

    tensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor can exist
    if tensor is None or model is None or not hasattr(model, "parameters"):
        return
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None) if isinstance(param, tensor.DTensor) else None
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh is not None and mesh.size() > 1 and not (names and set(names) <= set(_DP_DIMS)):
            raise PackingError(
                f"the model's parameters are DTensors over a device mesh of {mesh.size()} processes (dimensions "
                f"{names or 'unnamed'}, shape {tuple(mesh.shape)}: torch's tensor parallelism, parallelize_module) "
                f"that the trainer's accelerator does not know, so every process would be taken for a "
                f"data-parallel replica and tensor-parallel peers would read different rows. Describe the layout "
                f"to accelerate (TrainingArguments(parallelism_config=ParallelismConfig(tp_size=...))), or train "
                f"in a plain loop with the sampler sharded by packtools.integrations.RankLayout.from_mesh(mesh).",
                param="model",
            )


def check_context_parallel_size(context_parallel: Any) -> None:
    """Refuse a ``context_parallel`` that is not ``None`` or a positive int (``0``, ``-1``, ``True``, ``2.0``).

    >>> check_context_parallel_size(True)
    Traceback (most recent call last):
    ...
    packtools.errors.PackingError: context_parallel must be a positive int (the number of processes that split each row), got True.
    """
    if context_parallel is None:
        return
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1:
        raise PackingError(
            f"context_parallel must be a positive int (the number of processes that split each row), got "
            f"{context_parallel!r}.",
            param="context_parallel",
        )


def check_trainer_world(trainer: Any, world: int) -> None:
    """Refuse a trainer that counts fewer processes than the running ``torch.distributed`` group: it would give
    every process the same rows while the gradients are averaged over all of them.  Seen with DeepSpeed on the
    CPU (``DS_ACCELERATOR=cpu``, transformers 5.25, accelerate 1.16) without ``use_cpu=True``:
    ``TrainingArguments.world_size`` and the accelerator said 1 on each of 2 processes, so ``Trainer``'s loader and packtools' sharded nothing, and one
    epoch trained every row on both processes, with no error."""
    import sys

    dist = sys.modules.get("torch.distributed")  # never imported here: a group exists only where torch is
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    running = int(dist.get_world_size())
    if running != world:
        if getattr(trainer, "is_deepspeed_enabled", False):
            what = (
                f"(started by DeepSpeed): every process would train the same rows, and each row would be trained "
                f"{running // max(world, 1)} times per epoch, while DeepSpeed averages the gradients over all "
                f"{running}"
            )
        else:  # torchrun on the CPU without use_cpu=True: accelerate's state is NO, nothing wraps the model
            what = (
                f"(started by the launcher or by hand): every process would train the same rows as a run of its "
                f"own (the accelerator wraps nothing for data parallelism), {running} copies of one run instead "
                f"of one data-parallel run"
            )
        raise PackingError(
            f"the trainer counts {world} process(es) (TrainingArguments.world_size, the accelerator), but "
            f"torch.distributed runs {running} {what}. Seen on the CPU without use_cpu=True (DeepSpeed, or "
            f"torchrun with gloo), where the accelerator counted one process: pass TrainingArguments(use_cpu=True) "
            f"there (then every process is counted).",
            param="world_size",
        )


def rank_layout(trainer: Any, context_parallel: int | None = None) -> RankLayout:
    """The :class:`RankLayout` of ``trainer``'s process (see the module docstring).

    ``context_parallel`` is packtools' CP size when the caller asked for it (``prepare_trainer``); without a
    ``ParallelismConfig`` the CP groups are consecutive processes (``cp_rank = process_index % N``).
    """
    check_context_parallel_size(context_parallel)
    args = trainer.args
    world, index = max(int(args.world_size), 1), int(args.process_index)
    check_trainer_world(trainer, world)
    accelerator = getattr(trainer, "accelerator", None)
    config = getattr(accelerator, "parallelism_config", None)
    layout = None
    if config is not None:
        layout = _from_parallelism_config(accelerator, config, context_parallel)
    elif getattr(trainer, "is_deepspeed_enabled", False):
        plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
        ds_config = getattr(plugin, "deepspeed_config", None) or {}
        tp = int((ds_config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0)
        if tp > 1:
            layout = RankLayout(index // tp, world // tp, tp_size=tp, source="DeepSpeed AutoTP")
    if layout is None:
        # FSDP's DTensors are sharded over data parallelism
        if not getattr(trainer, "is_fsdp_enabled", False):
            _refuse_unknown_mesh(getattr(trainer, "model", None))
        cp = 1 if context_parallel is None else context_parallel
        if world % cp:
            raise PackingError(
                f"context_parallel={cp} does not divide the {world} processes of the run.",
                param="context_parallel",
            )
        layout = RankLayout(index // cp, world // cp, cp_rank=index % cp, cp_size=cp)
    if layout.world != world or not 0 <= layout.dp_rank < layout.dp_size:
        raise PackingError(
            f"the parallel layout read from the {layout.source} (dp={layout.dp_size}, cp={layout.cp_size}, "
            f"tp={layout.tp_size}) does not cover the {world} processes of the run (rank {index} has data-parallel "
            f"rank {layout.dp_rank}); packtools will not shard rows over a layout it cannot account for.",
            param="parallelism_config",
        )
    return layout
