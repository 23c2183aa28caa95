"""What a local tier and its remote directory hold: the reads behind loads, ``file_exists`` and save counters.

Two kinds of answers, for two moments of a run:

- Loads (:meth:`TierReads.checkpoints`, :meth:`TierReads.candidates`) read the remote directory: they run before
  training (``ckpt_path``, ``load_from_checkpoint``), and a stale answer would resume the wrong state. While the
  remote store cannot be read they go on from the local tier, with a warning; with nothing local, the store's error
  is raised.
- Questions asked inside the training loop (:meth:`TierReads.known_checkpoints`, :meth:`TierReads.exists`) never
  call the remote store: they are answered from the local tier, the uploader's queue and the journal's record of the
  remote directory (:mod:`lightning_dcp.engine.tiers.journal`).

:class:`TierReads` is the base class of :class:`~lightning_dcp.engine.tiers.local.Tiers`. Rank 0 only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from lightning_dcp.engine.catalog.integrity import Committed, committed_checkpoints
from lightning_dcp.engine.catalog.lookup import candidates as one_tier_candidates
from lightning_dcp.engine.catalog.lookup import designates_last, of_named_run
from lightning_dcp.engine.format.marker import COMMIT_FILE, order_key
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.uploader import local_marker

__all__ = ["TierReads"]


class TierReads:
    """The reads of a local tier (rank 0).

    The base class of :class:`~lightning_dcp.engine.tiers.local.Tiers`, which owns the state they read (``local``,
    ``journal``, ``retry``, ``uploader``) and the naming they use (``local_twin``, ``remote_dir``, ``mirrors``,
    ``twins``, ``resume``).
    """

    def checkpoints(self, remote_dir: Location) -> list[tuple[tuple, Location]]:
        """Committed checkpoints of ``remote_dir`` and of the local tier (when it mirrors it), newest first.

        Lists the remote directory; while it cannot be read, the local tier's checkpoints only, with a warning. The same
        checkpoint on both tiers (the same ``.commit``) appears twice, its local copy first.
        """
        found = []
        mirrored = self.mirrors(remote_dir)
        if mirrored and os.path.isdir(self.local.path):
            found = [(entry, 0) for entry in committed_checkpoints(self.local, whole=False)]
        remote = _reachable(remote_dir, _ranked, None, bool(found))
        if remote is not None and mirrored:
            self.journal.saw_listing({loc.name: key for key, loc in remote})
        found += [(entry, 1) for entry in remote or []]
        found.sort(key=lambda pair: (pair[0][0], -pair[1], pair[0][1].name), reverse=True)
        return [entry for entry, _ in found]

    def known_checkpoints(self, remote_dir: Location, *, wait: bool = True) -> list[tuple[tuple, Location]]:
        """Committed checkpoints of both tiers as far as the tier knows, newest first: no remote call.

        The remote side comes from the journal (the uploader's listings and uploads). Where the tier knows nothing of
        the remote directory yet (a new ``local_dir``), ``wait`` waits up to ``Retry.first_listing`` seconds for the
        uploader's first listing, then goes on with a warning. A directory the tier does not mirror is listed.
        """
        if not self.mirrors(remote_dir):
            return self.checkpoints(remote_dir)
        self.resume()
        self.journal.open()
        limit = self.retry.first_listing
        if wait and not self.journal.listed and not self.uploader.listed.wait(limit):
            warnings.warn(
                f"lightning_dcp: the remote directory {remote_dir.url!r} did not answer within {limit:.0f} s; save"
                f" counters continue from the local tier {self.local.url!r}. A checkpoint another run saved there may"
                " count as newer than this run's until it is pruned.",
                stacklevel=3,
            )
        found = [(key, 0, loc) for key, loc in committed_checkpoints(self.local, whole=False)]
        found += [(key, 1, remote_dir.child(name)) for name, key in dict(self.journal.remote).items()]
        return _newest_first(found)

    def exists(self, remote: Location) -> bool:
        """Whether the checkpoint or pointer ``remote`` exists on either tier or is on its way: no remote call.

        What ``DCPModelCheckpoint.file_exists`` asks before it names a new checkpoint: committed locally, being saved,
        queued for upload or as a pointer, or known to the journal as held remotely (and not asked to go).
        """
        if self.local_twin(remote).is_committed():
            return True
        self.journal.open()
        name = remote.name
        removing = {intent.name for intent in self.journal.pending() if intent.op == "remove"}
        u = self.uploader
        with u.cond:
            tasks = [*u.queue, *u.held, *u.deferred, *([u.active] if u.active else [])]
            coming = {t.name for t in tasks if t.kind in ("upload", "link")} | set(u.saving)
        held_remotely = name in self.journal.remote or name in self.journal.pointers
        return name in coming or (held_remotely and name not in removing)

    def candidates(self, location: Location) -> list[str]:
        """:func:`lightning_dcp.engine.catalog.lookup.candidates` over both tiers: what a load of ``location`` tries.

        A ``last*`` name or a ``.commit`` (in either tier's directory): every committed checkpoint of both tiers, newest
        first, local copies first. An explicit checkpoint: its committed copies, newest first, local first.
        """
        self.resume()
        if designates_last(location):
            directory = location.parent().parent() if location.name == COMMIT_FILE else location.parent()
            if directory.local and os.path.abspath(directory.path).rstrip("/") == self.local.path.rstrip("/"):
                directory = self.remote_dir() or directory
            found = self.checkpoints(directory) if not directory.local else []
            if not found:
                return one_tier_candidates(location)
            entry = location.parent() if location.name == COMMIT_FILE else location
            return [loc.url for _, loc in of_named_run(found, entry)]
        resolved = location
        if not location.local:  # follow pointers; while the remote cannot be read, a local copy of the name serves
            local = self.local_twin(location) if self.mirrors(location.parent()) else None
            resolved = _reachable(location, Location.resolve, location, local is not None and local_marker(local))
        twins = self.twins(resolved)
        if twins is None:
            return one_tier_candidates(location)
        here = local_marker(twins[0])
        copies = [(here, 0, twins[0]), (_reachable(twins[1], local_marker, None, here), 1, twins[1])]
        committed = sorted(((order_key(m), -rank, c.url) for m, rank, c in copies if m is not None), reverse=True)
        return [url for *_, url in committed] or one_tier_candidates(location)


def _newest_first(found: list[tuple[tuple, int, Location]]) -> list[tuple[tuple, Location]]:
    found.sort(key=lambda entry: (entry[0], -entry[1], entry[2].name), reverse=True)
    return [(key, loc) for key, _, loc in found]


def _ranked(directory: Location) -> list[Committed]:
    """The committed checkpoints of ``directory``, ranked by the order at each marker's end.

    A load checks whole what it opens; the uploader lists whole before it removes anything.
    """
    return committed_checkpoints(directory, whole=False)


def _reachable(remote: Location, read: Callable[[Location], Any], default: Any, fallback: Any) -> Any:
    """``read(remote)``, or ``default`` with a warning where the remote store fails and the local tier has a fallback.

    Loads go on from the local tier while the remote store cannot be reached; without a local fallback the remote
    store's error (a ``CheckpointError``: ``StorageUnavailableError``, refused credentials, a missing bucket) is raised.
    """
    try:
        return read(remote)
    except Exception as err:
        if not fallback:
            raise
        warnings.warn(
            f"lightning_dcp: the remote tier {remote.url!r} cannot be read ({err}); loading from the local tier only.",
            stacklevel=4,
        )
        return default
