"""After a failed run, a memory-tier save stuck in its background part is left unfinished within a bound.

A real async save of the memory tier (one process) whose background part never returns: its persist step waits on an
event nobody sets, as a replication transfer waits for a peer that died (gloo's point-to-point waits do not fail when
the peer's connection closes). Before ``give_up``, the teardown of a failed run waited for it forever.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch

from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.memory import MemoryTier, _close_at_exit


def _checkpointer(tmp_path) -> Checkpointer:
    tier = MemoryTier(tmp_path / "shm", replicas=0, async_save=True, persist_every=1)
    checkpointer = Checkpointer(CheckpointerConfig(memory=tier))
    checkpointer.memory_route.bind(Location(str(tmp_path / "durable")))
    return checkpointer


def _save(checkpointer: Checkpointer, tmp_path, step: int) -> None:
    with checkpointer.into_memory():
        checkpointer.save(
            {"state_dict": {"w": torch.full((256,), float(step))}},
            str(tmp_path / "durable" / f"memory-step={step}"),
            objects={},
            step=step,
        )


def test_a_stuck_background_save_is_left_after_the_bound_and_close_returns(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    tier = checkpointer.memory
    never = threading.Event()
    entered = threading.Event()

    def stuck(saved, part):  # the persist step of the background part: it never returns
        entered.set()
        never.wait()

    tier.persister = stuck
    _save(checkpointer, tmp_path, 1)
    assert entered.wait(30), "the background part never reached its persist step"

    began = time.monotonic()
    assert checkpointer.give_up(after=0.5) is True
    waited = time.monotonic() - began
    assert 0.45 <= waited < 5.0, waited

    began = time.monotonic()
    checkpointer.close()  # what the teardown does next: nothing left to wait for
    _close_at_exit(weakref.ref(tier))  # and at interpreter exit
    assert time.monotonic() - began < 2.0
    assert tier.topology is None and tier.group is None
    never.set()


def test_a_save_that_finishes_within_the_bound_is_kept_and_closed_as_usual(tmp_path):
    checkpointer = _checkpointer(tmp_path)
    tier = checkpointer.memory
    persisted: list[str] = []
    tier.persister = lambda saved, part: persisted.append(saved.name)
    _save(checkpointer, tmp_path, 2)
    assert checkpointer.give_up(after=30.0) is False  # it finished: nothing was left
    assert persisted == ["memory-step=2"]
    checkpointer.close()
    assert [s.name for s in tier.saved] == ["memory-step=2"]
