"""Preemption under the Trainer: SIGTERM (or SIGUSR1) on one rank at a random step; every rank saves, all stop.

2 ranks of ``dcp_ddp`` over gloo, Lightning's own launcher, real signals. The run stops at the end of the signalled
step with exit status ``128 + signal``; the checkpoint holds every rank's part at that step (the state equals an
uninterrupted run's at that step) and ``fit(ckpt_path="last")`` continues exactly as the uninterrupted run did.
Before lightning_dcp.trainer.preemption, a signal on rank 1 alone stopped rank 1 alone and saved nothing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from tests._spawn import port_env

MAX_STEPS = 12


def _run(directory: str, signal_step: int = -1, signal_rank: int = 0, signame: str = "SIGTERM") -> int:
    command = [sys.executable, "-m", "tests.integration._preempt_train", directory, str(MAX_STEPS)]
    command += [str(signal_step), str(signal_rank), signame]
    done = subprocess.run(command, env=port_env(), capture_output=True, text=True, timeout=150)
    if done.returncode not in (0, 128 + getattr(signal, signame)):
        raise AssertionError(done.stderr[-4000:])
    return done.returncode


def _log(directory: str, rank: int) -> list[dict]:
    with open(os.path.join(directory, f"log-{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict[int, str]]:
    directory = str(tmp_path_factory.mktemp("reference"))
    assert _run(directory) == 0
    return [{e["step"]: e["hash"] for e in _log(directory, rank) if e["event"] == "step"} for rank in range(2)]


@pytest.mark.parametrize(
    ("signame", "signal_rank", "seed", "resume"), [("SIGTERM", 1, 41, True), ("SIGUSR1", 0, 7, False)]
)
def test_a_signal_at_a_random_step_saves_every_rank_and_the_resume_is_exact(
    tmp_path, reference, signame, signal_rank, seed, resume
):
    step = random.Random(seed).randrange(1, MAX_STEPS - 2)  # signalled during step + 1
    directory = str(tmp_path)
    assert _run(directory, step, signal_rank, signame) == 128 + getattr(signal, signame)
    saved = os.path.join(directory, "ckpts", "last-preempted.ckpt")
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(saved))  # every rank wrote its part
    for rank in range(2):
        stopped = [e for e in _log(directory, rank) if e["event"] == "stopped"]
        assert [(e["step"], e["hash"], e["code"]) for e in stopped] == [
            (step + 1, reference[rank][step + 1], 128 + getattr(signal, signame))
        ]

    if not resume:
        return
    assert _run(directory) == 0  # fit(ckpt_path="last") finds the preempted checkpoint
    for rank in range(2):
        log = _log(directory, rank)
        resumed = [e for e in log if e["event"] == "resumed"]
        assert [(e["step"], e["hash"]) for e in resumed[1:]] == [(step + 1, reference[rank][step + 1])]
        after = {e["step"]: e["hash"] for e in log[log.index(resumed[1]) :] if e["event"] == "step"}
        assert after == {s: h for s, h in reference[rank].items() if s > step + 1}, rank
