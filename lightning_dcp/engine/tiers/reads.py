"""What a local tier and its remote directory hold: the reads behind loads, ``file_exists`` and save counters.

Two kinds of answers, for two moments of a run:

- Loads (:func:`both`, :func:`candidates`) read the remote directory: they run before training (``ckpt_path``,
  ``load_from_checkpoint``), and a stale answer would resume the wrong state. While the remote store cannot be read
  they go on from the local tier, with a warning; with nothing local, the store's error is raised.
- Questions asked inside the training loop (:func:`known`, :func:`exists`) never call the remote store: they are
  answered from the local tier, the uploader's queue and the journal's record of the remote directory
  (:mod:`lightning_dcp.engine.tiers.journal`).

Every function takes the :class:`~lightning_dcp.engine.tiers.local.Tiers` it reads. Rank 0 only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, Protocol

from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.catalog.lookup import candidates as one_tier_candidates
from lightning_dcp.engine.catalog.lookup import designates_last, of_named_run
from lightning_dcp.engine.format.marker import COMMIT_FILE, order_key
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.uploader import local_marker

__all__ = ["Tiers", "both", "candidates", "exists", "known"]


class Tiers(Protocol):
    """What these reads use of a local tier: :class:`lightning_dcp.engine.tiers.local.Tiers` (which imports them)."""

    local: Location
    journal: Any
    retry: Any
    uploader: Any

    def resume(self) -> None:
        """As the class described."""

    def local_twin(self, remote: Location) -> Location:
        """As the class described."""

    def remote_dir(self) -> Location | None:
        """As the class described."""

    def mirrors(self, directory: Location) -> bool:
        """As the class described."""

    def twins(self, location: Location) -> tuple[Location, Location] | None:
        """As the class described."""


def both(tiers: Tiers, remote_dir: Location) -> list[tuple[tuple, Location]]:
    """Committed checkpoints of ``remote_dir`` and of the local tier (when it mirrors it), newest first.

    Lists the remote directory; while it cannot be read, the local tier's checkpoints only, with a warning. The same
    checkpoint on both tiers (the same ``.commit``) appears twice, its local copy first.
    """
    found = []
    mirrored = tiers.mirrors(remote_dir)
    if mirrored and os.path.isdir(tiers.local.path):
        found = [(entry, 0) for entry in committed_checkpoints(tiers.local)]
    remote = _reachable(remote_dir, committed_checkpoints, None, bool(found))
    if remote is not None and mirrored:
        tiers.journal.saw_listing({loc.name: key for key, loc in remote})
    found += [(entry, 1) for entry in remote or []]
    found.sort(key=lambda pair: (pair[0][0], -pair[1], pair[0][1].name), reverse=True)
    return [entry for entry, _ in found]


def known(tiers: Tiers, remote_dir: Location, *, wait: bool = True) -> list[tuple[tuple, Location]]:
    """Committed checkpoints of both tiers as far as the tier knows, newest first: no remote call.

    The remote side comes from the journal (the uploader's listings and uploads). Where the tier knows nothing of
    the remote directory yet (a new ``local_dir``), ``wait`` waits up to ``Retry.first_listing`` seconds for the
    uploader's first listing, then goes on with a warning. A directory the tier does not mirror is listed.
    """
    if not tiers.mirrors(remote_dir):
        return both(tiers, remote_dir)
    tiers.resume()
    tiers.journal.open()
    limit = tiers.retry.first_listing
    if wait and not tiers.journal.listed and not tiers.uploader.listed.wait(limit):
        warnings.warn(
            f"lightning_dcp: the remote directory {remote_dir.url!r} did not answer within {limit:.0f} s; save"
            f" counters continue from the local tier {tiers.local.url!r}. A checkpoint another run saved there may"
            " count as newer than this run's until it is pruned.",
            stacklevel=3,
        )
    found = [(key, 0, loc) for key, loc in committed_checkpoints(tiers.local)]
    found += [(key, 1, remote_dir.child(name)) for name, key in dict(tiers.journal.remote).items()]
    return _newest_first(found)


def exists(tiers: Tiers, remote: Location) -> bool:
    """Whether the checkpoint or pointer ``remote`` exists on either tier or is on its way: no remote call.

    What ``DCPModelCheckpoint.file_exists`` asks before it names a new checkpoint: committed locally, being saved,
    queued for upload or as a pointer, or known to the journal as held remotely (and not asked to go).
    """
    if tiers.local_twin(remote).is_committed():
        return True
    tiers.journal.open()
    name = remote.name
    removing = {intent.name for intent in tiers.journal.pending() if intent.op == "remove"}
    u = tiers.uploader
    with u.cond:
        tasks = [*u.queue, *u.held, *u.deferred, *([u.active] if u.active else [])]
        coming = {t.name for t in tasks if t.kind in ("upload", "link")} | set(u.saving)
    held_remotely = name in tiers.journal.remote or name in tiers.journal.pointers
    return name in coming or (held_remotely and name not in removing)


def candidates(tiers: Tiers, location: Location) -> list[str]:
    """:func:`lightning_dcp.engine.catalog.lookup.candidates` over both tiers: what a load of ``location`` tries.

    A ``last*`` name or a ``.commit`` (in either tier's directory): every committed checkpoint of both tiers, newest
    first, local copies first. An explicit checkpoint: its committed copies, newest first, local first.
    """
    tiers.resume()
    if designates_last(location):
        directory = location.parent().parent() if location.name == COMMIT_FILE else location.parent()
        if directory.local and os.path.abspath(directory.path).rstrip("/") == tiers.local.path.rstrip("/"):
            directory = tiers.remote_dir() or directory
        found = both(tiers, directory) if not directory.local else []
        if not found:
            return one_tier_candidates(location)
        entry = location.parent() if location.name == COMMIT_FILE else location
        return [loc.url for _, loc in of_named_run(found, entry)]
    resolved = location
    if not location.local:  # follow pointers; while the remote cannot be read, a local copy of the name serves
        local = tiers.local_twin(location) if tiers.mirrors(location.parent()) else None
        resolved = _reachable(location, Location.resolve, location, local is not None and local_marker(local))
    twins = tiers.twins(resolved)
    if twins is None:
        return one_tier_candidates(location)
    here = local_marker(twins[0])
    copies = [(here, 0, twins[0]), (_reachable(twins[1], local_marker, None, here), 1, twins[1])]
    committed = sorted(((order_key(m), -rank, c.url) for m, rank, c in copies if m is not None), reverse=True)
    return [url for *_, url in committed] or one_tier_candidates(location)


def _newest_first(found: list[tuple[tuple, int, Location]]) -> list[tuple[tuple, Location]]:
    found.sort(key=lambda entry: (entry[0], -entry[1], entry[2].name), reverse=True)
    return [(key, loc) for key, _, loc in found]


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
