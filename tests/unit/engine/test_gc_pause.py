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
    from lightning_dcp.engine.catalog import metadata
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


def _alive(kind: type) -> int:
    return sum(1 for obj in gc.get_objects() if type(obj) is kind)


def test_a_load_leaves_no_parsed_metadata_behind_but_keeps_what_was_remembered_before(tmp_path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from lightning_dcp.engine.catalog import metadata
    from lightning_dcp.engine.checkpointer import Checkpointer

    checkpointer = Checkpointer()
    base, resumed = str(tmp_path / "base.ckpt"), str(tmp_path / "resumed.ckpt")
    weights = {f"layer{i}.bias": torch.full((4,), float(i)) for i in range(300)}
    checkpointer.save({"model": {"other": torch.ones(2)}}, base, objects={})  # .metadata bytes of its own
    checkpointer.save({"model": weights}, resumed, objects={"step": 3})
    metadata._PARSED.clear()
    with open(f"{base}/.metadata", "rb") as f:
        metadata.load_metadata(f.read())  # remembered before the load (an incremental save's base, say)
    remembered = set(metadata._PARSED)
    gc.collect()
    before = _alive(TensorStorageMetadata)
    assert len(remembered) == 1 and before >= 1  # the base's parse is alive

    target = {"model": {k: torch.zeros(4) for k in weights}}
    loaded = checkpointer.load(resumed, target=target)

    assert all(torch.equal(target["model"][k], v) for k, v in weights.items())  # loaded in place
    assert loaded.objects["step"] == 3
    assert set(metadata._PARSED) == remembered  # the load's own parse is forgotten, the base's kept
    assert _alive(TensorStorageMetadata) == before  # and its objects are gone without a collection
    assert gc.isenabled()
