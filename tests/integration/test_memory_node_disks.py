"""``Trainer.fit`` with ``MemoryCheckpoint`` on 2 simulated machines whose ``dirpath`` is each machine's own disk.

The Trainer gives every rank rank 0's ``dirpath``: on one machine, separate disks behind one path need a mount
namespace per node (``unshare -m``: root or CAP_SYS_ADMIN; skipped elsewhere), in which the same ``durable`` path is
a bind mount of that node's directory. A first run persists every 3rd memory checkpoint (steps 6 and 12) to each
node's disk; every memory area and node 1's disk are then wiped (the cluster restarts, one machine with a new disk),
and ``fit(ckpt_path="last")`` resumes at step 12 with the weights and optimizer state hashed at its save, on every
rank.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from harness.ranks import free_port
from tests.chaos.memory import ROOT, records

_PROBE = "mount --make-rprivate / && mount -t tmpfs none {d}"


def _namespaces_work(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(["unshare", "-m", "sh", "-c", _PROBE.format(d=probe)], capture_output=True)
    return done.returncode == 0


def _fit(workdir: str, areas: list[str], max_steps: int) -> list[int]:
    """One run of 2 nodes x 2 ranks; node ``j`` sees ``workdir/disk{j}`` at ``workdir/durable``. Exit codes."""
    port = free_port()
    procs = []
    for node in range(2):
        env = {**os.environ, "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.pop("LOCAL_RANK", None)
        train = [sys.executable, "-m", "tests.integration._memory_train", "--workdir", workdir, "--memory", areas[node]]
        train += ["--durable", f"{workdir}/durable", "--max-steps", str(max_steps), "--sync"]
        mount = f"mount --make-rprivate / && mount --bind {workdir}/disk{node} {workdir}/durable"
        script = f"{mount} && exec {shlex.join(train)}"
        out = open(os.path.join(workdir, f"node{node}.out"), "a")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=env, stdout=out, stderr=out))
    return [p.wait(timeout=300) for p in procs]


@pytest.mark.full
def test_trainer_resumes_from_node_local_disks_after_a_cluster_restart(tmp_path):
    if not _namespaces_work(tmp_path):
        pytest.skip("needs `unshare -m` (root or CAP_SYS_ADMIN) to give each simulated node its own disk")
    workdir = str(tmp_path / "run")
    areas = [f"/dev/shm/lightning_dcp-disks-{os.getpid()}-{node}" for node in range(2)]
    for path in (f"{workdir}/durable", f"{workdir}/disk0", f"{workdir}/disk1"):
        os.makedirs(path)
    try:
        assert _fit(workdir, areas, 12) == [0, 0]
        for node in range(2):  # each disk: its own part and the peer's replica of the persisted checkpoints
            parts = sorted(os.listdir(f"{workdir}/disk{node}/.lightning_dcp-parts"))
            assert parts == [f"memory-step={s}.ckpt@{j}" for s in (12, 6) for j in (0, 1)], parts
        assert os.listdir(f"{workdir}/durable") == []  # nothing outside the nodes' mount namespaces
        saved = {r["step"]: r["hash"] for r in records(workdir) if r["event"] == "saved"}
        for area in areas:
            shutil.rmtree(area)
        shutil.rmtree(f"{workdir}/disk1")
        os.makedirs(f"{workdir}/disk1")
        assert _fit(workdir, areas, 14) == [0, 0]
        resumed = [r for r in records(workdir) if r["event"] == "resumed" and r["step"] > 0]
        assert len(resumed) == 4 and {(r["step"], r["hash"]) for r in resumed} == {(12, saved[12])}
    finally:
        for area in areas:
            shutil.rmtree(area, ignore_errors=True)
