"""Memory tier: the save stall against a memory copy and a disk save, and recovery time from each tier.

2 ranks on 2 simulated nodes (each its own area under /dev/shm, K=1 replica), a state of ``--gib`` GiB of fp32
tensors of 128 MiB (replicated, as DDP: each rank writes half). Measured through ``Checkpointer`` (what
``MemoryCheckpoint`` and the Trainer's ``save_checkpoint`` call; the Trainer adds building its checkpoint dict):

- ``memcpy``: ``copy_`` of this rank's half into reused buffers, both ranks at once (the staging copy of async saves);
- ``memory_sync`` / ``memory_async``: the stall of a memory-tier save (median of ``--repeats`` after one warm-up);
- ``disk_sync``: a synchronous save of the same state to ``--disk`` (local disk, fsync);
- ``recover_memory``: fresh processes load ``last`` from memory; ``recover_replica``: the same after node 1's area is
  wiped (its part comes from node 0's replica); ``recover_local``: from the checkpoint persisted to ``--disk``
  (page cache dropped where permitted); ``recover_s3``: the same checkpoint persisted to S3 (SeaweedFS on loopback,
  started by the benchmark; ``--no-s3`` or no ``weed`` binary: skipped), both memory areas gone;
- ``persist_node_disk``: persisting the newest memory checkpoint to node-local disks (each node its own directory
  on ``--disk``, standing for its machine's disk: its own part and its peer's replica, fsynced; median of 3);
  ``recover_node_disk``: fresh processes load ``last`` from those disks, both memory areas gone.

``python -m benchmarks.bench_memory --gib 1 --repeats 5``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

from harness.ranks import spawn
from lightning_dcp import MemoryTier
from lightning_dcp.engine import Checkpointer, CheckpointerConfig, Location

_ROWS = 8192  # 8192 x 4096 fp32 = 128 MiB per tensor


def _tree(gib: float) -> dict:
    count = max(1, round(gib * 8))
    g = torch.Generator().manual_seed(0)
    return {"state_dict": {f"w{i}": torch.randn(_ROWS, 4096, generator=g) for i in range(count)}}


def _target(gib: float) -> dict:
    return {"state_dict": {f"w{i}": torch.empty(_ROWS, 4096) for i in range(max(1, round(gib * 8)))}}


def _median_stall(checkpointer: Checkpointer, tree: dict, path: str, repeats: int, *, memory: bool) -> float:
    stalls = []
    for i in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        if memory:
            with checkpointer.into_memory():
                checkpointer.save(tree, f"{path}/s{i}", objects={"step": i}, collective=True, step=i)
        else:
            checkpointer.save(tree, f"{path}/s{i}", objects={"step": i}, collective=True, step=i)
        stall = time.perf_counter() - started
        checkpointer.wait(collective=True)  # replication and persistence land before the next one
        if i:
            stalls.append(stall)
    return statistics.median(stalls)


def _save(rank: int, world: int, base: str, gib: float, repeats: int, out: str, s3: tuple | None) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tree = _tree(gib)
    mine = [t for i, t in enumerate(tree["state_dict"].values()) if i % world == rank]
    buffers = [torch.empty_like(t) for t in mine]
    copies = []
    for _ in range(repeats + 1):
        dist.barrier()  # both ranks copy at once, as in a save (they share the memory bandwidth)
        started = time.perf_counter()
        for b, t in zip(buffers, mine, strict=True):
            b.copy_(t)
        copies.append(time.perf_counter() - started)
    del buffers
    result = {"memcpy": statistics.median(copies[1:]), "rank_bytes": sum(t.nbytes for t in mine)}
    tier = MemoryTier(f"{base}/shm{rank}", replicas=1, persist_every=0, async_save=False)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    result["memory_sync"] = _median_stall(checkpointer, tree, f"{base}/disk/mem", repeats, memory=True)
    result["memory_sync_stage"] = tier.timings.get("stage")
    result["memory_sync_write"] = tier.timings.get("write")
    result["replicate"] = tier.timings.get("replicate")
    tier.async_save = True
    result["memory_async"] = _median_stall(checkpointer, tree, f"{base}/disk/mem", repeats, memory=True)
    result["disk_sync"] = _median_stall(Checkpointer(), tree, f"{base}/disk/plain", max(1, repeats // 2), memory=False)
    tier.persist(tier.saved[-1])  # the newest memory checkpoint, persisted to the disk tier
    if s3 is not None:  # and to S3 (the remote tier, without `local_dir`)
        checkpointer.memory_route.bind(Location(s3[0], storage_options=s3[1]))
        tier.saved[-1].persisted = False
        tier.persist(tier.saved[-1])
    checkpointer.memory_route.bind(Location(f"{base}/node{rank}"))  # and to each node's own disk
    persists = []
    for _ in range(3):
        tier.saved[-1].persisted = False
        tier.persist(tier.saved[-1])
        persists.append(tier.timings["persist"])
    assert tier.persister.disks is not None, "the node directories were not taken for node-local disks"
    result["persist_node_disk"] = statistics.median(persists)
    checkpointer.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def _recover(rank: int, world: int, base: str, gib: float, path: str, out: str, options: dict | None = None) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tier = MemoryTier(f"{base}/shm{rank}")
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier, storage_options=options))
    node_disk = path.endswith("/node/last")  # each node's own disk directory
    path = path.replace("/node/last", f"/node{rank}/last")
    checkpointer.memory_route.bind(Location(f"{base}/node{rank}" if node_disk else f"{base}/disk/mem"))
    target = _target(gib)
    dist.barrier()
    started = time.perf_counter()
    loaded = checkpointer.load(path, target=target, collective=True)
    seconds = time.perf_counter() - started
    checkpointer.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"seconds": seconds, "tier": getattr(loaded, "tier", "durable"), "url": loaded.url}, f)


def _drop_caches() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        pass


def _s3_server(workdir: str, *, skip: bool) -> tuple:
    """A SeaweedFS server on loopback and ``(bucket URL, storage options)``; ``(None, None)`` when skipped."""
    from harness.s3 import S3Server, weed_binary

    if skip or weed_binary() is None:
        return None, None
    server = S3Server(os.path.join(workdir, "s3"))
    server.start()
    return server, (f"s3://{server.new_bucket()}/mem", server.storage_options())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--disk", default=None, help="directory on a local disk (default: a temporary one)")
    parser.add_argument("--no-s3", action="store_true", help="skip the recovery from S3 (SeaweedFS on loopback)")
    args = parser.parse_args(argv)
    base = f"/dev/shm/lightning_dcp-bench-{uuid.uuid4().hex[:8]}"
    disk = args.disk or tempfile.mkdtemp(prefix="lightning_dcp-bench-")
    os.makedirs(base)
    os.symlink(disk, f"{base}/disk")
    for rank in range(2):
        os.makedirs(f"{disk}/node{rank}")
        os.symlink(f"{disk}/node{rank}", f"{base}/node{rank}")
    out = f"{disk}/result.json"
    server, s3 = _s3_server(disk, skip=args.no_s3)
    try:
        spawn(_save, 2, base, args.gib, args.repeats, out, s3, timeout=1800, fresh=True)
        with open(out) as f:
            ranks = json.load(f)
        report = {k: max(r[k] for r in ranks) for k in ranks[0] if isinstance(ranks[0][k], float)}
        report["rank_bytes"] = ranks[0]["rank_bytes"]
        for label, wipe, path in (
            ("recover_memory", False, f"{base}/disk/mem/last"),
            ("recover_replica", True, f"{base}/disk/mem/last"),
        ):
            if wipe:
                shutil.rmtree(f"{base}/shm1")
            spawn(_recover, 2, base, args.gib, path, out, timeout=1800, fresh=True)
            with open(out) as f:
                report[label] = json.load(f)
        persisted = sorted(n for n in os.listdir(f"{disk}/mem") if not n.startswith("."))[-1]
        shutil.rmtree(base + "/shm0")
        _drop_caches()
        spawn(_recover, 2, base, args.gib, f"{base}/disk/mem/{persisted}", out, timeout=1800, fresh=True)
        with open(out) as f:
            report["recover_local"] = json.load(f)
        _drop_caches()  # both memory areas are empty since the previous recovery
        spawn(_recover, 2, base, args.gib, f"{base}/node/last", out, timeout=1800, fresh=True)
        with open(out) as f:
            report["recover_node_disk"] = json.load(f)
        report["recover_s3"] = None
        if s3 is not None:
            _drop_caches()  # the server's files too
            spawn(_recover, 2, base, args.gib, f"{s3[0]}/{persisted}", out, s3[1], timeout=1800, fresh=True)
            with open(out) as f:
                report["recover_s3"] = json.load(f)
        report["gib"] = args.gib
        report["sync_vs_memcpy"] = report["memory_sync"] / report["memcpy"]
        report["async_vs_disk_sync"] = report["memory_async"] / report["disk_sync"]
        print(json.dumps(report, indent=1))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base, ignore_errors=True)
        if args.disk is None:
            shutil.rmtree(disk, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
