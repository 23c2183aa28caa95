"""Crafted and malformed checkpoints (checksums made consistent): every reader refuses them with a CheckpointError
that names the file, nothing runs, and ``last`` falls back to the newest valid checkpoint where one exists."""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch

from lightning_dcp import (
    CheckpointError,
    CorruptCheckpointError,
    DCPCheckpointIO,
    NotACheckpointError,
    verify_checkpoint,
)
from lightning_dcp.engine.storage.location import POINTER_HEADER
from tests._crafting import edit_commit, recommit, rewrite_metadata, torch_bytes, write_committed
from tests._models import Payload

WEIGHTS = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}


def _checkpoint(step: int) -> dict:
    return {"state_dict": {k: v + step for k, v in WEIGHTS.items()}, "global_step": step}


def _save(directory, name: str, step: int) -> str:
    path = os.path.join(directory, name)
    DCPCheckpointIO().save_checkpoint(_checkpoint(step), path)
    return path


def _load_step(path: str) -> int:
    return DCPCheckpointIO().load_checkpoint(path)["global_step"]


# ------------------------------------------------------------------------------------------------- .commit
@pytest.mark.parametrize(
    "edit",
    [
        lambda m: [1, 2],
        lambda m: {**m, "metadata": {"size": "big", "checksum": 1}},
        lambda m: {**m, "files": {"../../etc/passwd": {"size": 1, "records": []}}},
        lambda m: {**m, "files": {n: {"size": 1, "records": e["records"]} for n, e in m["files"].items()}},
        lambda m: {**m, "version": 99},
        lambda m: {k: v for k, v in m.items() if k != "committed_at"},
    ],
    ids=["list", "size-str", "escaping-file", "records-past-size", "version", "no-time"],
)
def test_malformed_commit_is_a_corrupt_checkpoint_and_last_falls_back(tmp_path, edit):
    _save(tmp_path, "step=1.ckpt", 1)
    broken = _save(tmp_path, "step=2.ckpt", 2)
    edit_commit(broken, edit)
    with pytest.raises(CorruptCheckpointError, match=r"\.commit") as err:
        DCPCheckpointIO().load_checkpoint(broken)
    assert err.value.file == ".commit" and broken in str(err.value)
    with pytest.warns(UserWarning, match=r"step=2\.ckpt.*\.commit"):  # passed over, naming the file and why
        assert _load_step(str(tmp_path / "last.ckpt")) == 1


def test_commit_with_no_records_cannot_vouch_for_flipped_data(tmp_path):
    path = _save(tmp_path, "a.ckpt", 1)
    edit_commit(path, lambda m: {**m, "files": {}})
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    for check in (lambda: DCPCheckpointIO().load_checkpoint(path), lambda: verify_checkpoint(path)):
        with pytest.raises(CorruptCheckpointError, match="no checksum"):
            check()


# ------------------------------------------------------------------------------------------------ .metadata
def _relocate(metadata, relative_path: str) -> None:
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = type(info)(relative_path, info.offset, info.length)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda m: _relocate(m, "../../other_run/__0_0.distcp"), "outside the checkpoint directory"),
        (lambda m: _relocate(m, "/etc/passwd"), "outside the checkpoint directory"),
        (lambda m: _relocate(m, "__9_9.distcp"), "no checksum"),
        (lambda m: m.state_dict_metadata.__setitem__("state_dict.w", "not metadata"), "is a str"),
        (lambda m: setattr(m.state_dict_metadata["state_dict.w"], "size", torch.Size([10**12, 4])), "elements"),
        (lambda m: setattr(m, "storage_data", [1, 2]), "not a dict"),
    ],
    ids=["dotdot", "absolute", "other-file", "entry-type", "huge-chunk", "storage-list"],
)
def test_crafted_metadata_is_refused_naming_the_file(tmp_path, mutate, match):
    path = _save(tmp_path, "a.ckpt", 1)
    rewrite_metadata(path, mutate)
    with pytest.raises(CheckpointError, match=match) as err:
        DCPCheckpointIO().load_checkpoint(path)
    assert path in str(err.value)


def _pickle_bytes8(claimed: int) -> bytes:
    return b"\x80\x04\x8e" + struct.pack("<Q", claimed) + b"tiny" + b"."


@pytest.mark.parametrize(
    "crafted",
    [_pickle_bytes8(2**44), b"\x80\x04" + b"(" * 100_000, b"garbage", pickle.dumps([1, 2])],
    ids=["bytes8-16TB", "deep-nesting", "garbage", "list"],
)
def test_crafted_metadata_bytes_fail_clearly(tmp_path, crafted):
    path = _save(tmp_path, "a.ckpt", 1)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(crafted)
    recommit_metadata_only(path, crafted)
    with pytest.raises(NotACheckpointError, match=r"\.metadata"):
        DCPCheckpointIO().load_checkpoint(path)


def recommit_metadata_only(path: str, metadata_bytes: bytes) -> None:
    from lightning_dcp.engine.format.marker import checksum

    edit_commit(path, lambda m: {**m, "metadata": {"size": len(metadata_bytes), "checksum": checksum(metadata_bytes)}})


def test_crafted_metadata_runs_nothing(tmp_path):
    marker = str(tmp_path / "pwned")
    path = _save(tmp_path, "a.ckpt", 1)
    crafted = pickle.dumps(Payload(marker))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(crafted)
    recommit_metadata_only(path, crafted)
    with pytest.raises(NotACheckpointError, match="refusing"):
        DCPCheckpointIO().load_checkpoint(path)
    assert not os.path.exists(marker)


# ------------------------------------------------------------------------------------------- records and blob
def test_record_that_is_not_a_tensor_is_refused(tmp_path):
    marker = str(tmp_path / "pwned")
    path = str(tmp_path / "a.ckpt")
    write_committed(path, {"state_dict": {"w": torch.ones(2)}, "lightning": torch_bytes({"global_step": 1})})
    # Swap the tensor record for a pickle of a payload of the same length: checksums recomputed.
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    info = next(i for k, i in metadata.storage_data.items() if k.fqn == "state_dict.w")
    payload = torch_bytes({"x": 1})
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        f.write(payload[: info.length].ljust(info.length, b"\0"))
    recommit(path)
    with pytest.raises(CorruptCheckpointError, match="record 'state_dict.w'") as err:
        DCPCheckpointIO().load_checkpoint(path)
    assert err.value.file == info.relative_path
    assert not os.path.exists(marker)


@pytest.mark.parametrize("blob", [b"garbage", torch_bytes([1, 2]), b""], ids=["garbage", "not-a-dict", "empty"])
def test_unreadable_blob_is_corrupt_and_last_falls_back(tmp_path, blob):
    _save(tmp_path, "step=1.ckpt", 1)
    path = str(tmp_path / "step=2.ckpt")
    write_committed(path, {"state_dict": _checkpoint(2)["state_dict"], "lightning": blob})
    with pytest.raises(CorruptCheckpointError, match=r"non-tensor state|record 'lightning'") as err:
        DCPCheckpointIO().load_checkpoint(path)
    assert "\x1b" not in str(err.value) and "weights_only=False" not in str(err.value)
    with pytest.warns(UserWarning, match=r"step=2\.ckpt.*Resuming from the newest valid checkpoint instead.*step=1"):
        assert _load_step(str(tmp_path / "last.ckpt")) == 1


# ------------------------------------------------------------------------------------------- links and pointers
def test_last_ignores_dangling_stale_escaping_and_looping_links(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    other = _save(tmp_path, "other.ckpt", 99)  # another run's checkpoint, outside this dirpath
    _save(run, "step=1.ckpt", 1)
    _save(run, "step=2.ckpt", 2)
    last = str(run / "last.ckpt")
    for target in ("step=99.ckpt", "step=1.ckpt", os.path.relpath(other, run), "last.ckpt"):
        if os.path.lexists(last):
            os.unlink(last)
        os.symlink(target, last)
        assert _load_step(last) == 2, target  # the newest committed checkpoint of run/, whatever the link says


def test_pointers_never_leave_their_directory(tmp_path):
    _save(tmp_path, "step=2.ckpt", 2)
    pointer = tmp_path / "best.ckpt"
    for name in (b"../../other_run/step=6.ckpt", b"/etc", b"a/b", b".."):
        pointer.write_bytes(POINTER_HEADER + name + b"\n")
        with pytest.raises(NotACheckpointError, match="never leave their directory"):
            DCPCheckpointIO().load_checkpoint(str(pointer))
    (tmp_path / "p1.ckpt").write_bytes(POINTER_HEADER + b"p2.ckpt\n")
    (tmp_path / "p2.ckpt").write_bytes(POINTER_HEADER + b"p1.ckpt\n")
    with pytest.raises(NotACheckpointError, match="chain"):
        DCPCheckpointIO().load_checkpoint(str(tmp_path / "p1.ckpt"))
    (tmp_path / "last.ckpt").write_bytes(POINTER_HEADER + b"p1.ckpt\n")  # a looping "last": newest committed wins
    assert _load_step(str(tmp_path / "last.ckpt")) == 2


def test_last_with_nothing_committed_says_so(tmp_path):
    (tmp_path / "step=1.ckpt").mkdir()  # a save that never finished
    os.symlink("step=1.ckpt", tmp_path / "last.ckpt")
    with pytest.raises(NotACheckpointError, match="no checkpoint there is committed"):
        DCPCheckpointIO().load_checkpoint(str(tmp_path / "last.ckpt"))
