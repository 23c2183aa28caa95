"""A slice of the tiered kill campaign (``benchmarks/kill_tiered.py``): one real ``kill -9`` in each phase of a tiered
save (local save, upload, remote commit), then a finish that uploads everything. The full campaign, which also compares
the final weights with an uninterrupted run's bit for bit: ``nox -s kill_tiered``."""

from __future__ import annotations

from benchmarks.kill_tiered import PHASES, campaign


def test_kills_during_tiered_saves_lose_nothing_committed(s3_server, tmp_path):
    counts = campaign(str(tmp_path), kills=len(PHASES), seed=3, epochs=6, server=s3_server, compare=False)
    assert counts["unresumable"] == 0 and counts["lost"] == 0 and counts["not_uploaded"] == 0, counts
    assert counts["corrupt"] == 0 and counts["resaved"] == 0, counts
    assert counts["checkpoints"] >= 1 and counts["verified"] >= 1, counts
