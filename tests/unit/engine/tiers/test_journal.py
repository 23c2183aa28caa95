"""The local tier's journal: removals and pointer writes survive a kill, and the next run finishes them.

What a killed run leaves is built here as it would be (committed local checkpoints, uploaded copies on a ``memory://``
remote, journal records written by the real journal class); real kills are in ``tests/integration/test_tier_kill.py``
and ``nox -s kill_tiered``.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from lightning_dcp import DCPCheckpointIO
from lightning_dcp.engine.format.marker import COMMIT_FILE
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.storage.names import STAGING_INFIX, is_staging_name, new_token, staging_name
from lightning_dcp.engine.tiers.journal import JOURNAL_FILE, TierJournal, version_of
from lightning_dcp.engine.tiers.uploader import local_marker


def _ckpt(value: float) -> dict:
    return {"state_dict": {"w": torch.full((16, 4), value)}, "epoch": int(value)}


@pytest.fixture
def remote() -> str:
    return f"memory://journal-{uuid.uuid4().hex[:8]}/run"


def _names(url: str) -> list[str]:
    return sorted(name for name, _ in Location(url).entries())


def _version(path) -> dict:
    return version_of(local_marker(Location(str(path))))


def _first_run(tmp_path, remote: str, count: int) -> str:
    """A run that saved and uploaded ``e0..e{count-1}`` (the local tier keeps them all)."""
    local_dir = str(tmp_path / "local")
    io = DCPCheckpointIO(local_dir=local_dir, local_keep=10)
    for i in range(count):
        io.save_checkpoint(_ckpt(float(i)), f"{remote}/e{i}.ckpt")
    io.teardown()
    return local_dir


def test_records_replay_into_the_same_state_and_compact(tmp_path):
    journal = TierJournal(str(tmp_path))
    v = {"committed_at": 1.5, "metadata": {"size": 10, "checksum": 7}}
    gone = journal.add_removal("a.ckpt", v, None)
    waiting = journal.add_removal("b.ckpt", None, [{"name": "c.ckpt", "version": v}])
    link = journal.add_link("last.ckpt", "c.ckpt")
    journal.saw_listing({"a.ckpt": (1, 2, 0.0)}, {"last.ckpt": "a.ckpt"})
    journal.saw_remote("c.ckpt", (3, 6, 0.0))
    journal.saw_remote("a.ckpt", None)
    journal.done(gone.seq)
    journal.release(waiting.seq)
    with open(journal.path, "ab") as f:
        f.write(b'{"op": "remove", "seq": 9, "name": "../outside", "version": null, "after": null}\n')
        f.write(b'{"op": "link", "seq": 10, "na')  # a line cut short by a kill

    left = tmp_path / staging_name(JOURNAL_FILE, new_token())  # a compaction's temporary, its process killed
    left.write_bytes(b'{"op": "link"')
    older = tmp_path / f"{JOURNAL_FILE}{STAGING_INFIX}{new_token()}"  # the same, as an earlier version named it
    older.write_bytes(b'{"op": "link"')

    again = TierJournal(str(tmp_path))
    again.open()
    assert not left.exists() and not older.exists() and not any(is_staging_name(name) for name in os.listdir(tmp_path))
    assert [(i.seq, i.op, i.name, i.after, i.target) for i in again.pending()] == [
        (waiting.seq, "remove", "b.ckpt", None, ""),
        (link.seq, "link", "last.ckpt", None, "c.ckpt"),
    ]
    assert again.remote == {"c.ckpt": (3, 6, 0.0)} and again.pointers == {"last.ckpt": "a.ckpt"} and again.listed
    with open(again.path) as f:  # rewritten: one listing and the two pending intents
        assert [json.loads(line)["op"] for line in f] == ["listing", "remove", "link"]
    assert again.add_link("last.ckpt", "d.ckpt").seq == link.seq + 1  # sequence numbers go on


def test_a_killed_run_s_removal_and_pointer_are_finished_by_the_next_run(tmp_path, remote):
    local_dir = _first_run(tmp_path, remote, 3)
    # Killed after asking for e0 to go (top-k) and for last -> e2, before the uploader got to either.
    journal = TierJournal(local_dir)
    journal.add_removal("e0.ckpt", _version(f"{local_dir}/e0.ckpt"), None)
    journal.add_link("last.ckpt", "e1.ckpt")
    journal.add_link("last.ckpt", "e2.ckpt")  # the later write wins

    io = DCPCheckpointIO(local_dir=local_dir, local_keep=10)
    assert io.load_checkpoint(remote + "/last.ckpt")["epoch"] == 2  # the first load resumes the tier's work
    io.tiers.wait()
    assert _names(remote) == ["e1.ckpt", "e2.ckpt", "last.ckpt"]
    assert Location(remote + "/last.ckpt").read_pointer() == "e2.ckpt"
    assert sorted(n for n in os.listdir(local_dir) if not n.startswith(".")) == ["e1.ckpt", "e2.ckpt"]
    assert io.tiers.journal.pending() == []

    again = DCPCheckpointIO(local_dir=local_dir, local_keep=10)  # nothing comes back in a later run
    again.tiers.resume()
    again.tiers.wait()
    assert _names(remote) == ["e1.ckpt", "e2.ckpt", "last.ckpt"]


def test_a_removal_that_waited_for_a_save_applies_only_if_that_save_committed(tmp_path, remote):
    local_dir = _first_run(tmp_path, remote, 3)
    journal = TierJournal(local_dir)
    # e0 was to go behind a save of e3 that never committed; e1 behind the save of e2, which did (it replaced
    # nothing: no version before).
    journal.add_removal("e0.ckpt", _version(f"{local_dir}/e0.ckpt"), [{"name": "e3.ckpt", "version": None}])
    journal.add_removal("e1.ckpt", _version(f"{local_dir}/e1.ckpt"), [{"name": "e2.ckpt", "version": None}])
    io = DCPCheckpointIO(local_dir=local_dir, local_keep=10)
    io.tiers.resume()
    io.tiers.wait()
    assert _names(remote) == ["e0.ckpt", "e2.ckpt"]
    assert sorted(n for n in os.listdir(local_dir) if not n.startswith(".")) == ["e0.ckpt", "e2.ckpt"]


def test_a_removal_never_deletes_a_version_saved_since(tmp_path, remote):
    local_dir = _first_run(tmp_path, remote, 1)
    old = _version(f"{local_dir}/e0.ckpt")
    io = DCPCheckpointIO(local_dir=local_dir, local_keep=10)
    io.save_checkpoint(_ckpt(5.0), remote + "/e0.ckpt")  # saved again under the same name, and uploaded
    io.teardown()
    TierJournal(local_dir).add_removal("e0.ckpt", old, None)  # a removal of the old version, left by a kill

    again = DCPCheckpointIO(local_dir=local_dir, local_keep=10)
    again.tiers.resume()
    again.tiers.wait()
    assert _names(remote) == ["e0.ckpt"]
    assert again.load_checkpoint(remote + "/e0.ckpt")["epoch"] == 5  # both copies: the newer version
    fresh = DCPCheckpointIO(local_dir=tmp_path / "fresh")
    assert fresh.load_checkpoint(remote + "/e0.ckpt")["epoch"] == 5


def test_pruning_removes_the_local_copy_at_once_and_a_pointer_never_dangles(tmp_path, remote):
    local_dir = tmp_path / "local"
    io = DCPCheckpointIO(local_dir=local_dir, local_keep=10)
    io.save_checkpoint(_ckpt(1.0), remote + "/e1.ckpt")
    io.checkpointer.tiers.link(Location(remote + "/last.ckpt"), Location(remote + "/e1.ckpt"))
    io.tiers.wait()
    assert Location(remote + "/last.ckpt").read_pointer() == "e1.ckpt"
    tiers = io.tiers
    assert tiers.exists(Location(remote + "/e1.ckpt")) and tiers.exists(Location(remote + "/last.ckpt"))

    io.save_checkpoint(_ckpt(2.0), remote + "/e2.ckpt")  # save_top_k=1: e2, then e1 goes, then last -> e2
    io.remove_checkpoint(remote + "/e1.ckpt")
    assert not (local_dir / "e1.ckpt").exists()  # the local copy goes at once; the remote one behind e2's upload
    assert not tiers.exists(Location(remote + "/e1.ckpt"))  # asked to go: Lightning may reuse the name
    tiers.link(Location(remote + "/last.ckpt"), Location(remote + "/e2.ckpt"))
    io.tiers.wait()
    assert _names(remote) == ["e2.ckpt", "last.ckpt"]
    assert Location(remote + "/last.ckpt").read_pointer() == "e2.ckpt"

    io.remove_checkpoint(remote + "/e2.ckpt")  # no pointer write pending: the pointer goes with its checkpoint
    io.tiers.wait()
    assert _names(remote) == []
    assert not tiers.exists(Location(remote + "/last.ckpt"))


def test_a_crafted_journal_removes_nothing_outside_the_tier(tmp_path, remote):
    local_dir = _first_run(tmp_path, remote, 1)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / COMMIT_FILE).write_text("{}")
    with open(os.path.join(local_dir, JOURNAL_FILE), "ab") as f:
        for name in ("../victim", "/abs", "", "a/b", None, 5):
            record = {"op": "remove", "seq": 100, "name": name, "version": None, "after": None}
            f.write(json.dumps(record).encode() + b"\n")
        f.write(b"[1, 2]\n\xff\xfe\n")
    io = DCPCheckpointIO(local_dir=local_dir)
    io.tiers.resume()
    io.tiers.wait()
    assert io.tiers.journal.skipped == 8  # each logged as a warning
    assert (victim / COMMIT_FILE).is_file() and _names(remote) == ["e0.ckpt"]
