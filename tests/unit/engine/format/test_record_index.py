"""The record index of ``.commit`` is trusted only as written at save (issue 40, item 1).

A restore through the index reads each tensor at the place the index names, without ``.metadata``: an index whose
names or records were swapped after commit would load ``l1.weight`` into ``l0.weight`` with every record's checksum
intact. The marker's own checksum refuses such an edit on the restore path; ``verify`` (and every check that parses
``.metadata``) also compares the index with ``.metadata`` entry by entry, so a re-sealed (crafted) marker fails there.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_dcp import CorruptCheckpointError, verify_checkpoint
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.format.marker import SEAL_KEY, parse_commit
from lightning_dcp.verify import main as verify_main
from tests._crafting import write_commit


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    model = {f"l{i}.weight": torch.randn(4, 4, generator=g) for i in range(4)}
    optimizer = {"state": {"l0.weight": {"exp_avg": torch.randn(4, 4, generator=g)}}, "param_groups": []}
    return {"state_dict": model, "optimizer_states": [optimizer]}


def _saved(tmp_path) -> str:
    path = str(tmp_path / "step=1.ckpt")
    Checkpointer().save(_state(), path, objects={"step": 1})
    return path


def _blank() -> dict:
    return {
        "state_dict": {k: torch.zeros_like(v) for k, v in _state()["state_dict"].items()},
        "optimizer_states": [{"state": {"l0.weight": {"exp_avg": torch.zeros(4, 4)}}, "param_groups": []}],
    }


def _marker(path: str) -> dict:
    with open(os.path.join(path, ".commit")) as f:
        return json.load(f)


def _swap_names(marker: dict, a: str, b: str) -> None:
    for entries in marker["index"]["files"].values():
        for entry in entries:
            if entry[0] in (a, b):
                entry[0] = b if entry[0] == a else a


def _swap_records(marker: dict, a: str, b: str) -> None:
    """Swap the ``[offset, length, checksum]`` of ``a``'s and ``b``'s records (same length): each still verifies."""
    ((name, entries),) = marker["index"]["files"].items()
    records = marker["files"][name]["records"]
    i, j = (next(n for n, e in enumerate(entries) if e[0] == fqn) for fqn in (a, b))
    assert records[i][1] == records[j][1]
    records[i], records[j] = records[j], records[i]


EDITS = {
    "names": lambda m: _swap_names(m, "state_dict.l0.weight", "state_dict.l1.weight"),
    "records": lambda m: _swap_records(m, "state_dict.l0.weight", "state_dict.l1.weight"),
    "weight and exp_avg": lambda m: _swap_names(
        m, "state_dict.l2.weight", "optimizer_states.0.state.l0.weight.exp_avg"
    ),
}


def _write_raw(path: str, marker: dict) -> None:
    """The edit a person or a tool makes: the JSON rewritten, its own checksum left as it was."""
    with open(os.path.join(path, ".commit"), "w") as f:
        json.dump(marker, f)


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_index_edited_after_commit_is_refused_by_the_restore_and_by_verify(tmp_path, edit, capsys):
    path = _saved(tmp_path)
    marker = _marker(path)
    EDITS[edit](marker)
    _write_raw(path, marker)
    with pytest.raises(CorruptCheckpointError, match="does not match its own checksum") as err:
        Checkpointer().load(path, target=_blank())
    assert err.value.file == ".commit" and path in str(err.value) and "Resume from another checkpoint" in str(err.value)
    with pytest.raises(CorruptCheckpointError, match="does not match its own checksum"):
        verify_checkpoint(path)
    assert verify_main([path, "--no-progress"]) == 1
    assert "does not match its own checksum" in capsys.readouterr().err


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_resealed_index_that_disagrees_with_metadata_fails_verify(tmp_path, edit, capsys):
    """A crafted marker (its own checksum recomputed): ``verify`` compares the index with ``.metadata``."""
    path = _saved(tmp_path)
    marker = _marker(path)
    EDITS[edit](marker)
    write_commit(path, marker)
    for full in (False, True):
        with pytest.raises(CorruptCheckpointError, match="record index in .commit disagrees with .metadata") as err:
            verify_checkpoint(path, full=full)
        assert err.value.file == ".commit" and path in str(err.value)
    assert verify_main([path, "--no-progress"]) == 1
    assert "disagrees with .metadata" in capsys.readouterr().err


def test_an_unedited_checkpoint_restores_through_the_index_and_verifies(tmp_path):
    path = _saved(tmp_path)
    assert SEAL_KEY in parse_commit(open(os.path.join(path, ".commit"), "rb").read())
    verify_checkpoint(path, full=True)
    loaded = Checkpointer().load(path, target=_blank())
    for key, value in _state()["state_dict"].items():
        assert torch.equal(loaded.tree["state_dict"][key], value), key


def test_a_marker_without_its_own_checksum_restores_by_metadata_not_by_its_index(tmp_path):
    """A marker written before markers were sealed (or stripped of the seal): its index is never used."""
    path = _saved(tmp_path)
    marker = _marker(path)
    del marker[SEAL_KEY]
    _swap_names(marker, "state_dict.l0.weight", "state_dict.l1.weight")
    _write_raw(path, marker)
    loaded = Checkpointer().load(path, target=_blank())
    for key, value in _state()["state_dict"].items():
        assert torch.equal(loaded.tree["state_dict"][key], value), key  # .metadata's places, not the index's
