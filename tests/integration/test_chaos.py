"""A fixed-seed slice of the kill campaign (tests/chaos/campaign.py; the full one runs in ``nox -s chaos``).

One checkpoint directory, Lightning's stock ``ModelCheckpoint(save_last="link")`` with ``DCPCheckpointIO`` under
``strategy="ddp"`` (where an async save once left ``last`` dangling), two chained ``kill -9``s (one during a sync
save, one during an async save), each followed by a ``ckpt_path="last"`` resume that must restore the newest
committed checkpoint, bit for bit.
"""

from __future__ import annotations

from tests.chaos.campaign import Setup, format_table, run_campaign


def test_kills_during_sync_and_async_saves_resume_the_newest_committed_state(tmp_path):
    lines: list[str] = []
    summary = run_campaign(
        workdir=str(tmp_path),
        sync_kills=1,
        async_kills=1,
        kills_per_trial=2,
        seed=7,
        time_limit_s=300,
        width=256,
        layers=2,
        setups=[Setup("ddp", "lightning", "link")],
        log=lines.append,
    )
    report = "\n".join(lines) + "\n" + format_table(summary)
    assert summary["kills"] == {"sync": 1, "async": 1}, report
    assert not any(summary["failures"].values()), report
    verdicts = [e.get("verdict") for e in summary["events"]]
    assert all(v in ("ok", "fresh_ok") for v in verdicts) and "ok" in verdicts, report
    # Nothing committed may fail verification: not after a kill mid-save, nor after one mid-pruning (a removal deletes
    # `.commit` first: engine/storage/location.py Location.remove).
    unverified = [p for p in summary["problems"] if p.get("problem") == "committed checkpoint does not verify"]
    assert unverified == [], report
    assert summary["problems"] == [], report
