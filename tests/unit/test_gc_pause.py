"""``saving.gc_paused``: pauses from a background save and the training loop overlap without leaving GC off."""

from __future__ import annotations

import gc
import threading

from lightning_dcp.engine.saving import gc_paused


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
