"""The memory tier persisting to node-local disks: 2 simulated nodes x 2 gloo ranks, each node its own memory area
under /dev/shm and its own durable directory (separate directories standing for the disks of separate machines).

- Local ``dirpath`` per node: every 2nd memory checkpoint persisted, each node's disk holding its own part and its
  peer's replica; every memory area wiped (a restart of the whole cluster), fresh processes restore the exact weights
  and AdamW state of the newest persisted checkpoint; node 1's disk wiped too, node 1's part comes from node 0's disk
  replica, at world size 4 and at world size 2.
- Remote ``dirpath`` (SeaweedFS, through a fault proxy) with a node-local ``local_dir`` per node: each node uploads
  its own files, rank 0 commits last; the remote copy holds every node's files and loads bit-equal with stock
  ``dcp.load`` and ours. The store refusing connections during one persist fails nothing: that checkpoint stays
  committed on the disks and is uploaded at the next persist.
- ``kill -9`` of the whole job while a part is being persisted: no torn or uncommitted part is ever restored, and the
  staging directory left behind is removed by the next persist.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from harness.ranks import port_env, spawn
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.format.marker import COMMIT_FILE
from lightning_dcp.engine.storage.localfs import STAGING_INFIX
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.engine.tiers.node_disks import PARTS_DIR
from lightning_dcp.engine.tiers.parts import PartStore, complete
from lightning_dcp.engine.tiers.runs import RUN_FILE
from tests._faults import FaultProxy
from tests.distributed.test_memory_tier import base  # noqa: F401  (the fixture: a fresh directory under /dev/shm)


def _trained(steps: int) -> dict:
    """Weights and AdamW state after ``steps`` optimizer steps (the same on every rank and in the test process)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(8, 64, generator=data)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    state = optimizer.state_dict()["state"]
    return {
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": {str(i): {k: v.clone() for k, v in s.items()} for i, s in state.items()},
    }


def _empty_like(tree):
    return {k: _empty_like(v) for k, v in tree.items()} if isinstance(tree, dict) else torch.zeros_like(tree)


def _assert_equal(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            _assert_equal(got[k], want[k], f"{where}.{k}")
    else:
        assert torch.equal(got, want), where


def _whole(part, name: str) -> bool:
    return os.path.getsize(os.path.join(part.path, name)) == part.marker["files"][name]["size"]


def _disk(root: str) -> PartStore:
    return PartStore(os.path.join(root, PARTS_DIR))


# ------------------------------------------------------------------------------------------------ workers
def _save(rank: int, world_size: int, shm: str, disks: str, url: str | None, options: dict | None) -> None:
    dist.init_process_group("gloo")
    node = rank // 2
    tier = MemoryTier(f"{shm}/shm{node}", replicas=1, async_save=False, persist_every=2)
    proxy = None
    if url is not None:  # the store behind a fault proxy (in rank 0's process) that every rank goes through
        upstream = int(options["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1])
        proxy = FaultProxy(upstream).start() if rank == 0 else None
        port = [proxy.port if proxy is not None else None]
        dist.broadcast_object_list(port, src=0)
        endpoint = f"http://127.0.0.1:{port[0]}"
        options = {**options, "client_kwargs": {**options["client_kwargs"], "endpoint_url": endpoint}}
        options["config_kwargs"] = {"retries": {"max_attempts": 1}}  # an outage answered at once
    local_dir = None if url is None else f"{disks}/local{node}"
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier, local_dir=local_dir, storage_options=options))
    directory = f"{disks}/disk{node}" if url is None else f"{url}/run"
    for step in range(1, 7):
        tier.async_save = step % 2 == 0  # persisted ones (2, 4, 6) in the background
        if proxy is not None and step == 2:
            proxy.set("refuse")  # the store goes down for step 2's persist
        with checkpointer.into_memory():
            checkpointer.save(_trained(step), f"{directory}/step={step}", objects={"step": step}, collective=True)
        if url is not None and step in (2, 4):
            checkpointer.wait(collective=True)  # training went on; the upload failed (2) or was redone (4)
            disks_tier = tier.persister.disks
            if step == 2:
                assert "cannot be reached" in disks_tier.upload_error and list(disks_tier.unuploaded) == ["step=2"]
                assert _disk(f"{disks}/local{node}").read(f"step=2@{node}") is not None  # committed on the disk
                if proxy is not None:
                    proxy.set("pass")
            else:
                assert disks_tier.upload_error is None and not disks_tier.unuploaded
    checkpointer.wait(collective=True)
    disks_tier = tier.persister.disks
    assert disks_tier is not None and disks_tier.upload_error is None  # node-local found; every upload went
    assert [name for name, _ in disks_tier.persisted] == ["step=4", "step=6"]
    checkpointer.close()
    if proxy is not None:
        proxy.stop()


def _load(rank: int, world_size: int, shm: str, disks: str, step: int, wipe: bool) -> None:
    dist.init_process_group("gloo")
    node = rank // 2
    expected = _trained(step)
    for attempt in range(2 if wipe else 1):
        if attempt == 1:  # node 1 comes back with a new disk too: its part from node 0's disk replica
            dist.barrier()
            if rank == 2:
                shutil.rmtree(f"{disks}/disk1")
            dist.barrier()
        checkpointer = Checkpointer(CheckpointerConfig(memory=MemoryTier(f"{shm}/shm{node}")))
        checkpointer.memory_route.bind(Location(f"{disks}/disk{node}"))
        target = _empty_like(expected)
        loaded = checkpointer.load(f"{disks}/disk{node}/last", target=target, collective=True)
        assert loaded.objects["step"] == step and loaded.url.endswith(f"step={step}")
        _assert_equal(target, expected, f"rank {rank}, attempt {attempt}")
        assert checkpointer.memory.highest >= step  # saves after the restore count on from it
        checkpointer.close()


def _big(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"state_dict": {f"w{i}": torch.randn(1024, 2048, generator=g) for i in range(6)}}


def _persist_until_killed(rank: int, world_size: int, shm: str, disks: str) -> None:
    dist.init_process_group("gloo")
    node = rank // 2
    checkpointer = Checkpointer(
        CheckpointerConfig(memory=MemoryTier(f"{shm}/shm{node}", async_save=False, persist_every=1))
    )
    for step in range(1, 40):
        with checkpointer.into_memory():
            checkpointer.save(_big(step), f"{disks}/disk{node}/step={step}", objects={"step": step}, collective=True)
    checkpointer.close()


def _save_named_by_rank(rank: int, world_size: int, shm: str, disks: str) -> None:
    dist.init_process_group("gloo")
    node = rank // 2
    checkpointer = Checkpointer(
        CheckpointerConfig(memory=MemoryTier(f"{shm}/shm{node}", async_save=False, persist_every=1))
    )
    with checkpointer.into_memory():  # each rank formats its own name (an unsynced metric in `filename`)
        checkpointer.save(_trained(1), f"{disks}/disk{node}/step=1-r{rank}", objects={"step": 1}, collective=True)
    checkpointer.close()


def _resume_and_persist(rank: int, world_size: int, shm: str, disks: str, step: int) -> None:
    dist.init_process_group("gloo")
    node = rank // 2
    tier = MemoryTier(f"{shm}/shm{node}", async_save=False, persist_every=1)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    checkpointer.memory_route.bind(Location(f"{disks}/disk{node}"))
    target = _empty_like(_big(0))
    loaded = checkpointer.load(f"{disks}/disk{node}/last", target=target, collective=True)
    assert loaded.objects["step"] == step
    _assert_equal(target, _big(step), f"rank {rank}")
    with checkpointer.into_memory():  # the next persist removes what the kill left half-written
        checkpointer.save(_big(99), f"{disks}/disk{node}/step=99", objects={"step": 99}, collective=True)
    checkpointer.close()


# -------------------------------------------------------------------------------------------------- tests
@pytest.mark.full
def test_persisted_on_node_local_disks_and_restored_after_a_cluster_restart(base, tmp_path):  # noqa: F811
    disks = str(tmp_path)
    spawn(_save, 4, base, disks, None, None)
    markers = set()
    for node in range(2):
        assert sorted(set(os.listdir(f"{disks}/disk{node}")) - {RUN_FILE}) == [
            PARTS_DIR
        ]  # nothing a shared-directory listing would take
        assert committed_checkpoints(Location(f"{disks}/disk{node}")) == []
        parts = _disk(f"{disks}/disk{node}").parts()  # its own part and the peer's replica, of the newest 2
        assert sorted((p.name, p.node) for p in parts) == [("step=4", 0), ("step=4", 1), ("step=6", 0), ("step=6", 1)]
        assert not [e for e in os.listdir(f"{disks}/disk{node}/{PARTS_DIR}") if e.startswith(".")]
        for part in parts:
            with open(os.path.join(part.path, COMMIT_FILE), "rb") as f:
                markers.add((part.name, f.read()))
            assert all(_whole(part, f) for f in part.files)
    assert len(markers) == 2  # one global marker per checkpoint, byte for byte on every part

    for node in range(2):  # the whole cluster restarts: every memory area is empty
        shutil.rmtree(f"{base}/shm{node}")
    spawn(_load, 4, base, disks, 6, True)  # from each node's disk, then node 1's part from node 0's disk replica
    assert not os.path.exists(f"{disks}/disk1")
    spawn(_load, 2, base, disks, 6, False)  # another world size: one node
    for node in range(2):  # the copies assembled for the loads (in memory, or on a disk) are gone
        assert not [e for e in os.listdir(f"{base}/shm{node}") if e.startswith(".load")]
    assert not [e for e in os.listdir(f"{disks}/disk0/{PARTS_DIR}") if e.startswith(".")]


@pytest.mark.full
def test_remote_copy_committed_with_every_nodes_files(base, tmp_path, s3_bucket):  # noqa: F811
    url, options = s3_bucket
    disks = str(tmp_path)
    spawn(_save, 4, base, disks, url, options)
    remote = Location(f"{url}/run", storage_options=options)
    assert [loc.name for _, loc in committed_checkpoints(remote)] == ["step=6", "step=4"]  # keep=2 of 3 persisted
    newest = remote.child("step=6")
    with newest.open(COMMIT_FILE) as f:
        marker = f.read()
    for node in range(2):  # each node's local_dir holds its parts, with the remote copy's marker
        parts = _disk(f"{disks}/local{node}").parts()
        assert sorted((p.name, p.node) for p in parts) == [("step=4", 0), ("step=4", 1), ("step=6", 0), ("step=6", 1)]
        with open(os.path.join(f"{disks}/local{node}/{PARTS_DIR}/step=6@{node}", COMMIT_FILE), "rb") as f:
            assert f.read() == marker
    sizes = newest.sizes()
    files = parts[0].marker["files"]
    assert {name[:3] for name in files} >= {"__0", "__2"}  # data files written on both nodes
    assert all(sizes[name] == entry["size"] for name, entry in files.items())

    expected = _trained(6)
    ours = _empty_like(expected)
    Checkpointer(CheckpointerConfig(storage_options=options)).load(
        newest.url, target=ours, collective=False
    )  # checksums verified
    _assert_equal(ours, expected, "our loader")
    local = str(tmp_path / "download")
    newest.fs.get(newest.path + "/", local + "/", recursive=True)
    stock = _empty_like(expected)
    dcp.load(stock, checkpoint_id=local, no_dist=True)
    _assert_equal(stock, expected, "stock dcp.load")


def test_ranks_naming_a_memory_checkpoint_differently_save_rank0s_name_in_their_own_node_directories(
    base,  # noqa: F811
    tmp_path,
):
    spawn(_save_named_by_rank, 4, base, str(tmp_path))
    for node in range(2):  # each node kept its own directory; every part carries rank 0's name
        assert sorted({p.name for p in PartStore(f"{base}/shm{node}").parts()}) == ["step=1-r0"]
        assert sorted({p.name for p in _disk(f"{tmp_path}/disk{node}").parts()}) == ["step=1-r0"]
    assert not os.path.exists(f"{tmp_path}/disk0/step=1-r1") and not os.path.exists(f"{tmp_path}/disk1/step=1-r0")


@pytest.mark.full
def test_kill_during_persistence_never_restores_a_torn_part(base, tmp_path):  # noqa: F811
    disks = str(tmp_path)
    code = (
        "import sys; from harness.ranks import spawn;"
        " from tests.distributed.test_memory_node_disks import _persist_until_killed;"
        " spawn(_persist_until_killed, 4, sys.argv[1], sys.argv[2])"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", code, base, disks], env=port_env(), start_new_session=True, cwd=os.getcwd()
    )
    roots = [f"{disks}/disk{node}/{PARTS_DIR}" for node in range(2)]

    def staging() -> list[str]:
        found = []
        for root in roots:
            if os.path.isdir(root):
                found += [e for e in os.listdir(root) if e.startswith(".step=") and STAGING_INFIX in e]
        return found

    deadline = time.monotonic() + 180

    def persisted() -> list:  # the checkpoints whose every part is committed on some disk
        ready = [node for node in range(2) if os.path.isdir(roots[node])]
        return complete([(node, part) for node in ready for part in _disk(f"{disks}/disk{node}").parts()])

    try:  # kill -9 of the whole job once a whole persisted checkpoint exists and the next one is being written
        while not (persisted() and staging()):
            assert job.poll() is None and time.monotonic() < deadline, "the job ended before a kill could be aimed"
            time.sleep(0.005)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()

    left = staging()  # usually the part being written when the kill came (unless its rename just won the race)
    held = [(node, part) for node in range(2) for part in _disk(f"{disks}/disk{node}").parts()]
    for _, part in held:  # every committed part is whole
        assert all(_whole(part, f) for f in part.files)
    newest = complete(held)[0][1]  # the newest checkpoint whose every part is committed on some disk
    step = int(newest.split("=")[1])
    for node in range(2):
        shutil.rmtree(f"{base}/shm{node}")
    spawn(_resume_and_persist, 4, base, disks, step)
    print(f"staging left by the kill: {left}; restored {newest}")
    assert not staging()  # what the kill left half-written is gone
    names = {p.name for node in range(2) for p in _disk(f"{disks}/disk{node}").parts()}
    assert "step=99" in names and newest in names
