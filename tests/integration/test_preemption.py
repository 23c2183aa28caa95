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
import time

import pytest

from harness.ranks import port_env

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
    ("signame", "signal_rank", "seed", "resume"),
    [("SIGTERM", 1, 41, True), pytest.param("SIGUSR1", 0, 7, False, marks=pytest.mark.full)],
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


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


@pytest.mark.parametrize("stuck_after", ["2", pytest.param("none", marks=pytest.mark.full)])
def test_sigterm_on_a_rank_stuck_in_a_collective_ends_it_after_stuck_after(tmp_path, stuck_after):
    """Rank 1 stops (SIGSTOP: its host vanished, its connections stay open) at step 3's start; rank 0 waits in a gloo
    collective of that step, where Python's handlers cannot run. SIGTERM to rank 0 (the agent's, at a node loss)
    ends it ``stuck_after`` seconds later with status 143; with ``stuck_after=None`` it is still waiting 8 s later."""
    directory = str(tmp_path / "run")
    os.makedirs(directory)
    command = [sys.executable, "-m", "tests.integration._preempt_train", directory, str(MAX_STEPS), "3", "1"]
    pid_file = os.path.join(directory, "pid-1")
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen([*command, "SIGSTOP", stuck_after], env=port_env(), stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(pid_file) and open(pid_file).read() and _stopped(int(open(pid_file).read()))):
            assert process.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)  # rank 0 reaches the step's collective
        assert [e["step"] for e in _log(directory, 0)][-1] <= 3  # and no further
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        if stuck_after == "none":
            with pytest.raises(subprocess.TimeoutExpired):
                process.wait(timeout=8)
            return
        process.wait(timeout=60)
        took = time.monotonic() - sent
        assert process.returncode == 128 + signal.SIGTERM
        assert 2.0 <= took < 10.0, took
        assert "the main thread has not run its handler" in (tmp_path / "stderr").read_text()
    finally:
        process.kill()
        process.wait()
        if os.path.exists(pid_file):
            try:
                os.kill(int(open(pid_file).read()), signal.SIGKILL)  # rank 1, stopped (Lightning's launcher's child)
            except ProcessLookupError:
                pass


def test_a_sigterm_after_the_run_failed_ends_the_process_at_once(tmp_path):
    """The run failed and its teardown waits (tests/integration/_failed_run_train.py: 60 s): SIGTERM now ends the
    process as it would any other (Python's default), not recorded for a step's end that never comes."""
    command = [sys.executable, "-m", "tests.integration._failed_run_train", str(tmp_path)]
    with open(tmp_path / "stderr", "w") as stderr:
        process = subprocess.Popen(command, env=port_env(), stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(tmp_path / "failed"):
            assert process.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        assert process.returncode == -signal.SIGTERM  # killed by it
        assert time.monotonic() - sent < 5.0
    finally:
        process.kill()
        process.wait()
