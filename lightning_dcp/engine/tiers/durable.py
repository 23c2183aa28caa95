"""``DurableCatalog``: which committed checkpoints a directory holds on the durable tiers, newest first.

The durable tiers of a directory are the directory itself and, when a local tier (``local_dir``,
:class:`~lightning_dcp.engine.tiers.local.Tiers`) mirrors it, that tier's copies. Every part and front end that asks
"which checkpoints are here, newest first, and which one is whole" of a directory asks this object: the save
counter of a new save (:meth:`DurableCatalog.known`), ``ModelCheckpoint``'s ``last_checkpoint`` and clean-ups
(:meth:`DurableCatalog.checkpoints`, :meth:`DurableCatalog.newest_valid`), a load's candidates
(:meth:`DurableCatalog.candidates`) and the memory tier's comparison with its durable directory. Newest first is the
order recorded at save in ``.commit`` (:func:`~lightning_dcp.engine.format.marker.order_key`); on a tie, the local
copy first. The memory tier's own checkpoints are the memory route's
(:class:`~lightning_dcp.engine.tiers.memory_io.MemoryRoute`), which compares them with this catalog's newest.
"""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import Metadata

from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.catalog.integrity import newest_valid as newest_valid_of
from lightning_dcp.engine.catalog.lookup import candidates as one_tier_candidates
from lightning_dcp.engine.storage.location import Location, read_commit
from lightning_dcp.engine.tiers.local import Tiers
from lightning_dcp.errors import BucketNotFoundError, CheckpointError, StorageUnavailableError

__all__ = ["DurableCatalog"]


class DurableCatalog:
    """What a directory holds on the durable tiers; one per :class:`~lightning_dcp.engine.checkpointer.Checkpointer`.

    Args:
        tiers: The local tier of remote paths (``None``: none; every answer is the directory's own listing).

    Rank 0 only (or any single process): every answer lists storage.
    """

    def __init__(self, tiers: Tiers | None) -> None:
        self.tiers = tiers

    def checkpoints(self, directory: Location) -> list[tuple[tuple, Location]]:
        """Committed checkpoints of ``directory``, newest first; with a local tier, of both tiers (local first).

        A load's answer: it lists the directory (a remote call for a store; while the store cannot be read, the local
        tier's copies, with a warning). A missing directory holds none.
        """
        if self.tiers is None:
            return committed_checkpoints(directory, whole=False)
        return self.tiers.checkpoints(directory)

    def known(self, directory: Location, *, wait: bool = True) -> list[tuple[tuple, Location]]:
        """As :meth:`checkpoints`, without a remote call while a local tier mirrors ``directory`` (the training loop's).

        ``wait``: wait for the local tier's first listing of the remote (see
        :meth:`~lightning_dcp.engine.tiers.reads.TierReads.known_checkpoints`).
        """
        if self.tiers is None:
            return committed_checkpoints(directory, whole=False)
        return self.tiers.known_checkpoints(directory, wait=wait)

    def newest_committed(self, directory: Location) -> tuple[tuple, Location] | None:
        """The newest of :meth:`checkpoints` whose ``.commit`` reads whole and valid, ``(order key, checkpoint)``.

        :meth:`checkpoints` ranks by the order at each marker's end; a marker damaged before it is passed over here
        (its data is not read: :meth:`newest_valid` checks that too). ``None`` when there is none.

        Raises:
            StorageUnavailableError, BucketNotFoundError: The store cannot be read.
        """
        for key, location in self.checkpoints(directory):
            try:
                if read_commit(location) is not None:
                    return key, location
            except (StorageUnavailableError, BucketNotFoundError):
                raise
            except CheckpointError:
                continue
        return None

    def newest_valid(self, directory: Location) -> tuple[Location, Metadata] | None:
        """The newest of :meth:`checkpoints` that passes the fast checks of every load, with its metadata; ``None``."""
        return newest_valid_of(directory, self.checkpoints(directory))

    def candidates(self, location: Location) -> list[str]:
        """URLs a load of ``location`` tries in order: the checkpoint, or for a ``last`` name every committed one.

        See :func:`~lightning_dcp.engine.catalog.lookup.candidates`; with a local tier, over both tiers
        (:meth:`~lightning_dcp.engine.tiers.reads.TierReads.candidates`).
        """
        return one_tier_candidates(location) if self.tiers is None else self.tiers.candidates(location)
