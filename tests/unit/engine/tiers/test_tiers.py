"""Tiered checkpoints in one process: a local directory as the fast tier of a ``memory://`` remote directory.

The real object stores and the Trainer are in ``tests/integration/test_tiers.py``; kills in ``test_tier_kill.py``.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch

from lightning_dcp import CheckpointError, DCPCheckpointIO, verify_checkpoint
from lightning_dcp.engine.format.marker import COMMIT_FILE, METADATA_FILE
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.journal import JOURNAL_FILE
from lightning_dcp.engine.tiers.local import MANIFEST_FILE
from lightning_dcp.engine.tiers.upload import SNAPSHOT_PREFIX


def _ckpt(value: float) -> dict:
    return {"state_dict": {"w": torch.full((64, 3), value), "b": torch.arange(5.0) + value}, "epoch": int(value)}


@pytest.fixture
def remote() -> str:
    return f"memory://tier-{uuid.uuid4().hex[:8]}/run"


def _names(url: str) -> list[str]:
    return sorted(name for name, _ in Location(url).entries())


def _local_names(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def test_a_save_commits_locally_then_uploads_the_same_checkpoint(tmp_path, remote):
    local_dir = tmp_path / "local"
    io = DCPCheckpointIO(local_dir=local_dir)
    io.save_checkpoint(_ckpt(1.0), remote + "/a.ckpt")
    local = local_dir / "a.ckpt"
    assert (local / COMMIT_FILE).is_file()  # committed at disk speed; the upload runs behind
    io.tiers.wait()
    copy = Location(remote + "/a.ckpt")
    with copy.open(COMMIT_FILE) as f:
        assert f.read() == (local / COMMIT_FILE).read_bytes()  # byte for byte: recognisably the same checkpoint
    assert copy.sizes() == {name: os.path.getsize(local / name) for name in os.listdir(local)}
    verify_checkpoint(copy.url)  # every record against its checksum
    assert sorted(os.listdir(local_dir)) == [JOURNAL_FILE, MANIFEST_FILE, "a.ckpt"]  # no upload snapshot left behind
    assert json.loads((local_dir / MANIFEST_FILE).read_text()) == {"remote": remote}

    # Loads prefer the local copy of the same checkpoint; a machine with an empty local tier reads the remote one.
    assert io.checkpointer.load(copy.url).url == str(local)
    assert io.checkpointer.load(remote + "/last.ckpt").url == str(local)
    fresh = DCPCheckpointIO(local_dir=tmp_path / "fresh")
    loaded = fresh.checkpointer.load(remote + "/last.ckpt")
    assert loaded.url == copy.url and torch.equal(loaded.tree["state_dict"]["w"], torch.full((64, 3), 1.0))
    assert not (tmp_path / "fresh").exists()  # loading alone writes nothing


def test_pruning_covers_both_tiers_and_the_local_tier_keeps_local_keep(tmp_path, remote):
    local_dir = tmp_path / "local"
    io = DCPCheckpointIO(local_dir=local_dir, local_keep=1, async_save=True)
    for i in range(4):
        io.save_checkpoint(_ckpt(float(i)), f"{remote}/e{i}.ckpt")
        if i >= 3:
            io.remove_checkpoint(f"{remote}/e{i - 3}.ckpt")  # save_top_k=3
    io.teardown()  # waits for the background save and for every upload
    assert _names(remote) == ["e1.ckpt", "e2.ckpt", "e3.ckpt"]
    assert _local_names(local_dir) == ["e3.ckpt"]  # older ones left once committed remotely
    for i in (1, 2, 3):
        assert io.load_checkpoint(f"{remote}/e{i}.ckpt")["epoch"] == i
    assert io.load_checkpoint(remote + "/last.ckpt")["epoch"] == 3


def test_a_rewritten_name_replaces_the_remote_copy(tmp_path, remote):
    io = DCPCheckpointIO(local_dir=tmp_path / "local")
    io.save_checkpoint(_ckpt(1.0), remote + "/last.ckpt")  # ModelCheckpoint(save_last=True) rewrites one name
    io.tiers.wait()
    io.save_checkpoint(_ckpt(2.0), remote + "/last.ckpt")
    io.tiers.wait()
    assert _names(remote) == ["last.ckpt"]  # replaced through a staging prefix, which is gone
    fresh = DCPCheckpointIO(local_dir=tmp_path / "fresh")
    assert fresh.load_checkpoint(remote + "/last.ckpt")["epoch"] == 2


def test_a_restarted_run_finishes_the_uploads_left_behind(tmp_path, remote):
    local_dir = tmp_path / "local"
    plain = DCPCheckpointIO()
    for i in range(2):  # what a killed run leaves: committed local checkpoints, not (or half) uploaded
        plain.save_checkpoint(_ckpt(float(i)), str(local_dir / f"e{i}.ckpt"))
    (local_dir / MANIFEST_FILE).write_text(json.dumps({"remote": remote}))
    half = Location(remote + "/e1.ckpt")
    with half.open(METADATA_FILE, "wb") as f:
        f.write(b"cut short")
    (local_dir / f"{SNAPSHOT_PREFIX}e1.ckpt-0123456789ab").mkdir()
    assert half.exists() and not half.is_committed()

    io = DCPCheckpointIO(local_dir=local_dir)
    assert io.load_checkpoint(remote + "/last.ckpt")["epoch"] == 1  # the first load resumes the uploads
    io.tiers.wait()
    for i in range(2):
        with Location(f"{remote}/e{i}.ckpt").open(COMMIT_FILE) as f:
            assert f.read() == (local_dir / f"e{i}.ckpt" / COMMIT_FILE).read_bytes()
        verify_checkpoint(f"{remote}/e{i}.ckpt")
    assert not any(n.startswith(SNAPSHOT_PREFIX) for n in os.listdir(local_dir))


def test_a_damaged_local_copy_falls_back_to_the_remote_copy(tmp_path, remote):
    local_dir = tmp_path / "local"
    io = DCPCheckpointIO(local_dir=local_dir)
    io.save_checkpoint(_ckpt(3.0), remote + "/a.ckpt")
    io.tiers.wait()
    data = local_dir / "a.ckpt" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="cannot be loaded"):
        loaded = io.checkpointer.load(remote + "/last.ckpt")
    assert loaded.url == remote + "/a.ckpt" and torch.equal(loaded.tree["state_dict"]["w"], torch.full((64, 3), 3.0))


def test_one_local_tier_mirrors_one_remote_directory(tmp_path, remote):
    io = DCPCheckpointIO(local_dir=tmp_path / "local")
    io.save_checkpoint(_ckpt(1.0), remote + "/a.ckpt")
    with pytest.raises(CheckpointError, match="is the local tier of .* Give each remote directory its own"):
        io.save_checkpoint(_ckpt(2.0), remote + "-other/a.ckpt")
    io.teardown()
    with pytest.raises(ValueError, match="local_keep"):
        DCPCheckpointIO(local_dir=tmp_path / "x", local_keep=0)
    with pytest.raises(ValueError, match="local disk"):
        DCPCheckpointIO(local_dir="memory://not-local")


def test_outages_are_told_from_refusals_as_s3fs_raises_them():
    botocore = pytest.importorskip("botocore.exceptions")
    s3fs_errors = pytest.importorskip("s3fs.errors")
    from lightning_dcp.engine.storage.stores import is_unreachable

    def client_error(status: int, code: str) -> Exception:  # what s3fs raises for an HTTP error answer
        answer = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
        return s3fs_errors.translate_boto_error(botocore.ClientError(answer, "PutObject"))

    assert is_unreachable(botocore.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_unreachable(botocore.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert is_unreachable(client_error(500, "InternalError")) and is_unreachable(client_error(503, "SlowDown"))
    assert not is_unreachable(client_error(403, "AccessDenied")) and not is_unreachable(client_error(404, "NoSuchKey"))
    looped = OSError("a")
    looped.__context__ = ValueError("b")
    looped.__context__.__context__ = looped  # a chain that loops ends the search
    assert not is_unreachable(looped)
