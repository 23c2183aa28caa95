"""``MemoryCheckpoint``: checkpoints every few steps into host shared memory, replicated to peer nodes, persisted.

One callback turns the memory tier on for a Trainer run (``strategy="dcp_*"``, any ``DCPCheckpointIO``)::

    Trainer(strategy="dcp_ddp", callbacks=[MemoryCheckpoint(f"/dev/shm/{user}-{run}", every_n_train_steps=10)])

Every ``every_n_train_steps`` it saves the Trainer's whole checkpoint (what ``trainer.save_checkpoint`` writes) into
the node's memory area (:class:`~lightning_dcp.engine.tiers.memory.MemoryTier`), replicates each node's part to
``replicas`` other nodes, and persists every ``persist_every``-th one into ``dirpath`` (by default the ``dirpath`` of
the run's ``DCPModelCheckpoint``), through ``local_dir`` when the plugin has one. At SIGTERM the newest memory
checkpoint is persisted before the process exits. ``fit(ckpt_path="last")`` then resumes from the newest committed
checkpoint across memory (own parts and peers' replicas), ``local_dir`` and the remote store, at any world size.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dcp._compat import lightning_run
from lightning_dcp.engine import Location, distributed
from lightning_dcp.engine.tiers import housekeeping
from lightning_dcp.engine.tiers.memory import LAST_ENTRY, MemoryTier, area_error
from lightning_dcp.errors import CheckpointError
from lightning_dcp.trainer.checkpoint_io import DCPCheckpointIO
from lightning_dcp.trainer.model_checkpoint import DCPModelCheckpoint

__all__ = ["MemoryCheckpoint"]


class MemoryCheckpoint(DCPModelCheckpoint):
    """Checkpoint into host shared memory every few steps; replicate to peer nodes; persist every Mth to ``dirpath``.

    Args:
        memory_dir: This node's memory area: a directory on a tmpfs (``/dev/shm/...``), the same path on every
            node or one per node. It outlives the training processes; ``(keep + 1) x (1 + replicas)`` times a
            node's part of a checkpoint must fit there.
        every_n_train_steps: Save to memory every this many optimizer steps.
        replicas: K: each node's part is copied to K other nodes (cyclically), so losing K nodes loses nothing
            committed in memory.
        keep: Checkpoints kept in memory (the newest).
        persist_every: Persist every this-many-th memory checkpoint into ``dirpath`` (``0``: only on the time
            schedule and at SIGTERM).
        persist_every_seconds: Also persist the first memory checkpoint saved this long after the last persisted.
        persist_keep: Checkpoints persisted by a run that stay in ``dirpath`` (the newest); ``0`` keeps all.
        async_save: Return from a save once it is planned; the copies into shared memory run in the background
            while optimizer steps wait for them. ``False``: return once this rank's state is copied into shared
            memory (the checkpoint is committed behind the call, once hashed).
        dirpath: Where persisted checkpoints go: a local path (one filesystem every node reaches, or a disk of each
            node: ``node_disks``) or a remote URL. Default: the ``dirpath`` of the
            run's first other ``DCPModelCheckpoint``, else Lightning's default.
        filename: Name of each checkpoint, formatted like ``ModelCheckpoint``'s (``"memory-{step}"``: a distinct
            name, so persisted checkpoints never collide with those of another ``ModelCheckpoint``).
        free_at_end: At a clean end of ``fit``, persist the newest memory checkpoint into ``dirpath`` (unless it
            was) and then free this run's part of every node's memory area
            (``free``). By default the area keeps its checkpoints after
            the run (a crashed or killed run resumes from them) until it is removed or the machine reboots; the end
            of ``fit`` logs how much it holds.

    Raises:
        ValueError: A count out of range.
        CheckpointError: At ``setup``: the strategy is not one of the ``dcp_*`` strategies (every rank must write
            its part), or the plugin is not a ``DCPCheckpointIO`` (nothing is created then).
        StorageAccessError: At ``setup``: the memory area cannot be created or written (on every rank).
    """

    def __init__(
        self,
        memory_dir: str | os.PathLike,
        *,
        every_n_train_steps: int = 10,
        replicas: int = 1,
        keep: int = 1,
        persist_every: int = 10,
        persist_every_seconds: float | None = None,
        persist_keep: int = 2,
        async_save: bool = True,
        dirpath: str | os.PathLike | None = None,
        filename: str = "memory-{step}",
        free_at_end: bool = False,
    ) -> None:
        if not isinstance(every_n_train_steps, int) or every_n_train_steps < 1:
            raise ValueError(f"`every_n_train_steps` must be a positive integer, got {every_n_train_steps!r}.")
        super().__init__(dirpath, filename=filename, save_top_k=0, save_last=False)
        self.tier = MemoryTier(
            memory_dir,
            replicas=replicas,
            keep=keep,
            persist_every=persist_every,
            persist_every_seconds=persist_every_seconds,
            async_save=async_save,
        )
        """The engine's memory tier (its ``timings`` describe the last save)."""
        self.memory_every = every_n_train_steps
        self.persist_keep = persist_keep
        self.free_at_end = free_at_end
        self._explicit_dirpath = dirpath is not None
        self._last_memory_step = -1

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(memory_dir=self.tier.memory_dir, every_n_train_steps=self.memory_every)

    @property
    def sentinel(self) -> str:
        """The path ``ckpt_path="last"`` resolves to: "the newest checkpoint of every tier"."""
        return os.path.join(self.tier.memory_dir, LAST_ENTRY)

    def _io(self, trainer: pl.Trainer) -> DCPCheckpointIO:
        io = lightning_run.unwrap_checkpoint_io(trainer.strategy.checkpoint_io)
        if not isinstance(io, DCPCheckpointIO) or not getattr(trainer.strategy, "_dcp_sharded", False):
            raise CheckpointError(
                "`MemoryCheckpoint` needs every rank to write its part: use one of the `dcp_*` strategies (e.g."
                f" `Trainer(strategy='dcp_ddp')`) with `DCPCheckpointIO`; got `{type(trainer.strategy).__name__}`"
                f" with `{type(io).__name__}`."
            )
        return io

    # --------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Attach the memory tier to the plugin and bind it to ``dirpath`` (before the strategy restores).

        Collective: call on all ranks (Lightning does).
        """
        if not self._explicit_dirpath:
            others = [c for c in trainer.callbacks if isinstance(c, DCPModelCheckpoint) and c is not self]
            if others and others[0].dirpath is not None:
                self.dirpath = others[0].dirpath
        io = self._io(trainer)  # refused before anything is created (no `dirpath`, no memory area)
        super().setup(trainer, pl_module, stage)
        route = io.checkpointer.attach_memory(self.tier)
        route.bind(self._directory(trainer), persist_keep=self.persist_keep)
        self.tier.setup(distributed=distributed(True))  # the area and its `last` entry; every rank alike if refused

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """Every ``every_n_train_steps`` optimizer steps, save to memory. Collective: every rank takes part."""
        step = trainer.global_step
        if step % self.memory_every or step == self._last_memory_step or trainer.sanity_checking:
            return
        self._last_memory_step = step
        name = self.format_checkpoint_name({"epoch": trainer.current_epoch, "step": step})
        with self._io(trainer).checkpointer.into_memory():
            trainer.save_checkpoint(name, weights_only=False)  # the full state (as ModelCheckpoint passes it)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """At SIGTERM (preemption), persist the newest memory checkpoint before the process exits. Collective."""
        super().on_exception(trainer, pl_module, exception)
        if isinstance(exception, SIGTERMException) and self.tier.topology is not None:
            name = self.tier.persist_newest()
            if name is not None:
                rank_zero_info(f"lightning_dcp: SIGTERM: persisted the memory checkpoint {name!r} to {self.dirpath}.")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Let the memory save in flight finish (its replicas and persistence); free the area if asked. Collective.

        Logs (rank 0) what its node's area holds after the run, or what was freed.
        """
        self.tier.wait()
        if self.tier.topology is None:
            return
        if self.free_at_end:
            freed = housekeeping.free(self.tier)
            if freed is not None:
                rank_zero_info(
                    f"lightning_dcp: freed {freed / 2**20:.1f} MiB of the memory area {self.tier.memory_dir} (each"
                    f" node its own); the newest memory checkpoint is persisted in {self.dirpath}."
                )
                return
        held = housekeeping.held_bytes(self.tier.memory_dir) if self.tier.topology.leader else 0
        rank_zero_info(
            f"lightning_dcp: the memory area {self.tier.memory_dir} keeps {held / 2**20:.1f} MiB of checkpoints after"
            " this run (a restarted job resumes from them); it is freed only when removed or at a reboot."
            " `MemoryCheckpoint(..., free_at_end=True)` frees it at a clean end, once the newest is persisted."
        )

    def _find_last(self, trainer: pl.Trainer) -> set[str]:
        """``ckpt_path="last"``: the memory area's ``last`` entry, which every load reads as "newest of every tier".

        Lightning picks the candidate with the newest modification time: the entry is touched now (and made, with the
        area, before ``setup``: Lightning resolves ``ckpt_path`` first).

        Raises:
            CheckpointError: As at ``setup``, before anything is created.
            StorageAccessError: The area cannot be created or written (on this rank).
        """
        self._io(trainer)
        error = self.tier.open_area()
        if error is not None:
            raise area_error([error])
        os.utime(self.sentinel)
        return {self.sentinel}


def memory_checkpoint_of(trainer: pl.Trainer) -> MemoryCheckpoint | None:
    """The run's ``MemoryCheckpoint``, if any."""
    return next((c for c in trainer.callbacks if isinstance(c, MemoryCheckpoint)), None)


def is_memory_sentinel(path: Any) -> bool:
    """Whether ``path`` is a memory area's ``last`` entry (what ``ckpt_path="last"`` gives with a memory tier)."""
    return (
        isinstance(path, (str, os.PathLike))
        and os.path.basename(os.fspath(path)) == LAST_ENTRY
        and Location(os.fspath(path)).local
    )


setattr(MemoryCheckpoint, lightning_run.MODEL_CHECKPOINT_FIND_LAST, MemoryCheckpoint._find_last)
