"""``torchrun --max-restarts``: a worker's SIGKILL, the agent restarts both, and the resume is the newest memory save.

Before the restarted attempt got keys of its own in the agent's store (lightning_dcp/engine/elastic.py), its
``init_process_group`` read the addresses the previous attempt had published and failed ("Gloo connectFullMesh failed
... Connection refused"), or hung; whether it did was a race (here: every try of the reproduction).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.ranks import free_port, port_env
from tests.integration._elastic_train import read_log

KILL_AT, EVERY, MAX_STEPS = 7, 3, 10


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = port_env(PYTHONPATH=os.getcwd())
    env.pop("MASTER_PORT")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    command += ["--master-port", str(free_port()), "-m", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("kill_rank", [pytest.param(1, marks=pytest.mark.full), -1], ids=["one-rank", "every-rank"])
def test_a_restarted_attempt_resumes_the_newest_memory_checkpoint_exactly(tmp_path, kill_rank):
    workdir = str(tmp_path)
    done = _torchrun(
        "tests.integration._elastic_train", "--workdir", workdir, "--kill-at", str(KILL_AT),
        "--kill-rank", str(kill_rank), "--every", str(EVERY), "--max-steps", str(MAX_STEPS),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    newest = KILL_AT - KILL_AT % EVERY
    for rank in range(2):
        log = read_log(workdir, rank)
        saved = {e["step"]: e["hash"] for e in log if e["event"] == "saved" and e["attempt"] == 0}
        resumed = [e for e in log if e["event"] == "resumed" and e["attempt"] == 1]
        assert max(saved) == newest, log
        assert [(e["step"], e["hash"]) for e in resumed] == [(newest, saved[newest])], log
        assert [e["step"] for e in log if e["event"] == "done"] == [MAX_STEPS], log


@pytest.mark.full
def test_fabric_restarted_attempt_sets_up_its_process_group(tmp_path):
    done = _torchrun("tests.integration._elastic_fabric", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        assert (tmp_path / f"done-{rank}").read_text() == "1 12"  # the second attempt, 6 all-reduces of 2 ranks
