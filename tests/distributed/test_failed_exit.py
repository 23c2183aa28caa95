"""A failed run's workers end as stock Lightning's do: exit status 1, and the user's objects finalized at exit.

Each rank runs as its own process (tests/distributed/_failed_exit_worker.py) and exits as a script does. Its model
keeps a journal file in a reference cycle, never closed: the interpreter's last collections flush it. A failed
``dcp_ddp`` run used to skip those collections (the heap was frozen at ``on_exception`` to end 1.5 s sooner), and the
journal lost its buffered lines on both ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.ranks import free_port, port_env


def _run(tmp_path, mode: str) -> list[tuple[int, str]]:
    worker = [sys.executable, "-m", "tests.distributed._failed_exit_worker", str(tmp_path), mode]
    port = str(free_port())
    procs = [
        subprocess.Popen(
            worker,
            env=port_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                PYTHONPATH=os.getcwd(),
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    return [(p.returncode, output) for p, output in zip(procs, outputs, strict=True)]


@pytest.mark.parametrize("mode", ["fail", "finish"])
def test_a_failed_run_exits_with_its_error_and_finalizes_the_users_objects(tmp_path, mode):
    for rank, (code, output) in enumerate(_run(tmp_path, mode)):
        assert "terminate called" not in output
        if mode == "fail":
            assert code == 1, f"rank {rank}:\n{output[-3000:]}"  # the uncaught error, not an abort at teardown
            assert "RuntimeError: the step failed" in output
            steps = [0, 1, 2, 3]
        else:
            assert code == 0, f"rank {rank}:\n{output[-3000:]}"
            steps = [0, 1, 2, 3, 4]
        journal = (tmp_path / f"journal-{rank}").read_text()
        assert journal == "".join(f"step {s}\n" for s in steps), f"rank {rank}: the journal lost lines"
