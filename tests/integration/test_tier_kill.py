"""A slice of the tiered kill campaign (``benchmarks/kill_tiered.py``): a real ``kill -9`` while a pruned checkpoint's
removal is journaled but not carried out, one during an upload and one during a local save, then a finish that uploads
everything: the remote ends with exactly the top-k checkpoints and a ``last.ckpt`` to the newest. The full campaign
(also kills at the remote commit, and a comparison of the final weights with an uninterrupted run's, bit for bit):
``nox -s kill_tiered``."""

from __future__ import annotations

import pytest

from benchmarks.kill_tiered import FAILURES, campaign


@pytest.mark.full
def test_kills_during_tiered_saves_lose_nothing_committed(s3_server, tmp_path):
    phases = ("pending_removal", "upload", "local_save")
    counts = campaign(str(tmp_path), kills=3, seed=3, epochs=8, server=s3_server, compare=False, phases=phases)
    assert all(counts[key] == 0 for key in FAILURES), counts
    assert counts["kills"] >= 2 and counts["phases"]["pending_removal"] >= 1 and counts["verified"] >= 1, counts
