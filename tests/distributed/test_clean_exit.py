"""The process groups lightning_dcp creates are destroyed at exit (issue 40, item 7).

"terminate called without an active exception" (exit 134) after a successful run came from C++ threads still
joinable when the interpreter's statics were torn down; a process group left to that teardown is one holder. The
async saves' gloo group (``engine.dist.own_group``) is now destroyed by an exit handler, on every rank alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness.ranks import free_port, port_env


def test_the_async_save_group_is_destroyed_before_the_interpreter_exits(tmp_path):
    worker = os.path.join(os.path.dirname(__file__), "_exit_worker.py")
    port = str(free_port())
    ckpt = str(tmp_path / "a.ckpt")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(tmp_path), ckpt],
            env=port_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{output[-2000:]}"
        assert "terminate called" not in output
        run = json.loads((tmp_path / f"run-{rank}.json").read_text())
        assert run["groups_after_save"] == run["groups_before"] + 1  # the async save's own gloo group
        at_exit = json.loads((tmp_path / f"exit-{rank}.json").read_text())
        assert at_exit["groups_at_exit"] == run["groups_before"], "the package's group outlived it"
