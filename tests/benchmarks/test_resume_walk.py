"""``benchmarks.resume_walk``: which engine room a file belongs to, and what a traced call counts."""

from __future__ import annotations

import os

import lightning_dcp.engine.storage.location as location_module
from benchmarks.resume_walk import room, trace
from lightning_dcp.engine.storage.location import Location


def test_rooms_are_engine_packages_or_top_level_modules():
    assert room(location_module.__file__) == "engine/storage"
    assert room(os.path.join("x", "lightning_dcp", "engine", "checkpointer.py")) == "engine/checkpointer.py"
    assert room(os.path.join("x", "lightning_dcp", "trainer", "memory.py")) is None


def test_a_traced_call_counts_the_rooms_it_enters(tmp_path):
    result = trace(lambda: [Location(str(tmp_path / str(i))).child("a") for i in range(3)])
    storage = result["rooms"]["engine/storage"]
    assert storage["entries"] == 6  # each Location(...) and each .child(...) entered from this test
    assert storage["sites"] == 2 and "location.py" in storage["files"]
    assert result["walk_visits"] == {"engine/storage": 1}  # one room, visited once with repeats folded
    assert result["stack_runs"] == {"engine/storage": 1}  # child() calls Location() inside the same room
    assert result["stack_back"] == []
