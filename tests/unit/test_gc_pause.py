"""``gc_pause.gc_paused``: pauses from a background save and the training loop overlap without leaving GC off."""

from __future__ import annotations

import gc
import threading

import torch

from lightning_dcp.engine.gc_pause import gc_paused


def test_overlapping_pauses_from_two_threads_enable_the_collector_when_the_last_ends():
    assert gc.isenabled()
    entered, leave = threading.Event(), threading.Event()

    def background() -> None:
        with gc_paused():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=background)
    thread.start()
    entered.wait(10)
    assert not gc.isenabled()
    with gc_paused():  # the training loop's save begins while the background one is running
        leave.set()
        thread.join(10)
        assert not gc.isenabled()  # the background pause ended first: still paused for this one
    assert gc.isenabled()


def test_a_collector_disabled_by_the_user_stays_disabled():
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_parsing_metadata_runs_no_collection(tmp_path):
    from lightning_dcp.engine import metadata
    from lightning_dcp.engine.checkpointer import Checkpointer

    path = str(tmp_path / "many.ckpt")
    Checkpointer().save({"model": {f"layer{i}.bias": torch.zeros(4) for i in range(2000)}}, path, objects={})
    with open(f"{path}/.metadata", "rb") as f:
        data = f.read()
    metadata._PARSED.clear()  # as in a fresh process
    collections = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    assert gc.isenabled()
    gc.callbacks.append(seen)
    try:
        parsed = metadata.load_metadata(data)
    finally:
        gc.callbacks.remove(seen)
    assert len(parsed.state_dict_metadata) >= 2000
    # At most the one collection the pause deferred (it runs at the next allocation after it); unpaused, ~10 objects
    # per entry made one every 700 allocations (80 here).
    assert len(collections) <= 1, collections
    assert gc.isenabled()
