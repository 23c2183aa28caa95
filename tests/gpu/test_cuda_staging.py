"""Async staging on CUDA: device-to-host copies land in pinned CPU buffers, DTensor shards included."""

from __future__ import annotations

import torch

from harness.ranks import spawn
from lightning_dcp.engine.save.staging import Stager
from tests._trainer import load_result, save_result
from tests.gpu._cuda import GPU, GPU_ENV

pytestmark = GPU


def test_cuda_tensors_stage_into_pinned_buffers():
    live = {
        "w": torch.randn(1024, 1024, device="cuda"),
        "b16": torch.randn(333, device="cuda").to(torch.bfloat16),
        "step": torch.tensor(7.0),  # optimizer steps stay on CPU
    }
    stager = Stager()
    assert stager.pin_memory
    staged = stager.stage(live)
    expected = {k: v.cpu() for k, v in live.items()}
    live["w"].add_(1.0)  # the training step after staging: the staged copy must not see it
    for key, value in staged.items():
        assert value.device.type == "cpu" and value.is_pinned(), key
        assert value.dtype == expected[key].dtype and torch.equal(value, expected[key]), key
    again = stager.stage(live)
    assert again["w"].data_ptr() == staged["w"].data_ptr()  # pinned buffers are reused, refreshed in place
    assert torch.equal(again["w"], live["w"].cpu())
    stager.close()


def _dtensor_worker(rank: int, world_size: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world_size,))
    full = torch.randn(64, 32, device="cuda")
    live = {"w": distribute_tensor(full, mesh, [Shard(0)])}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    staged = Stager().stage(live)["w"]
    local = staged.to_local()
    save_result(
        tmp,
        "dtensor",
        rank,
        {
            "local_device": local.device.type,
            "pinned": local.device.type == "cpu" and local.is_pinned(),
            "gpu_bytes_added": torch.cuda.memory_allocated() - before,
            "equal": torch.equal(local.cpu(), live["w"].to_local().cpu()),
            "placements_kept": list(staged.placements) == [Shard(0)],
            "shape": tuple(staged.shape),
        },
    )


def test_dtensor_shards_on_a_cuda_mesh_stage_to_pinned_host_memory(tmp_path):
    """FSDP2 state is DTensors on a CUDA mesh; staging must leave their local shards in host memory."""
    spawn(_dtensor_worker, 1, str(tmp_path), env=GPU_ENV, fresh=True)
    got = load_result(str(tmp_path), "dtensor")
    assert got["equal"] and got["placements_kept"] and got["shape"] == (64, 32)
    assert got["local_device"] == "cpu" and got["pinned"], got
    assert got["gpu_bytes_added"] == 0, got
