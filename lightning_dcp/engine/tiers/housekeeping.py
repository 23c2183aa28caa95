"""What a memory area holds after a run, and freeing it at a clean end.

A memory area outlives the processes that wrote it: a crash, ``kill -9`` or a clean end all leave it, so that a
restarted job resumes from it. It is freed only when removed (``rm -r``), with the machine (a reboot), or by
:func:`free` at a clean end (``MemoryCheckpoint(free_at_end=True)``), which first makes the newest checkpoint durable.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from lightning_dcp.engine.storage.localfs import remove_path

if TYPE_CHECKING:
    from lightning_dcp.engine.tiers.memory import MemoryTier

__all__ = ["free", "held_bytes"]


def held_bytes(path: str) -> int:
    """The memory the files under ``path`` take (what ``du`` shows), in bytes."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def free(tier: MemoryTier) -> int | None:
    """Free this run's part of every node's memory area once its newest checkpoint is durable.

    Waits for the save in flight and persists the newest memory checkpoint unless it was; then each node's leader
    removes this run's parts (its own and the replicas it holds), the free slots and staging directories. Another
    run's parts and the ``last`` entry stay.

    Collective: call on all ranks, after the last save.

    Returns:
        The bytes freed on this node (its leader; ``0`` on its other ranks), or ``None`` where nothing could be made
        durable (no durable directory bound): nothing is freed then.

    Raises:
        CheckpointError: The save in flight, or persisting the newest checkpoint, failed (nothing is freed).
    """
    tier.wait()
    if tier.topology is None or tier.persister is None:
        return None
    if tier.saved:
        tier.persist(tier.saved[-1])
    tier.gather(None)  # every rank is done with the files
    freed = 0
    if tier.topology.leader:
        store = tier.store
        doomed = [p.path for p in store.parts() if p.run == tier.run] + store.free_slots()
        for path in doomed:
            freed += held_bytes(path)
            store.uncommit(path)
            remove_path(path)
        freed += sum(held_bytes(p) for p in _stale(store.root))
        store.remove_stale()
    tier.saved = []
    tier.gather(None)
    tier.mappings.prune()  # the removed files' pages go back to the system once unmapped
    return freed


def _stale(root: str) -> list[str]:
    return [
        os.path.join(root, e) for e in os.listdir(root) if e.startswith(".") and os.path.isdir(os.path.join(root, e))
    ]
