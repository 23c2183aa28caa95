"""DTensors and ShardedTensors (FSDP1's sharded state dict) staged into CPU buffers; async saves of both load back."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from harness.ranks import spawn
from lightning_dcp._compat.torch_dcp import ShardedTensor
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.save.staging import Stager


def _sharded(rank: int, world_size: int) -> ShardedTensor:
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed._shard.sharding_spec import ShardMetadata

    rows = 3
    local = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 100 * rank
    meta = ShardMetadata([rank * rows, 0], [rows, 4], f"rank:{rank}/cpu")
    return init_from_local_shards([STShard(local, meta)], [rows * world_size, 4])


def _worker(rank: int, world_size: int, tmp: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    live = {"d": distribute_tensor(full, mesh, [Shard(0)]), "s": _sharded(rank, world_size), "n": 3}
    stager = Stager(pin_memory=False)
    staged = stager.stage(live)
    buffers = {b.data_ptr() for b in stager._buffers.values()}
    # the DTensor: same global view, its local tensor is the staging buffer itself (no move, no copy)
    assert isinstance(staged["d"], DTensor) and staged["d"].shape == full.shape
    assert staged["d"].placements == live["d"].placements
    assert staged["d"].to_local().data_ptr() in buffers
    assert torch.equal(staged["d"].to_local(), live["d"].to_local())
    # the ShardedTensor: same global metadata, local shards in staging buffers
    assert isinstance(staged["s"], ShardedTensor) and staged["s"].size() == live["s"].size()
    (shard,) = staged["s"].local_shards()
    assert shard.tensor.data_ptr() in buffers and shard.tensor.device.type == "cpu"
    assert shard.metadata.shard_offsets == [rank * 3, 0]
    assert torch.equal(shard.tensor, live["s"].local_shards()[0].tensor)
    assert staged["n"] == 3
    # changing the live state no longer changes what was staged; the staged copy saves and loads with stock DCP
    live["d"].to_local().add_(1000)
    live["s"].local_shards()[0].tensor.add_(1000)
    path = os.path.join(tmp, "staged")
    dcp.save(staged, checkpoint_id=path)
    target = {"d": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]), "s": _sharded(rank, world_size), "n": 0}
    target["s"].local_shards()[0].tensor.zero_()
    dcp.load(target, checkpoint_id=path)
    assert torch.equal(target["d"].full_tensor(), full)
    assert torch.equal(target["s"].local_shards()[0].tensor, _sharded(rank, world_size).local_shards()[0].tensor)
    # a second stage reuses the same buffers
    again = stager.stage(live)
    assert {b.data_ptr() for b in stager._buffers.values()} == buffers
    assert torch.equal(again["s"].local_shards()[0].tensor, live["s"].local_shards()[0].tensor)
    # lightning_dcp's own async save (it stages write items, not the state dict) of the same kinds of tensors
    checkpointer = Checkpointer(CheckpointerConfig(async_save=True))
    async_path = os.path.join(tmp, "async.ckpt")
    checkpointer.save({"model": live}, async_path, objects={"step": 1}, collective=True)
    saved_d, saved_s = live["d"].full_tensor().clone(), live["s"].local_shards()[0].tensor.clone()
    live["d"].to_local().zero_()  # after staging: the background write must not see it
    live["s"].local_shards()[0].tensor.zero_()
    checkpointer.close()
    target = {"d": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]), "s": _sharded(rank, world_size)}
    target["s"].local_shards()[0].tensor.zero_()
    dcp.load({"model": target}, checkpoint_id=async_path)
    assert torch.equal(target["d"].full_tensor(), saved_d)
    assert torch.equal(target["s"].local_shards()[0].tensor, saved_s)
    dist.destroy_process_group()


def test_stager_keeps_dtensors_and_sharded_tensors_on_cpu_buffers(tmp_path):
    spawn(_worker, 2, str(tmp_path))
