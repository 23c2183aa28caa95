"""The checkpointer's route to the memory tier: a save routed to memory, and ``last`` resolved across every tier.

A :class:`~lightning_dcp.engine.checkpointer.Checkpointer` with a memory tier holds a :class:`MemoryRoute`: inside
``Checkpointer.into_memory()`` a save goes to memory (:meth:`MemoryRoute.save`), and a load of a ``last`` name of the
tier's directory, or of the ``last`` entry of a memory area, takes the newest committed checkpoint across memory
(own parts and peers' replicas), node-local disks, ``local_dir`` and the remote store
(:meth:`MemoryRoute.load_newest`). Order is the save counter recorded in ``.commit``; on a tie the memory copy is read
first. A memory checkpoint that fails to assemble or to load (a checksum) falls back to the next newest, with a warning
naming both.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_dcp.engine.catalog.lookup import designates_last
from lightning_dcp.engine.dist import distributed, on_rank0, rank_and_world
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.load.restore import Loaded, load_one
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import recovery, runs
from lightning_dcp.engine.tiers.durable import DurableCatalog
from lightning_dcp.engine.tiers.memory import LAST_ENTRY, MemoryTier
from lightning_dcp.engine.tiers.persist import Persistence
from lightning_dcp.errors import CheckpointError, StateDictMismatchError, checkpoint_failure

__all__ = ["MemoryRoute"]


class MemoryRoute:
    """A memory tier as a checkpointer routes to it: its saves, and ``last`` resolved across every tier.

    Owns the durable directory the tier persists into (:attr:`directory`, bound at its first save or by the front
    end). Built by the :class:`~lightning_dcp.engine.checkpointer.Checkpointer` that has a memory tier.

    Args:
        tier: The memory tier (:class:`~lightning_dcp.engine.tiers.memory.MemoryTier`).
        catalog: What the durable tiers hold (the checkpointer's); its local tier also takes the persisted copies.
    """

    def __init__(
        self,
        tier: MemoryTier,
        *,
        catalog: DurableCatalog,
    ) -> None:
        self.tier = tier
        self.catalog = catalog
        self.directory: Location | None = None
        """The durable directory the memory tier persists into (bound at its first save, or by the front end)."""

    def bind(self, directory: Location, *, persist_keep: int = 2) -> None:
        """Make ``directory`` the durable directory of the memory tier (where it persists). Any rank."""
        if self.directory is not None and self.directory.url == directory.url:
            return
        self.directory = directory
        self.tier.persister = Persistence(self.tier, directory, tiers=self.catalog.tiers, keep=persist_keep)

    def covers(self, location: Location) -> bool:
        """Whether a load of ``location`` asks for the newest checkpoint across the memory tier and its directory."""
        if not location.local and self.directory is None:
            return False
        if location.local and os.path.abspath(location.path) == os.path.join(self.tier.memory_dir, LAST_ENTRY):
            return True
        directory = self.directory
        return directory is not None and designates_last(location) and location.parent().url == directory.url

    def prepare(self, location: Location, *, collective: bool) -> None:
        """Before a save under ``location``: the tier set up and bound to ``location``'s directory. Collective.

        At the first save, the parts on node-local disks are counted too, so that the save counter goes on above them.
        """
        memory = self.tier
        memory.setup(distributed=distributed(collective))
        self.bind(location.parent())
        persistence = memory.persister
        if isinstance(persistence, Persistence) and not persistence.counted:
            memory.wait()  # the tier's group carries one collective at a time
            recovery.restorable(memory)  # counters go on above the parts on node-local disks (hidden from listings)
            persistence.counted = True  # only once counted: a failure above is retried at the next save

    def run_token(self) -> str | None:
        """The run the memory tier's saves belong to (rank 0), after :meth:`prepare`.

        Its own, else the one claimed in its directory (:func:`~lightning_dcp.engine.tiers.runs.claim`).
        """
        if self.tier.run is not None or self.directory is None:  # no directory bound: nothing to claim in
            return self.tier.run
        return runs.claim(self.directory)

    def save(
        self,
        parts: layout.SaveParts,
        location: Location,
        *,
        counter: int,
        run: str | None,
        collective: bool,
        step: int | None,
    ) -> None:
        """Save ``parts`` to the memory tier under ``location``'s name (persisted into its directory). Collective.

        After :meth:`prepare`; ``counter`` and ``run`` are rank 0's (its save counter, its :meth:`run_token`), the
        same on every rank.
        """
        memory = self.tier
        memory.run, memory.run_known = run, True
        rank, world_size = rank_and_world(collective)
        state = parts.state(rank, world_size=world_size)
        memory.save(state, name=location.name, counter=counter, step=step, distributed=distributed(collective))

    def load_newest(self, location: Location, *, collective: bool, **options: Any) -> Loaded | None:
        """Load the newest checkpoint of the memory tier, unless its durable directory holds a newer one. Collective.

        Returns:
            The checkpoint loaded from the memory tier; ``None`` when the durable tiers hold the newest committed
            checkpoint or no memory copy loads (each failure warned): then load the durable tiers'
            :meth:`durable_candidates` (the :class:`~lightning_dcp.engine.checkpointer.Checkpointer` does).
        """
        memory = self.tier
        memory.wait()
        memory.setup(distributed=distributed(collective))
        directory = self.directory
        durable = self._known_run(on_rank0(collective, lambda: (self._newest_durable(), self._run())))
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
        _warn(failures, self.durable_candidates(location).url)  # before the durable load, which may raise
        return None

    def durable_candidates(self, location: Location) -> Location:
        """The ``last`` that designates the durable checkpoints a load of ``location`` falls back to.

        In the directory the memory tier persists into; ``location`` itself before one is bound.
        """
        return self.directory.child("last") if self.directory is not None else location

    @contextlib.contextmanager
    def copy_of(self, newest: Loaded) -> Iterator[str]:
        """Where a load reads the checkpoint :meth:`load_newest` chose (``newest``: what it returned), whole.

        A durable one is given by its URL; a memory one is assembled whole in each node's area (own parts and peers'
        replicas, :func:`~lightning_dcp.engine.tiers.recovery.assemble`) and removed on leaving the context. For
        front ends whose load reads a checkpoint by path (Fabric's). Collective.

        Raises:
            CheckpointError: The memory tier no longer holds the chosen checkpoint (load again).
        """
        if newest.tier != "memory":
            yield newest.url
            return
        memory, name = self.tier, Location(newest.url).name
        ident = next((ident for _, n, ident in recovery.restorable(memory) if n == name), None)
        if ident is None:
            raise CheckpointError(
                f"The memory tier lost {name!r} while it was being loaded; load {newest.url!r} again."
            )
        into = recovery.assemble(memory, name, ident)
        try:
            yield recovery.shared_path(memory, into)
        finally:
            recovery.release(memory, into)

    def anything(self, *, collective: bool) -> bool:
        """Whether any tier (memory, or the durable directory) holds a committed checkpoint to resume. Collective."""
        memory = self.tier
        memory.wait()
        memory.setup(distributed=distributed(collective))
        durable = self._known_run(on_rank0(collective, lambda: (self._newest_durable(), self._run())))
        return durable is not None or bool(recovery.restorable(memory))

    def _run(self) -> str | None:
        """The run token of the tier's durable directory (rank 0; see :mod:`~lightning_dcp.engine.tiers.runs`)."""
        if self.tier.run_known or self.directory is None:
            return self.tier.run
        return runs.read(self.directory)

    def _known_run(self, answer: tuple) -> tuple | None:
        """Record rank 0's run token on this rank's tier (once a directory is bound); return the durable order key."""
        durable, run = answer
        if self.directory is not None:
            self.tier.run, self.tier.run_known = run, True
        return durable

    def _newest_durable(self) -> tuple | None:
        """The order key of the newest committed checkpoint of the bound directory on the durable tiers (rank 0)."""
        directory = self.directory
        if directory is None:
            return None
        try:
            found = self.catalog.newest_committed(directory)  # a marker damaged before its end does not outrank memory
        except CheckpointError as err:
            rank_zero_warn(f"lightning_dcp: the durable tiers of {directory.url!r} cannot be listed ({err}).")
            return None
        return found[0] if found else None


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
