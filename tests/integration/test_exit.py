"""A process ends the way a stock Lightning run ends: exit 0, and nothing it saved left behind at exit.

A background save still being written when the script ends (a Fabric loop that never calls ``wait_for_save()``, the
engine used directly) is finished and committed before the interpreter finalizes (``engine/shutdown.py``), with a
log line saying how long the exit waited; it used to be cut off with the daemon thread that wrote it, leaving only
a hidden staging folder while the script had printed that it saved.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_dcp import verify_checkpoint
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.storage.location import Location

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("kind", ["engine", "fabric"])
def test_an_async_save_the_script_never_waited_for_is_committed_at_exit(tmp_path, kind):
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration._async_exit", kind, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    saved = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("SAVED ")]
    assert [os.path.basename(p) for p in saved] == ["step-1", "step-2"]
    assert sorted(os.listdir(tmp_path)) == ["step-1", "step-2"]  # no staging folder left behind
    for path in saved:
        verify_checkpoint(path)  # committed, every byte as written
    newest = committed_checkpoints(Location(str(tmp_path)))[0][1]
    assert newest.name == "step-2"
    if "waited" in done.stderr:  # the exit found the last save still being written, and said so
        assert "step-2" in done.stderr and "it is committed" in done.stderr


def test_a_slice_of_the_exit_campaign_ends_every_run_cleanly(tmp_path):
    """Three runs of the exit campaign (``nox -s exits`` runs hundreds), one CPU hog beside them: a 2-rank async DDP
    Trainer, a 2-rank Fabric loop that never waits for its last async save, a 1-process async Trainer. Every rank
    exits 0 without an abort, every final checkpoint is committed, every committed checkpoint verifies."""
    from tests.chaos.exits import campaign

    cases = ["trainer-ddp-async", "fabric-ddp-async", "trainer-single-async"]
    summary = campaign(
        cases=cases, runs=3, hogs=1, seed=0, workdir=str(tmp_path), steps=6, every=2, timeout=240, log=lambda _: None
    )
    assert summary["cases"] == {
        case: {"runs": 1, "failed": 0, "nonzero": 0, "terminate": 0, "final_lost": 0, "unverified": 0} for case in cases
    }, summary["problems"]
