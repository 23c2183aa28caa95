"""Checksums, commit marker and safe metadata: damaged or crafted checkpoints never load silently."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from lightning_dcp import (
    CorruptCheckpointError,
    DCPCheckpointIO,
    NotACheckpointError,
    verify_checkpoint,
)
from lightning_dcp.engine.format.marker import checksum
from lightning_dcp.verify import main as verify_main
from tests._crafting import write_commit
from tests._models import Payload


def _save(path: str) -> dict:
    checkpoint = {
        "state_dict": {f"layer{i}.weight": torch.randn(64, 64) for i in range(4)},
        "global_step": 7,
    }
    DCPCheckpointIO().save_checkpoint(checkpoint, path)
    return checkpoint


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_commit_marker_records_every_record(tmp_path):
    path = str(tmp_path / "a.ckpt")
    _save(path)
    marker = json.loads((tmp_path / "a.ckpt" / ".commit").read_text())
    assert marker["algorithm"] == "xxh3_64"
    records = marker["files"]["__0_0.distcp"]["records"]
    assert len(records) == 5  # 4 tensors + the Trainer-state blob
    data = (tmp_path / "a.ckpt" / "__0_0.distcp").read_bytes()
    for offset, length, digest in records:
        assert checksum(data[offset : offset + length]) == digest
    assert marker["files"]["__0_0.distcp"]["size"] == len(data)
    verify_checkpoint(path)
    assert verify_main([path]) == 0


def test_flipped_bit_in_data_fails_naming_the_file(tmp_path):
    path = str(tmp_path / "a.ckpt")
    _save(path)
    data_file = os.path.join(path, "__0_0.distcp")
    _flip(data_file, os.path.getsize(data_file) // 2)
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp") as err:
        DCPCheckpointIO().load_checkpoint(path)
    assert err.value.file == "__0_0.distcp"
    verify_checkpoint(path, full=False)  # sizes still match: only the full pass sees a flipped bit
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp"):
        verify_checkpoint(path)
    assert verify_main([path]) == 1


def test_truncated_data_file_fails_fast(tmp_path):
    path = str(tmp_path / "a.ckpt")
    _save(path)
    data_file = os.path.join(path, "__0_0.distcp")
    os.truncate(data_file, os.path.getsize(data_file) - 100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        DCPCheckpointIO().load_checkpoint(path)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        verify_checkpoint(path, full=False)


def test_flipped_bit_in_metadata_fails(tmp_path):
    path = str(tmp_path / "a.ckpt")
    _save(path)
    _flip(os.path.join(path, ".metadata"), 40)
    with pytest.raises(CorruptCheckpointError, match=".metadata"):
        DCPCheckpointIO().load_checkpoint(path)


def test_missing_commit_marker_is_an_incomplete_save(tmp_path):
    path = str(tmp_path / "a.ckpt")
    _save(path)
    os.unlink(os.path.join(path, ".commit"))
    with pytest.raises(NotACheckpointError, match="did not finish"):
        DCPCheckpointIO().load_checkpoint(path)


def test_crafted_metadata_runs_nothing(tmp_path):
    # An attacker replaces .metadata and recomputes the commit marker: the metadata unpickler still refuses.
    path = str(tmp_path / "a.ckpt")
    _save(path)
    marker_file = str(tmp_path / "pwned")
    crafted = pickle.dumps(Payload(marker_file))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(crafted)
    commit = json.loads((tmp_path / "a.ckpt" / ".commit").read_text())
    commit["metadata"] = {"size": len(crafted), "checksum": checksum(crafted)}
    write_commit(str(tmp_path / "a.ckpt"), commit)
    with pytest.raises(NotACheckpointError, match="not part of DCP's metadata format"):
        DCPCheckpointIO().load_checkpoint(path)
    assert not os.path.exists(marker_file)


def test_last_falls_back_to_newest_valid_checkpoint(tmp_path):
    io = DCPCheckpointIO()
    older = _save(str(tmp_path / "epoch=0.ckpt"))
    newer = _save(str(tmp_path / "epoch=1.ckpt"))
    _save(str(tmp_path / "last.ckpt"))
    _flip(str(tmp_path / "last.ckpt" / ".metadata"), 10)
    with pytest.warns(UserWarning, match=r"last\.ckpt.*epoch=1\.ckpt"):
        loaded = io.load_checkpoint(str(tmp_path / "last.ckpt"))
    for key, value in newer["state_dict"].items():
        assert torch.equal(loaded["state_dict"][key], value)
    # the newest one broken too: the next newest valid one
    os.unlink(str(tmp_path / "epoch=1.ckpt" / ".commit"))
    with pytest.warns(UserWarning, match=r"epoch=0\.ckpt"):
        loaded = io.load_checkpoint(str(tmp_path / "last.ckpt"))
    assert torch.equal(loaded["state_dict"]["layer0.weight"], older["state_dict"]["layer0.weight"])
    # an explicit, non-"last" path never falls back
    with pytest.raises(NotACheckpointError):
        io.load_checkpoint(str(tmp_path / "epoch=1.ckpt"))
