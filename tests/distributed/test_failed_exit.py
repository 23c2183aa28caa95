"""A failed run's workers end without the interpreter's collections over their heap (``freeze_heap_at_exit``).

An elastic agent restarts the job once a failed worker has ended; with torch and Lightning imported, the collections
of the interpreter's finalization took 1.6-2.1 s of that (``benchmarks/exit_time.py``). Each rank runs as its own
process (tests/distributed/_failed_exit_worker.py), exits as a script does, and reports at its very last ``atexit``
handler how many objects are frozen.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests._spawn import free_port, port_env


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
def test_only_a_failed_run_freezes_the_heap_at_exit(tmp_path, mode):
    for rank, (code, output) in enumerate(_run(tmp_path, mode)):
        if mode == "fail":
            assert code == 1, f"rank {rank}:\n{output[-3000:]}"  # the uncaught error, not an abort at teardown
            assert "RuntimeError: the step failed" in output
            assert int((tmp_path / f"frozen-{rank}").read_text()) > 10_000  # torch's and Lightning's objects
        else:
            assert code == 0, f"rank {rank}:\n{output[-3000:]}"
            assert int((tmp_path / f"frozen-{rank}").read_text()) == 0
        assert "terminate called" not in output
