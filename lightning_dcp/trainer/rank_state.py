"""What each rank of a Trainer run saves for itself, and how it comes back: RNG states and stateful train loaders.

Saved by every rank in its own part of the checkpoint (``rank_states.{rank}``, see
:mod:`lightning_dcp.engine.format.layout`):

- ``"rng"``: the torch, CUDA, numpy and python generator states (:mod:`lightning_dcp.engine.state.rng`);
- ``"mid_epoch"``: whether the epoch's data iterator was in use at the save;
- ``"loaders"``: the ``state_dict()`` of this rank's stateful train loaders (torchdata's ``StatefulDataLoader`` with
  its workers' state, LitData's ``StreamingDataLoader``, a user's class), as Lightning lists them in the fit loop's
  state (where the checkpoint keeps rank 0's only).

At the same world size each rank gets its own back exactly. At another, RNG states are re-derived from rank 0's (with
a warning), and a mid-epoch loader position is handed to :class:`~lightning_dcp.ElasticResume` (which reshards it or
raises); without that callback the load raises.

A data iterator draws its base seed from the global generator when it is created, and a resumed fit creates the
epoch's iterator after the load: mid-epoch RNG states are restored right after that draw (in ``on_train_start``, or
when a lazily started loader such as LitData's creates its iterator at the first batch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_dcp._compat.lightning_run import (
    fit_loop_loader_states,
    on_iterator_created,
    replace_fit_loop_loader_states,
    set_sampler_epoch,
    train_epoch_in_progress,
)
from lightning_dcp.engine import layout
from lightning_dcp.engine.state.rng import collect_rng_states, derive_rng_states, restore_rng_states
from lightning_dcp.errors import CheckpointError
from lightning_dcp.trainer.callbacks import ElasticResume

__all__ = ["RankResume", "collect_rank_state", "needs_elastic_resume"]


def collect_rank_state(trainer: Trainer, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The state this rank saves for itself with ``checkpoint`` (the dict its ``dump_checkpoint`` built)."""
    state = {"rng": collect_rng_states(), "mid_epoch": train_epoch_in_progress(trainer)}
    loaders = fit_loop_loader_states(checkpoint)
    if loaders is not None:
        state["loaders"] = loaders
    return state


class RankResume:
    """Puts one rank's saved state back during a resumed ``fit`` (one per strategy; see the module docstring)."""

    def __init__(self) -> None:
        self._rng: dict[str, Any] | None = None
        self._created = False
        self._restore_on_creation = False
        self._disarm: list[Callable[[], None]] = []

    def restore(self, trainer: Trainer, checkpoint: dict[str, Any], *, path: str, world_size: int, rank: int) -> None:
        """Apply this rank's saved state from a loaded checkpoint dict (``info["rank_state"]``), or schedule it.

        Raises:
            CheckpointError: A mid-epoch checkpoint with stateful train loaders, at another world size, without
                :class:`~lightning_dcp.ElasticResume`.
        """
        info = checkpoint.get(layout.INFO_KEY, {})
        state = info.get("rank_state")
        if not state or "rng" not in state:
            return
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and "loaders" in state:  # else saved before loader states were per rank: Lightning's rank-0 copy
            self._loaders(trainer, checkpoint, info, state, path=path, world_size=world_size)
        if info.get("rank_state_exact"):
            if state.get("mid_epoch") and fitting:
                self._rng, self._created, self._restore_on_creation = state["rng"], False, False
            else:
                restore_rng_states(state["rng"])
            return
        derive_rng_states(state["rng"], rank=rank)
        rank_zero_warn(
            f"The checkpoint was saved at world size {info.get('world_size')} and is resumed at {world_size}:"
            " per-rank random states cannot carry over one-to-one, so each rank's generators (torch, numpy, python)"
            " are re-seeded deterministically from rank 0's saved state and the rank. Random streams (dropout,"
            " augmentation) differ from an uninterrupted run; model, optimizer and loop state are exact."
        )

    def _loaders(
        self, trainer: Trainer, checkpoint: dict[str, Any], info: dict[str, Any], state: dict[str, Any], **where: Any
    ) -> None:
        """Each rank's own loader states in place of rank 0's at the same world size.

        At another world size, mid-epoch, rank 0's go to ElasticResume (``info["loader_resume"]``) instead of
        Lightning; at an epoch boundary Lightning's behaviour stays (rank 0's states on every rank).
        """
        if info.get("rank_state_exact"):
            replace_fit_loop_loader_states(checkpoint, state["loaders"])
            info["loader_resume"] = {"exact": True}
            return
        saved = fit_loop_loader_states(checkpoint)
        if not saved or not state.get("mid_epoch"):
            return
        replace_fit_loop_loader_states(checkpoint, None)
        info["loader_resume"] = {"exact": False, "states": saved, "saved_world_size": info.get("world_size")}
        if not any(isinstance(cb, ElasticResume) for cb in trainer.callbacks):
            raise needs_elastic_resume(len(saved), saved_world_size=info.get("world_size"), **where)

    def process_dataloader(self, trainer: Trainer, dataloader: Any) -> None:
        """Prepare a loader before Lightning hands it its saved state and creates the epoch's iterator.

        Sets the sampler's epoch (Lightning sets it only later, after a resumed ``StatefulDataLoader`` with workers
        drew indices), and watches for the iterator's creation while RNG states wait for it.
        """
        if trainer.state.fn != TrainerFn.FITTING:
            return
        set_sampler_epoch(dataloader, trainer.fit_loop.epoch_progress.current.processed)
        if self._rng is not None and trainer.training and isinstance(dataloader, DataLoader):
            self._disarm.append(on_iterator_created(dataloader, self._iterator_created))

    def _iterator_created(self) -> None:
        self._created = True
        if self._restore_on_creation:
            self._restore_rng()

    def on_train_start(self) -> None:
        """Restore mid-epoch RNG states now if the epoch's iterator exists, else when a lazy loader creates it.

        Called after every other ``on_train_start`` hook (ElasticResume may re-create the iterator there).
        """
        if self._rng is None:
            return
        if self._created or not self._disarm:
            self._restore_rng()
        else:
            self._restore_on_creation = True

    def _restore_rng(self) -> None:
        states, self._rng = self._rng, None
        for disarm in self._disarm:
            disarm()
        self._disarm = []
        if states is not None:
            restore_rng_states(states)


def needs_elastic_resume(count: int, *, saved_world_size: int | None, world_size: int, path: str) -> CheckpointError:
    """The error for a mid-epoch loader position saved at another world size without ``ElasticResume``: fix first."""
    return CheckpointError(
        f"Add `lightning_dcp.ElasticResume()` to the Trainer's callbacks to resume {path!r} at world size"
        f" {world_size}: the checkpoint was saved at world size {saved_world_size} in the middle of an epoch, with"
        f" each rank's own position of {count} stateful train loader(s), and ElasticResume deals the epoch's"
        " remaining samples to the new ranks, keeping the global batch size (docs/resume.md). Resume at world size"
        f" {saved_world_size} (every rank gets its own loader state back) otherwise."
    )
