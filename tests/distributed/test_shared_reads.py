"""DDP restores from an object store read each record once across the ranks (2 gloo ranks; stores on loopback).

Every rank ends with the exact saved state (large tensor records broadcast into the targets, runs of small records
as file bytes checked again by each receiver), each rank's own state is read by that rank, and a corrupt record,
large or small, fails the load on every rank with the file named, without a hang.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.ranks import spawn
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.load import shared_reads
from lightning_dcp.engine.load.dcp_reader import storage_reader
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.errors import CheckpointError
from tests._trainer import assert_same, load_result, save_result


def _state() -> dict[str, torch.Tensor]:
    """12+ MB: 3 large float32 records, a large bf16 one, and 300 small ones of several dtypes (some empty)."""
    g = torch.Generator().manual_seed(5)
    state = {f"big{i}": torch.randn(1 << 20, generator=g) for i in range(3)}
    state["half"] = torch.randn(1 << 20, generator=g).to(torch.bfloat16)
    for i in range(300):
        n = (i * 37) % 900
        kind = i % 4
        if kind == 0:
            state[f"s{i}"] = torch.randn(n, generator=g)
        elif kind == 1:
            state[f"s{i}"] = torch.randint(-(2**40), 2**40, (n,), generator=g)
        elif kind == 2:
            state[f"s{i}"] = torch.randn(n, generator=g) > 0
        else:
            state[f"s{i}"] = torch.randn(n, generator=g).half()
    return state


def _load(url: str, options: dict) -> tuple[object, list]:
    """``Checkpointer.load`` of ``url`` into zeros, and what :func:`shared_reads.agree` decided (spied on)."""
    decided: list = []
    agree = shared_reads.agree

    def spy(*args, **kwargs):
        decided.append(agree(*args, **kwargs))
        return decided[-1]

    shared_reads.agree = spy
    try:
        target = {"state_dict": {k: torch.zeros_like(v) for k, v in _state().items()}}
        loaded = Checkpointer(CheckpointerConfig(storage_options=options)).load(url, target=target, collective=True)
    finally:
        shared_reads.agree = agree
    return loaded, decided


def _worker(rank: int, world_size: int, url: str, options: dict, tmp: str) -> None:
    dist.init_process_group("gloo")
    shared_reads.ROUND_BYTES = 3 << 20  # several rounds, each read by both ranks
    Checkpointer().save(
        {"state_dict": _state()},
        f"{url}/a.ckpt",
        objects={"step": 3},
        rank_objects={"who": f"rank {rank}" * 1000},
        storage_options=options,
        collective=True,
    )
    loaded, decided = _load(f"{url}/a.ckpt", options)
    shared = [None if d is None else len(d.keys) for d in decided]
    save_result(tmp, "loaded", rank, (loaded.tree["state_dict"], loaded.objects, loaded.rank_objects, shared))


def test_ddp_restore_from_a_store_reads_each_record_once_and_every_rank_gets_the_exact_state(remote_store, tmp_path):
    url, options, _ = remote_store  # S3, GCS and Azure servers on loopback
    spawn(_worker, 2, url, options, str(tmp_path))
    expected = _state()
    for rank in range(2):
        tree, objects, rank_objects, shared = load_result(str(tmp_path), "loaded", rank)
        assert len(shared) == 1 and shared[0] >= len(expected)  # every tensor's records shared (large: in chunks)
        assert_same(tree, expected)
        assert objects["step"] == 3 and rank_objects == {"who": f"rank {rank}" * 1000}  # each rank's own


def _fabric_worker(rank: int, world_size: int, url: str, options: dict, tmp: str) -> None:
    from lightning.fabric import Fabric

    import lightning_dcp  # noqa: F401  (registers the dcp_* names)
    from lightning_dcp.fabric import DCPDDPStrategy

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=DCPDDPStrategy(storage_options=options))
    fabric.launch()
    fabric.seed_everything(3, verbose=False)
    model = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 512)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    fabric.backward(model(torch.randn(4, 1024)).square().mean())
    optimizer.step()  # 18 MB of weights and AdamW state
    fabric.save(f"{url}/fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optim = _clone_tensors(optimizer.state_dict())
    with torch.no_grad():  # everything the load must bring back, zeroed in place
        for tensor in [*model.parameters(), *(v for st in optimizer.state.values() for v in st.values())]:
            tensor.zero_()
    decided: list = []
    agree = shared_reads.agree
    shared_reads.agree = lambda *a, **k: decided.append(agree(*a, **k)) or decided[-1]
    try:
        rest = fabric.load(f"{url}/fabric.ckpt", {"model": model, "optimizer": optimizer})
    finally:
        shared_reads.agree = agree
    shared = [d is not None for d in decided]
    save_result(tmp, "fabric", rank, (saved, saved_optim, model.state_dict(), optimizer.state_dict(), rest, shared))


def _clone_tensors(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone_tensors(v) for v in value]
    return value


@pytest.mark.s3
def test_fabric_ddp_load_from_s3_shares_reads_and_restores_exactly(s3_bucket, tmp_path):
    url, options = s3_bucket
    spawn(_fabric_worker, 2, url, options, str(tmp_path))
    for rank in range(2):
        saved, saved_optim, model, optim, rest, shared = load_result(str(tmp_path), "fabric", rank)
        assert True in shared  # the model and optimizer load shared its reads
        assert_same(model, saved)
        assert_same(optim, saved_optim)
        assert rest == {"step": 1}


def _corrupt_worker(rank: int, world_size: int, url: str, options: dict, tmp: str) -> None:
    import s3fs

    dist.init_process_group("gloo")
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    for name, fqn in (("large.ckpt", "big1"), ("small.ckpt", "s151")):
        path = f"{url}/{name}"
        state = {"state_dict": _state()}
        Checkpointer().save(state, path, objects={"step": 1}, storage_options=options, collective=True)
        if rank == 0:  # flip one byte in the middle of the record's raw bytes
            reader = storage_reader(Location(path, storage_options=options))
            info = next(v for k, v in reader.read_metadata().storage_data.items() if k.fqn == f"state_dict.{fqn}")
            key = f"{path.removeprefix('s3://')}/{info.relative_path}"
            data = bytearray(fs.cat_file(key))
            data[info.offset + info.length // 2] ^= 0xFF
            fs.pipe_file(key, bytes(data))
        dist.barrier()
        try:
            _load(path, options)
        except CheckpointError as err:
            save_result(tmp, fqn, rank, str(err))
        else:
            save_result(tmp, fqn, rank, None)


@pytest.mark.s3
def test_a_corrupt_shared_record_large_or_small_fails_the_load_on_every_rank(s3_bucket, tmp_path):
    url, options = s3_bucket
    spawn(_corrupt_worker, 2, url, options, str(tmp_path), timeout=120.0)
    for fqn in ("big1", "s151"):
        for rank in range(2):
            message = load_result(str(tmp_path), fqn, rank)
            assert message is not None and "corrupt" in message and f"state_dict.{fqn}" in message, message
            assert ".distcp" in message  # the file is named
