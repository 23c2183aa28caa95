"""Stateful data loaders in checkpoints: what each kind keeps, and which kinds reshard their own state.

A loader is *stateful* when it has ``state_dict()`` and ``load_state_dict()`` (torchdata's ``StatefulDataLoader``,
LitData's ``StreamingDataLoader``, a user's own class). Its state is its rank's position in the epoch (and, with
``num_workers > 0``, its workers' state), so each rank saves its own (``rank_states.{rank}``, see
:mod:`lightning_dcp.engine.format.layout`) and gets it back at the same world size. At another world size the positions
cannot map one-to-one onto the new ranks:

- LitData's ``StreamingDataLoader`` over a ``StreamingDataset`` records the epoch's global position
  (``sample_in_epoch``: samples of all ranks together) and restripes the rest of the epoch over any number of ranks
  and workers itself (LitData >= 0.2.6x "elastic resume"): every new rank is given rank 0's saved state;
- a ``DataLoader`` whose sampler reproduces a world-size-independent order (``DistributedSampler``) is resharded by
  the Trainer's ``ElasticResume``, which skips the consumed prefix of that order and ignores the saved state;
- anything else cannot be resharded: resuming it mid-epoch at another world size is refused (:func:`refuse`).
"""

from __future__ import annotations

import sys
from typing import Any

from lightning_dcp.errors import CheckpointError

__all__ = ["is_stateful_loader", "refuse", "reshards_itself"]


def is_stateful_loader(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.utils.data.DataLoader`` with its own ``state_dict``/``load_state_dict``."""
    from torch.utils.data import DataLoader

    return (
        isinstance(obj, DataLoader)
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def reshards_itself(loader: Any) -> bool:
    """Whether ``loader`` continues an epoch at another world size from any one rank's saved state.

    True for LitData's ``StreamingDataLoader`` over a single ``StreamingDataset`` (LitData refuses its combined and
    parallel datasets at another topology). LitData is not imported here: a loader of its own means it is loaded.
    """
    litdata = sys.modules.get("litdata")
    if litdata is None:
        return False
    return isinstance(loader, litdata.StreamingDataLoader) and type(loader.dataset) is litdata.StreamingDataset


def refuse(names: list[str], *, saved_world_size: int | None, world_size: int, path: str, hint: str) -> CheckpointError:
    """The error for stateful loaders whose mid-epoch position cannot be dealt to another number of ranks.

    Args:
        names: The loaders (type names or state keys) that cannot be resharded.
        saved_world_size: The world size at save.
        world_size: The world size now.
        path: The checkpoint.
        hint: Front-end specific options, appended to the message.
    """
    return CheckpointError(
        f"The checkpoint {path!r} was saved at world size {saved_world_size} in the middle of an epoch, with the"
        f" state of the stateful data loader(s) {', '.join(names)} (each rank's own position). At world size"
        f" {world_size} these positions cannot be dealt to the new ranks, so the epoch's remaining samples would be"
        f" skipped or repeated. Resume at world size {saved_world_size} (every rank gets its own loader state back),"
        " or use a loader whose position can be resharded: a DataLoader or torchdata StatefulDataLoader with a"
        f" DistributedSampler, or LitData's StreamingDataLoader over a StreamingDataset. {hint}"
    )
