"""docs/memory-tier.md's torchrun recipe, run as documented, with a worker killed: the restart resumes from memory.

The command line is read from the document (the block the ``test_memory_recipe.py`` note points at), ``torchrun``
run as ``python -m torch.distributed.run`` (the same program) and the memory area moved to a fresh ``/dev/shm``
path. Once the area holds a committed memory checkpoint, a worker is SIGKILLed, as a crashed worker dies; torchrun
restarts both. The restarted attempt must start from a memory checkpoint at least as new as the one seen before the
kill (never from step 0), and the run must end at step 300 with exit status 0. Before run identity followed the job,
the recipe (no ``dirpath``: Lightning's default folder, a new ``version_N`` each attempt) restarted from step 0.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from harness.ranks import port_env
from tests._docs import ROOT, blocks, commands


def _documented() -> list[str]:
    found = [b for b in blocks("docs/memory-tier.md") if b.reason and "test_memory_recipe.py" in b.reason]
    assert len(found) == 1, "docs/memory-tier.md: the recipe block this test runs is gone"
    (argv,) = commands(found[0].code)
    assert argv[0] == "torchrun"
    return argv


def _workers(agent: int) -> dict[int, int]:
    """``{rank: pid}`` of the agent's worker processes."""
    found = {}
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            if int(stat[stat.rfind(b")") + 2 :].split()[1]) != agent:  # its parent
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def _committed_steps(area: str) -> list[int]:
    steps = []
    for marker in glob.glob(os.path.join(area, "memory-step=*.ckpt@*", ".commit")):
        steps.append(int(re.search(r"memory-step=(\d+)\.ckpt", marker).group(1)))
    return sorted(steps)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (a tmpfs)")
def test_the_documented_torchrun_recipe_resumes_the_newest_memory_checkpoint_after_a_kill(tmp_path):
    argv = _documented()
    area = f"/dev/shm/lightning-dcp-test-{uuid.uuid4().hex[:8]}"
    args = [area if a == "/dev/shm/run1" else os.path.join(ROOT, a) if a.endswith(".py") else a for a in argv[1:]]
    env = port_env(PYTHONPATH=ROOT)
    env.pop("MASTER_PORT")
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        seen: list[int] = []
        while not seen and agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
            seen = _committed_steps(area)
        assert seen, "no memory checkpoint was committed before the run ended"
        os.kill(_workers(agent.pid)[1], signal.SIGKILL)
        out, _ = agent.communicate(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
        shutil.rmtree(area, ignore_errors=True)
    assert agent.returncode == 0, out[-4000:]
    starts = [int(s) for s in re.findall(r"training starts at step (\d+)", out)]
    assert len(starts) == 2 and starts[0] == 0, out[-4000:]
    assert starts[1] >= max(seen) > 0, (seen, starts)  # the newest memory checkpoint (it may have saved on)
    assert starts[1] % 10 == 0
