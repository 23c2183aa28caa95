"""The checkpointer's side of the memory tier: a save routed to memory, and ``last`` resolved across every tier.

:class:`~lightning_dcp.engine.checkpointer.Checkpointer` calls these when it has a memory tier: inside
``Checkpointer.into_memory()`` a save goes to memory (:func:`save_to_memory`), and a load of a ``last`` name of the
tier's directory, or of the ``last`` entry of a memory area, takes the newest committed checkpoint across memory
(own parts and peers' replicas), node-local disks, ``local_dir`` and the remote store (:func:`load_newest`). Order is
the save counter recorded in ``.commit``; on a tie the memory copy is read first. A memory checkpoint that fails to
assemble or to load (a checksum) falls back to the next newest, with a warning naming both.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any, Protocol

from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.catalog.lookup import designates_last
from lightning_dcp.engine.dist import distributed, on_rank0, rank_and_world
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.load.restore import Loaded, load_one
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import recovery, runs
from lightning_dcp.engine.tiers.memory import LAST_ENTRY
from lightning_dcp.engine.tiers.persist import Persistence
from lightning_dcp.errors import CheckpointError, StateDictMismatchError, checkpoint_failure

__all__ = ["Checkpointer", "anything", "bind", "covers", "load_newest", "save_to_memory"]


class Checkpointer(Protocol):
    """What these functions use of :class:`lightning_dcp.engine.checkpointer.Checkpointer` (which imports them)."""

    memory: Any
    memory_directory: Location | None
    tiers: Any

    def next_counter(self, location: Location) -> int:
        """As the class described."""

    def record(self, started: float, location: Location, what: str) -> None:
        """As the class described."""

    def load_candidates(self, location: Location, *, collective: bool, **options: Any) -> Loaded:
        """As the class described."""


def bind(checkpointer: Checkpointer, directory: Location, *, persist_keep: int = 2) -> None:
    """Make ``directory`` the durable directory of the checkpointer's memory tier (where it persists). Any rank."""
    memory = checkpointer.memory
    if checkpointer.memory_directory is not None and checkpointer.memory_directory.url == directory.url:
        return
    checkpointer.memory_directory = directory
    memory.persister = Persistence(memory, directory, tiers=checkpointer.tiers, keep=persist_keep)


def covers(checkpointer: Checkpointer, location: Location) -> bool:
    """Whether a load of ``location`` asks for the newest checkpoint across the memory tier and its directory."""
    memory = checkpointer.memory
    if memory is None or not location.local and checkpointer.memory_directory is None:
        return False
    if location.local and os.path.abspath(location.path) == os.path.join(memory.memory_dir, LAST_ENTRY):
        return True
    directory = checkpointer.memory_directory
    return directory is not None and designates_last(location) and location.parent().url == directory.url


def save_to_memory(
    checkpointer: Checkpointer,
    tree: dict[str, Any],
    location: Location,
    *,
    objects: dict[str, Any] | None,
    rank_objects: dict[str, Any] | None,
    info: dict[str, Any],
    collective: bool,
    step: int | None,
    from_rank0: Iterable[tuple[str, ...]] = (),
) -> None:
    """Save to the memory tier under ``location``'s name (persisted into ``location``'s directory). Collective."""
    memory = checkpointer.memory
    started = time.perf_counter()
    memory.setup(distributed=distributed(collective))
    bind(checkpointer, location.parent())
    persistence = memory.persister
    if isinstance(persistence, Persistence) and not persistence.counted:
        persistence.counted = True
        memory.wait()  # the tier's group carries one collective at a time
        recovery.restorable(memory)  # counters go on above the parts on node-local disks (hidden from listings)
    rank, world_size = rank_and_world(collective)
    directory, claim = checkpointer.memory_directory, memory.run is None
    counter, memory.run = on_rank0(
        collective,
        lambda: (checkpointer.next_counter(location), runs.claim(directory) if claim else memory.run),
    )
    memory.run_known = True
    state = layout.build_state(
        tree,
        objects=objects if rank == 0 else None,
        info={**info, "world_size": world_size},
        rank=rank,
        rank_objects=rank_objects,
        from_rank0=from_rank0,
    )
    memory.save(state, name=location.name, counter=counter, step=step, distributed=distributed(collective))
    checkpointer.record(started, location, "saved to the memory tier")


def load_newest(checkpointer: Checkpointer, location: Location, *, collective: bool, **options: Any) -> Loaded:
    """Load the newest committed checkpoint across the memory tier and its durable directory. Collective.

    Raises:
        CheckpointNotFoundError: Nothing is committed in any tier.
        CheckpointError: As :meth:`~lightning_dcp.engine.checkpointer.Checkpointer.load`, for the durable candidates.
    """
    memory = checkpointer.memory
    memory.wait()
    memory.setup(distributed=distributed(collective))
    directory = checkpointer.memory_directory
    durable = on_rank0(collective, lambda: (_newest_durable(checkpointer, directory), _run(checkpointer)))
    durable = _known_run(checkpointer, durable)
    failures = []
    for key, name, ident in recovery.restorable(memory):
        if durable is not None and key < durable:
            break  # the durable tiers hold something newer
        try:
            into = recovery.assemble(memory, name, ident)
        except CheckpointError as err:
            failures.append((name, err))
            continue
        loaded, failure = None, None
        try:
            loaded = load_one(Location(into), collective=collective, node_local=True, **options)
        except StateDictMismatchError as err:
            recovery.release(memory, into)
            raise _named(err, into, f"{name!r} in the memory tier ({memory.memory_dir})") from None
        except Exception as err:
            failure = _named(checkpoint_failure(err, f"Loading {name!r} from the memory tier failed"), into, name)
        failures_seen = [f for f in memory.gather(failure) if f is not None]
        recovery.release(memory, into)
        if not failures_seen:
            loaded.url = directory.child(name).url if directory is not None else name
            loaded.tier = "memory"
            persisted = " (not persisted)" if durable is None or key > durable else ""
            loaded.source = f"{name!r} from the memory tier{persisted}: {memory.origin}"
            _warn(failures, loaded.url)
            return loaded
        failures.append((name, failures_seen[0]))
    target = directory.child("last") if directory is not None else location
    _warn(failures, target.url)  # before the fallback, which may raise (nothing durable): the reason stays visible
    loaded = checkpointer.load_candidates(target, collective=collective, **options)
    loaded.tier = "durable"
    return loaded


def anything(checkpointer: Checkpointer, *, collective: bool) -> bool:
    """Whether any tier (memory, or the durable directory) holds a committed checkpoint to resume. Collective."""
    memory = checkpointer.memory
    memory.wait()
    memory.setup(distributed=distributed(collective))
    directory = checkpointer.memory_directory
    durable = on_rank0(collective, lambda: (_newest_durable(checkpointer, directory), _run(checkpointer)))
    return _known_run(checkpointer, durable) is not None or bool(recovery.restorable(memory))


def _run(checkpointer: Checkpointer) -> str | None:
    """The run token of the tier's durable directory (rank 0; see :mod:`~lightning_dcp.engine.tiers.runs`)."""
    memory, directory = checkpointer.memory, checkpointer.memory_directory
    if memory.run_known or directory is None:
        return memory.run
    return runs.read(directory)


def _known_run(checkpointer: Checkpointer, answer: tuple) -> tuple | None:
    """Record rank 0's run token on this rank's tier (once a directory is bound); return the durable order key."""
    durable, run = answer
    memory = checkpointer.memory
    if checkpointer.memory_directory is not None:
        memory.run, memory.run_known = run, True
    return durable


def _newest_durable(checkpointer: Checkpointer, directory: Location | None) -> tuple | None:
    """The order key of the newest committed checkpoint of ``directory`` on the durable tiers (rank 0)."""
    if directory is None:
        return None
    tiers = checkpointer.tiers
    try:
        if tiers is not None and tiers.covers(directory.child("x")):
            found = tiers.checkpoints(directory)
        else:
            found = committed_checkpoints(directory) if directory.exists() else []
    except CheckpointError as err:
        rank_zero_warn(f"lightning_dcp: the durable tiers of {directory.url!r} cannot be listed ({err}).")
        return None
    return found[0][0] if found else None


def _named(err: Exception, into: str, shown: str) -> Exception:
    """``err`` naming the checkpoint as the user knows it, not the temporary copy assembled to load it."""
    if isinstance(err, StateDictMismatchError):
        err.path = shown
    err.args = (str(err).replace(repr(into), shown).replace(into, shown),)
    return err


def _warn(failures: list[tuple[str, CheckpointError]], used: str) -> None:
    if failures:
        tried = "; ".join(f"{name!r} ({err})" for name, err in failures)
        rank_zero_warn(
            f"lightning_dcp: the newest memory checkpoint(s) cannot be restored: {tried}. Resuming from {used!r}."
        )
