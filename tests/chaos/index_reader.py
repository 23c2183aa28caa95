"""Fuzzing the record index of ``.commit`` (issue 40, item 1): names, records, dtypes and shapes swapped or edited.

A restore through the index reads each tensor where the index says, without ``.metadata``, so an index edited after
commit could load one tensor into another's place with every record's checksum intact. Each input edits the index
(or the records it names) of the template's marker, then writes the marker either as edited (its own checksum left
stale: every edit must be refused) or re-sealed (a crafted marker: a load must be exact or refused, and a load of
other values must at least fail ``verify``, which compares the index with ``.metadata``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from hypothesis import strategies as st

from lightning_dcp import verify_checkpoint
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.format.marker import COMMIT_FILE
from tests._crafting import sealed
from tests.chaos._checks import Finding, call, same
from tests.chaos.readers import Reader

__all__ = ["IndexReader"]

EDITS = ("names", "records", "dtype", "shape", "file", "drop", "duplicate")


class IndexReader(Reader):
    name = "index"

    def strategy(self) -> st.SearchStrategy[tuple]:
        edit = st.tuples(st.sampled_from(EDITS), st.integers(0, 1 << 16), st.integers(0, 1 << 16))
        return st.tuples(st.lists(edit, min_size=1, max_size=3), st.booleans())

    def check(self, data: tuple) -> str:
        edits, resealed = data
        ckpt = self.t.fresh()
        marker = json.loads(self.t.commit_bytes)
        for kind, i, j in edits:
            _edit(marker, kind, i, j)
        edited = marker != json.loads(self.t.commit_bytes)
        with open(os.path.join(ckpt, COMMIT_FILE), "wb") as f:
            f.write(sealed(marker) if resealed else json.dumps(marker).encode())
        verified, _ = call(lambda: verify_checkpoint(ckpt), self.stats)
        try:
            self._through_the_index(ckpt)
            outcome = self.load_all(ckpt)
        except Finding as finding:
            if resealed and verified != "ok" and finding.kind == "wrong-load":
                return "wrong load caught by verify"  # a crafted marker: the restore trusts its own checksum
            raise
        if outcome == "loaded" and edited and not resealed:
            raise Finding("trusted", "a marker edited after commit (its own checksum stale) was loaded")
        return outcome

    def _through_the_index(self, ckpt: str) -> None:
        """A restore into a target of every saved state dict: the one that reads by the index (``load_all``'s do
        not)."""
        target = {
            "state_dict": self.t.target()["state_dict"],
            "optimizer_states": [_zeroed(s) for s in self.t.checkpoint["optimizer_states"]],
        }
        outcome, value = call(lambda: Checkpointer().load(ckpt, target=target, strict=False), self.stats)
        if outcome == "ok":
            for key in target:
                if not same(value.tree.get(key), self.t.reference.get(key)):
                    raise Finding("wrong-load", f"loaded {key!r} differs from what was saved")


def _zeroed(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeroed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_zeroed(v) for v in value)
    return value


def _edit(marker: dict[str, Any], kind: str, i: int, j: int) -> None:
    files = marker["index"]["files"]
    name = sorted(files)[i % len(files)]
    entries, records = files[name], marker["files"][name]["records"]
    if not entries:
        return
    a, b = i % len(entries), j % len(entries)
    if kind == "names":
        entries[a][0], entries[b][0] = entries[b][0], entries[a][0]
    elif kind == "records":
        records[a], records[b] = records[b], records[a]
    elif kind == "dtype" and len(entries[a]) > 1:
        entries[a][1] = ("float64", "int32", "bfloat16", "bool")[j % 4]
    elif kind == "shape" and len(entries[a]) > 2:
        entries[a][2] = list(reversed(entries[a][2])) if j % 2 else [d + 1 for d in entries[a][2]]
    elif kind == "file" and len(files) > 1:
        other = sorted(files)[(i + 1) % len(files)]
        files[other].append(entries.pop(a))
        marker["files"][other]["records"].append(records.pop(a))
    elif kind == "drop":
        entries.pop(a)
        records.pop(a)
    elif kind == "duplicate":
        entries[b] = list(entries[a])
