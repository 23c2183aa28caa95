"""Loading the first loadable of a path's candidates, every rank moving on to the next one together.

A ``last*`` name designates the newest committed checkpoint of its directory and, behind it, the older ones
(:func:`lightning_dcp.engine.catalog.lookup.candidates`, or the tiers' candidates): a candidate that fails to load
on any rank is passed over on every rank, with a warning naming it once a later one loads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_dcp.engine.agreement import first_failure
from lightning_dcp.engine.load.restore import Loaded, load_one
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.errors import CheckpointError, NotACheckpointError, StateDictMismatchError, checkpoint_failure

__all__ = ["load_first"]


def load_first(
    location: Location,
    candidates: Sequence[Location],
    *,
    prefetched: str | None,
    collective: bool,
    **options: Any,
) -> Loaded:
    """Load the first of ``candidates`` that loads on every rank: the checkpoints ``location`` designates, newest first.

    ``prefetched`` is the local directory a page-cache prefetch already read (``None``: none).
    ``options`` are :func:`~lightning_dcp.engine.load.restore.load_one`'s.

    Collective: call on all ranks when ``collective=True``.

    Raises:
        StateDictMismatchError: The target does not fit a candidate (no older one is tried).
        CheckpointError: The only candidate failed (its error); NotACheckpointError when several did.
    """
    path = location.url
    failures: list[tuple[str, CheckpointError]] = []
    for candidate in candidates:
        url, loaded, failure = candidate.url, None, None
        try:
            fetched = candidate.local and os.path.realpath(candidate.path) == prefetched
            loaded = load_one(candidate, collective=collective, prefetch=not fetched, resolved=True, **options)
        except StateDictMismatchError:
            raise  # about the target, not the checkpoint: an older checkpoint would not fit either
        except Exception as err:  # any failure of this candidate: every rank must learn of it (no hang)
            failure = checkpoint_failure(err, f"Loading the checkpoint at {url!r} failed")
        failure = first_failure(failure, collective)  # every rank moves on together, or none does
        if failure is None:
            if failures:
                tried = "; ".join(f"{u!r} ({err})" for u, err in failures)
                rank_zero_warn(
                    f"lightning_dcp: the newest checkpoint(s) cannot be loaded: {tried}. Resuming from the newest"
                    f" valid checkpoint instead: {url!r}."
                )
            return loaded
        failures.append((url, failure))
    if len(failures) == 1:
        raise failures[0][1]
    raise NotACheckpointError(
        f"No checkpoint designated by {os.fspath(path)!r} can be loaded; tried, newest first: "
        + "; ".join(f"{u!r}: {err}" for u, err in failures)
    )
