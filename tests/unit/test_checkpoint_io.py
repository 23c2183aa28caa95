"""DCPCheckpointIO in one process (no process group): round trip, commit, bad input, safe loading."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_dcp import (
    CheckpointError,
    CheckpointNotFoundError,
    DCPCheckpointIO,
    NotACheckpointError,
    StateDictMismatchError,
)
from tests._crafting import torch_bytes, write_committed
from tests._models import Payload
from tests._trainer import assert_same


def _checkpoint(scale: float = 1.0) -> dict:
    return {
        "epoch": 3,
        "global_step": 42,
        "state_dict": {"layer.weight": torch.full((4, 3), scale), "layer.bias": torch.arange(4.0) * scale},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.ones(4, 3) * scale}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}],
            }
        ],
        "lr_schedulers": [{"last_epoch": 5, "base_lrs": [0.1]}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 3}}}},
        "callbacks": {"ModelCheckpoint{...}": {"best_model_score": torch.tensor(0.25), "dirpath": "x"}},
        "hyper_parameters": {"hidden": 16, "name": "tiny"},
    }


def _tree_digest(path) -> dict:
    digest = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                digest[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return digest


def test_round_trip_keeps_every_entry(tmp_path):
    io = DCPCheckpointIO()
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint(_checkpoint(), path)
    assert sorted(os.listdir(path)) == [".commit", ".metadata", "__0_0.distcp"]
    loaded = io.load_checkpoint(path)
    info = loaded.pop("lightning_dcp")
    assert info["world_size"] == 1 and info["optimizer_layout"] == "param_id"
    assert_same(_checkpoint(), loaded)


def test_overwrite_replaces_only_after_commit(tmp_path):
    io = DCPCheckpointIO()
    path = str(tmp_path / "last.ckpt")
    io.save_checkpoint(_checkpoint(1.0), path)
    for where in ("extra", "dcp"):  # fails serializing the Trainer state, or inside DCP's writer
        bad = _checkpoint(2.0)
        if where == "extra":
            bad["not_picklable"] = lambda: None
        else:
            bad["optimizer_states"][0]["param_groups"][0]["fn"] = lambda: None
        expected = r"holds builtins.function at \['not_picklable'\]" if where == "extra" else "failed on rank 0"
        with pytest.raises(CheckpointError, match=expected):  # refused before anything is written, or by DCP
            io.save_checkpoint(bad, path)
        assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]  # no staging directory left behind
    assert_same(io.load_checkpoint(path)["state_dict"], _checkpoint(1.0)["state_dict"])
    io.save_checkpoint(_checkpoint(3.0), path)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert_same(io.load_checkpoint(path)["state_dict"], _checkpoint(3.0)["state_dict"])


def test_stale_staging_is_cleaned_by_next_save(tmp_path):
    stale = tmp_path / ".x.ckpt.tmp-0123456789ab"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    DCPCheckpointIO().save_checkpoint(_checkpoint(), str(tmp_path / "x.ckpt"))
    assert sorted(os.listdir(tmp_path)) == ["x.ckpt"]


def test_remove(tmp_path):
    io = DCPCheckpointIO()
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint(_checkpoint(), path)
    io.remove_checkpoint(path)
    assert os.listdir(tmp_path) == []
    io.remove_checkpoint(path)  # removing what is gone is not an error (Lightning may remove twice)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nope.ckpt"):
        DCPCheckpointIO().load_checkpoint(str(tmp_path / "nope.ckpt"))


def test_file_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(NotACheckpointError, match="notes.txt"):
        DCPCheckpointIO().load_checkpoint(str(path))


def test_directory_without_metadata(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(NotACheckpointError, match="no '.commit' marker: its save did not finish"):
        DCPCheckpointIO().load_checkpoint(str(tmp_path / "d"))


def test_plain_dcp_directory_is_refused_with_the_fix(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    with pytest.raises(NotACheckpointError, match="lightning_dcp did not write"):
        DCPCheckpointIO().load_checkpoint(str(tmp_path / "plain"))


def test_mismatched_target_fails_before_loading_and_changes_nothing(tmp_path):
    io = DCPCheckpointIO()
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint(_checkpoint(), path)
    before = _tree_digest(tmp_path)
    target = {"state_dict": {"layer.weight": torch.zeros(5, 3), "other.bias": torch.zeros(4)}}
    with pytest.raises(StateDictMismatchError) as err:
        io.load_checkpoint(path, state_dict=target, strict=True)
    assert err.value.missing_keys == ["other.bias"]
    assert err.value.unexpected_keys == ["layer.bias"]
    assert "layer.weight" in err.value.mismatched and "(4, 3)" in str(err.value) and "(5, 3)" in str(err.value)
    assert torch.equal(target["state_dict"]["layer.weight"], torch.zeros(5, 3))  # nothing was loaded
    assert _tree_digest(tmp_path) == before
    # strict=False loads the keys both have, but a shape mismatch still fails
    target = {"state_dict": {"layer.bias": torch.zeros(4), "other.bias": torch.zeros(4)}}
    loaded = io.load_checkpoint(path, state_dict=target, strict=False)
    assert torch.equal(loaded["state_dict"]["layer.bias"], torch.arange(4.0))
    with pytest.raises(StateDictMismatchError, match="layer.bias"):
        io.load_checkpoint(
            path, state_dict={"state_dict": {"layer.bias": torch.zeros(4, dtype=torch.float64)}}, strict=False
        )


def test_unloadable_state_is_refused_at_save_naming_the_key(tmp_path):
    marker = str(tmp_path / "pwned")
    checkpoint = _checkpoint()
    checkpoint["hyper_parameters"] = {"evil": Payload(marker)}
    path = str(tmp_path / "a.ckpt")
    with pytest.raises(CheckpointError, match=r"tests._models.Payload at \['hyper_parameters'\]\['evil'\]") as err:
        DCPCheckpointIO().save_checkpoint(checkpoint, path)
    assert "add_safe_globals" in str(err.value)
    assert not os.path.exists(marker) and not os.path.exists(path)  # nothing ran, nothing half-written is left


def test_numpy_state_round_trips_as_numpy(tmp_path):
    checkpoint = _checkpoint()
    checkpoint["extra"] = {
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "scalar": np.int64(7),
        "n": [np.bool_(1)],
    }
    path = str(tmp_path / "a.ckpt")
    DCPCheckpointIO().save_checkpoint(checkpoint, path)
    extra = DCPCheckpointIO().load_checkpoint(path)["extra"]
    assert isinstance(extra["array"], np.ndarray) and extra["array"].dtype == np.float32
    assert np.array_equal(extra["array"], checkpoint["extra"]["array"])
    assert type(extra["scalar"]) is np.int64 and extra["scalar"] == 7 and type(extra["n"][0]) is np.bool_


def test_crafted_blob_never_runs_code(tmp_path):
    marker = str(tmp_path / "pwned")
    path = str(tmp_path / "a.ckpt")
    write_committed(path, {"state_dict": _checkpoint()["state_dict"], "lightning": torch_bytes({"x": Payload(marker)})})
    with pytest.raises(CheckpointError, match="add_safe_globals"):
        DCPCheckpointIO().load_checkpoint(path)
    assert not os.path.exists(marker)


def test_storage_options_are_validated():
    with pytest.raises(ValueError, match="thread_count"):
        DCPCheckpointIO(thread_count=0)


def test_thread_count_writes_one_file_per_thread(tmp_path):
    path = str(tmp_path / "a.ckpt")
    DCPCheckpointIO(thread_count=2).save_checkpoint(_checkpoint(), path)
    assert sorted(os.listdir(path)) == [".commit", ".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert_same(DCPCheckpointIO().load_checkpoint(path)["state_dict"], _checkpoint()["state_dict"])


def test_a_bare_module_state_dict_round_trips(tmp_path):
    """Lightning's ddp_spawn launcher saves rank 0's ``model.state_dict()`` through the CheckpointIO and loads it
    back in the main process (``_MultiProcessingLauncher``): it comes back as it was given."""
    weights = {"layer.weight": torch.randn(3, 4), "layer.bias": torch.randn(3)}
    io = DCPCheckpointIO()
    io.save_checkpoint(weights, str(tmp_path / ".temp.ckpt"))
    loaded = io.load_checkpoint(str(tmp_path / ".temp.ckpt"))
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    with pytest.raises(CheckpointError, match="no 'state_dict' entry"):  # anything else still needs Lightning's dict
        io.save_checkpoint({"epoch": 1}, str(tmp_path / "x.ckpt"))


def test_a_copy_or_pickle_of_the_plugin_keeps_its_options_and_builds_its_own_engine(tmp_path):
    """``copy.deepcopy(trainer.callbacks)`` and ``torch.save(trainer)`` reach the plugin, as they reach Lightning's."""
    import copy
    import pickle

    io = DCPCheckpointIO(storage_options={"anon": True}, thread_count=2, sync_files=False)
    for other in (copy.deepcopy(io), pickle.loads(pickle.dumps(io))):
        assert other.checkpointer is not io.checkpointer
        assert other.storage_options == {"anon": True} and other.checkpointer.thread_count == 2
        other.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, str(tmp_path / "copy"))
        assert torch.equal(other.load_checkpoint(str(tmp_path / "copy"))["state_dict"]["w"], torch.ones(2))
