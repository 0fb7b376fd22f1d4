"""The guard's first-batch isolation probe on a sharded model (FSDP2 ``fully_shard``, FSDP1, DeepSpeed ZeRO-3).

The probe runs extra forwards on the first packed batch a process sees; a sharded model's forward gathers its
parameters from every process, and the processes reach their first packed batch at different steps (a row of one
document is no packed batch), so one process's probe gathers met another's real forward: ``fully_shard`` on 2
gloo processes with ``guard_model(model)`` hung with no error (``tests/_ddp_worker.py``'s ``fsdp`` check, slow).
``guard_model`` now refuses the probe on such a model by name, on every process before any gather, and names the
fix (probe before sharding, ``check_isolation=False``).  Here in one process (a gloo group of one), which shows
the refusal; the 2-process run is in ``tests/test_distributed.py``.
"""

from __future__ import annotations

import pytest
from _hf_models import PAD, tiny_llama, torch

from packtools import PaddingFreeCollator
from packtools.errors import PackingError
from packtools.integrations.parallel.distributed import sharded_by
from packtools.integrations.trainers.guard import guard_model

dist = pytest.importorskip("torch.distributed")
fsdp = pytest.importorskip("torch.distributed.fsdp")

ROWS = [{"input_ids": list(range(3, 18)), "seq_lengths": [5, 7, 3]}]


@pytest.fixture
def group(tmp_path):
    """A gloo process group of one process, torn down after the test."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group of another test")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_llama():
    model = tiny_llama("sdpa").train()
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return model


def test_guard_model_refuses_the_probe_on_a_fully_sharded_model_and_trains_without_it(group):
    """Failed before: guard_model(fully_shard model) registered the probe with no error (2 processes: a hang)."""
    model = sharded_llama()
    assert sharded_by(model) == "FSDP2 (torch.distributed.fsdp.fully_shard)"
    with pytest.raises(PackingError, match=r"sharded by FSDP2.*check_isolation=False") as err:
        guard_model(model)
    assert err.value.param == "check_isolation"
    assert "check_isolation(model) on the unsharded model" in str(err.value)
    guard_model(model, check_isolation=False)  # the fix: the forward checks stay, no probe
    loss = model(**PaddingFreeCollator(PAD)(ROWS)).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_a_model_sharded_after_guard_model_is_refused_at_its_first_packed_batch(group):
    """guard_model before fully_shard: fully_shard swaps the model's class in place, so the hook stays; the probe
    refuses it at the first packed batch, before running any forward of its own."""
    model = tiny_llama("sdpa").train()
    guard_model(model)
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    single = PaddingFreeCollator(PAD)([{"input_ids": list(range(3, 16)), "seq_lengths": [13]}])
    model(**single).loss.backward()  # one document: no packed batch, no probe yet
    with pytest.raises(PackingError, match="sharded by FSDP2"):
        model(**PaddingFreeCollator(PAD)(ROWS))


def test_sharded_by_names_zero3_parameters_and_leaves_plain_models():
    """DeepSpeed ZeRO-3 partitions parameters in place (each carries ``ds_id``); a plain model is not sharded."""
    model = tiny_llama("sdpa")
    assert sharded_by(model) is None
    guard_model(model)  # nothing refused
    zero3 = tiny_llama("sdpa")
    next(iter(zero3.parameters())).ds_id = 0  # what deepspeed.zero.Init leaves on every parameter
    assert sharded_by(zero3) == "DeepSpeed ZeRO-3"
    with pytest.raises(PackingError, match="DeepSpeed ZeRO-3"):
        guard_model(zero3)
