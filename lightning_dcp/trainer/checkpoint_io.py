"""``DCPCheckpointIO``: Lightning's CheckpointIO contract, written as torch.distributed.checkpoint directories."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_dcp.engine import (
    Checkpointer,
    CheckpointerConfig,
    RestoreRecord,
    check_storage_options,
    is_marker_path,
    layout,
    source_of,
)
from lightning_dcp.engine.tiers import Tiers

__all__ = ["DCPCheckpointIO"]


class DCPCheckpointIO(CheckpointIO):
    """Save, load and remove Lightning checkpoints as torch.distributed.checkpoint (DCP) directories.

    A checkpoint is a directory holding DCP's ``.metadata`` and ``__{rank}_{n}.distcp`` data files; model and
    optimizer tensors are DCP entries, and the rest of Lightning's checkpoint dict (loops, callbacks, hparams, ...)
    is one ``weights_only``-safe blob inside the same files. A save writes into a hidden staging directory beside
    the target and is committed (renamed into place) only after every rank finished, so an interrupted save never
    damages the checkpoint that was there before.

    Use ``Trainer(plugins=[DCPCheckpointIO()])``. With the ``dcp_*`` strategies (``DCPStrategyMixin``) every rank
    writes its own shard; under a stock Lightning strategy, which calls the plugin on rank 0 only, rank 0 writes the
    whole (unsharded) state as a DCP directory.

    Each option is described once, in [`CheckpointerConfig`][lightning_dcp.engine.CheckpointerConfig] (the
    engine's options, which the plugin builds from these keywords); below, what each is for in a Trainer.

    Args:
        storage_options: fsspec options (credentials, endpoint, region) of every read, write, list and delete; the
            ``storage_options`` given to ``save_checkpoint`` are merged on top.
        thread_count: Writer threads per rank.
        sync_files: ``fsync`` each local data file before the commit.
        async_save: ``save_checkpoint`` returns once the state is staged, and the write goes on in the background;
            the next save, a load, a removal of that checkpoint and ``teardown`` wait for it.
        defer_staging: With ``async_save``: what only optimizer steps change is copied after ``save_checkpoint``
            returned, and the next optimizer update waits for the copies.
        when_busy: With ``async_save``: ``"wait"`` or ``"skip"`` a ``save_checkpoint`` called while the previous
            save is still written (``ModelCheckpoint``'s removals after a skip wait for a newer commit).
        local_dir: A local directory as the fast tier of remote checkpoint paths (saves commit there, then upload).
        local_keep: Committed checkpoints ``local_dir`` keeps.
        incremental: Hard-link the unchanged records of 1 MiB and more from the newest checkpoint of the directory.

    Raises:
        ValueError: ``thread_count`` or ``local_keep`` is not a positive integer, ``local_dir`` is not local, or
            ``when_busy`` is neither ``"wait"`` nor ``"skip"``.
        TypeError: ``storage_options`` is not a dict of fsspec options.
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 1,
        sync_files: bool = True,
        async_save: bool = False,
        defer_staging: bool = True,
        when_busy: str = "wait",
        local_dir: str | os.PathLike | None = None,
        local_keep: int = 2,
        incremental: bool = False,
    ) -> None:
        check_storage_options(storage_options)
        self._config = CheckpointerConfig.of(locals())  # every option of this signature, by name
        self.checkpointer = Checkpointer(self._config)
        """The engine that does the work (``lightning_dcp.engine.checkpointer.Checkpointer``)."""

    def __getstate__(self) -> dict[str, Any]:
        """What a copy or a pickle of the plugin holds: its options, not its running engine.

        ``copy.deepcopy(trainer.callbacks)`` (a progress bar refers to the Trainer) and ``torch.save(trainer)`` reach
        the plugin, as they reach Lightning's ``TorchCheckpointIO``; the engine's threads, locks and save in flight
        stay with the original. The copy builds an engine of its own with the same options (a memory tier attached
        later is not carried over).
        """
        state = dict(self.__dict__)
        state.pop("checkpointer", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.checkpointer = Checkpointer(self._config)

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options of every storage call (credentials, endpoint)."""
        return self.checkpointer.storage_options

    @property
    def async_save(self) -> bool:
        """Whether saves run in the background."""
        return self.checkpointer.async_save

    @property
    def last_step_wait(self) -> float | None:
        """Seconds optimizer steps waited for the last async save's background staging copies (after ``wait``)."""
        return self.checkpointer.last_step_wait

    @property
    def tiers(self) -> Tiers | None:
        """The local tier and its uploader (``local_dir``), or ``None``."""
        return self.checkpointer.tiers

    @property
    def last_save_seconds(self) -> float | None:
        """Seconds the last ``save_checkpoint`` call took for its own save, on this rank.

        A wait in the call for the previous async save is not in it, nor are the waits after an async call (the next
        optimizer step's for its staging copies, the teardown's): ``checkpoint/save_blocked_s`` counts them all.
        """
        return self.checkpointer.last_save_seconds

    # ----------------------------------------------------------------------------------------------- save
    @override
    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike,
        storage_options: dict[str, Any] | None = None,
        *,
        collective: bool = False,
        info: Mapping[str, Any] | None = None,
        rank_state: Mapping[str, Any] | None = None,
        volatile: Iterable[torch.Tensor] | None = None,
        from_rank0: Iterable[tuple[str, ...]] = (),
    ) -> None:
        """Write ``checkpoint`` as a DCP directory at ``path`` and commit it.

        Args:
            checkpoint: Lightning's checkpoint dict. ``"state_dict"`` and ``"optimizer_states"`` hold the tensors
                (FQN-keyed from ``get_state_dict`` under the DCP strategies, Lightning's layout otherwise).
            path: Target directory, a local path or fsspec URL (``str``). An existing checkpoint there is replaced
                only once the new one is complete.
            storage_options: fsspec options for this call, merged over the plugin's.
            collective: ``True`` when every rank calls this (the DCP strategies do); ``False`` when only rank 0
                does (stock Lightning strategies), which then writes everything without any collective.
            info: Extra facts recorded in the checkpoint (strategy name, ...).
            rank_state: This rank's own state (its RNG states), written by this rank as ``rank_states.{rank}``.
            volatile: With ``async_save`` and ``defer_staging``: the tensors that may change in place before the
                next optimizer step (the module's buffers); staged before this returns, the other CPU tensors in the
                background. ``None`` (Lightning's own strategies call without it): everything is staged before this
                returns.
            from_rank0: Paths in the checkpoint dict (``("state_dict", "bn.running_mean")``, ``("ema",)``) of
                replicated values that may differ between ranks: rank 0's copy is written, as stock Lightning writes
                rank 0's checkpoint dict (``Checkpointer.save``).

        Collective: call on all ranks when ``collective=True``; otherwise on one process only.

        Raises:
            TypeError: ``storage_options`` is not a dict of fsspec options.
            CheckpointError: Writing failed on some rank (the message names it); nothing was committed.
        """
        check_storage_options(storage_options)
        if _is_bare_state_dict(checkpoint):  # Lightning's ddp_spawn hands rank 0's weights back to the main process
            checkpoint, info = {layout.MODEL_KEY: checkpoint}, {**(info or {}), _BARE: True}
        tree, objects, layout_info = layout.split_checkpoint(checkpoint)
        self.checkpointer.save(
            tree,
            path,
            objects=objects,
            rank_objects=None if rank_state is None else dict(rank_state),
            info={**(info or {}), **layout_info},
            storage_options=storage_options,
            collective=collective,
            volatile=volatile,
            step=checkpoint.get("global_step"),
            from_rank0=from_rank0,
        )

    # ----------------------------------------------------------------------------------------------- load
    @override
    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        state_dict: dict[str, Any] | None = None,
        strict: bool = True,
        collective: bool = False,
        only_model: bool = False,
        exclude: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Load a checkpoint written by this plugin, or a single-file Lightning checkpoint.

        Args:
            path: A checkpoint directory (or a ``.ckpt`` file from ``torch.save``), local path or fsspec URL.
            map_location: Passed to ``torch.load`` for single-file checkpoints; DCP loads into the target's devices.
            weights_only: Restrict unpickling of non-tensor state to safe types (``None`` means ``True``).
            state_dict: Target ``{"state_dict": ..., "optimizer_states": [...]}`` from ``get_state_dict`` that DCP
                fills in place (resharding to the current world size). ``None`` loads every tensor into CPU memory.
            strict: Require the checkpoint's model keys to equal the target's (see ``StateDictMismatchError``).
            collective: ``True`` when every rank calls this with its own ``state_dict`` target.
            only_model: With a target, read the model entries only (no Trainer state, optimizer or RNG states).
            exclude: Glob patterns of model FQNs neither loaded nor reported as unexpected (with a target).

        A checkpoint named like ``ModelCheckpoint``'s last one (``last.ckpt``, ``last-v1.ckpt``; what
        ``ckpt_path="last"`` resolves to) that is incomplete or corrupt falls back to the newest valid checkpoint
        in the same directory, with a warning naming both. Any other path fails instead.

        Returns:
            Lightning's checkpoint dict. With a target, ``"state_dict"``/``"optimizer_states"`` are the filled
            target objects. A single file is returned as ``torch.load`` gives it.

        Collective: call on all ranks when ``collective=True``.

        Raises:
            CheckpointNotFoundError: Nothing exists at ``path``.
            NotACheckpointError: ``path`` is not a readable checkpoint (or an incomplete save).
            StateDictMismatchError: Keys, shapes or dtypes differ from the target; nothing was loaded.
            CheckpointError: Non-tensor state that ``weights_only`` refuses.
        """
        started = time.perf_counter()
        loaded = self.checkpointer.load(
            path,
            target=state_dict,
            strict=strict,
            collective=collective,
            weights_only=True if weights_only is None else weights_only,
            only=[layout.MODEL_KEY] if only_model else None,
            exclude=exclude,
            map_location=map_location,
        )
        if not only_model:  # for the `checkpoint/restore_s` metric and the restore's log line (trainer/metrics.py)
            local_dir = self.checkpointer.tiers.local if self.checkpointer.tiers is not None else None
            source = source_of(loaded, local_dir=local_dir)
            tier = getattr(loaded, "tier", None)
            restore_s = time.perf_counter() - started
            restored = RestoreRecord(url=loaded.url, tier=tier, restore_s=restore_s, source=source)
            self.checkpointer.saves.restore = restored
            if loaded.url.rstrip("/") != os.fspath(path).rstrip("/"):  # "last", a link, a ".commit"
                asked = os.fspath(path).rstrip("/")  # no Location: some stores (adlfs) connect when one is made
                folder = asked.rpartition("/")[0]
                shown = f"{folder!r} (its `.commit`)" if is_marker_path(asked) and folder else repr(os.fspath(path))
                rank_zero_info(f"lightning_dcp: {shown} designates {source}; loaded it.")
        if loaded.kind == "file":
            return loaded.objects
        if not only_model:
            layout.require_trainer_layout(loaded.url, loaded.objects.get(layout.INFO_KEY, {}))
        checkpoint = layout.join_checkpoint(loaded.tree, loaded.objects, in_place=loaded.in_place, where=loaded.url)
        info = checkpoint[layout.INFO_KEY]
        if info.get(_BARE):
            return checkpoint[layout.MODEL_KEY]
        if loaded.in_place:
            info.update(missing_keys=loaded.missing_keys, unexpected_keys=loaded.unexpected_keys)
        if loaded.rank_objects is not None:
            info["rank_state"] = loaded.rank_objects
            info["rank_state_exact"] = loaded.rank_objects_exact
        return checkpoint

    # --------------------------------------------------------------------------------------------- remove
    @override
    def remove_checkpoint(self, path: str | os.PathLike, *, collective: bool = False) -> None:
        """Delete the checkpoint at ``path`` (and any staging left by an interrupted save to it) once.

        Collective: call on all ranks when ``collective=True``; rank 0 deletes, the others wait for it.
        """
        self.checkpointer.remove(path, collective=collective)

    @override
    def teardown(self) -> None:
        """Finish the background save in flight (if any); with ``local_dir``, wait until every upload is done.

        The staging buffers of async saves are released.

        Raises:
            CheckpointError: The background save failed (it was not committed), or uploads failed (those
                checkpoints stay committed in ``local_dir``).
        """
        self.checkpointer.close()

    def wait(self, *, collective: bool = False) -> None:
        """Block until the background save in flight (if any) is committed.

        Collective: call on all ranks when ``collective=True``; then every rank raises if any rank's part failed.

        Raises:
            CheckpointError: The background save failed (naming the rank and the path); it was not committed.
        """
        self.checkpointer.wait(collective=collective)


_BARE = "bare_state_dict"
"""Recorded for a checkpoint that was a module's bare state dict, which a load gives back as it was saved."""


def _is_bare_state_dict(checkpoint: Mapping[str, Any]) -> bool:
    """A module's state dict rather than Lightning's checkpoint dict: ``{fqn: tensor}`` and no ``"state_dict"``.

    Lightning's ``ddp_spawn`` launcher saves rank 0's ``model.state_dict()`` through the CheckpointIO and loads it
    back in the main process with ``load_checkpoint`` (``_MultiProcessingLauncher``).
    """
    return (
        layout.MODEL_KEY not in checkpoint
        and bool(checkpoint)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in checkpoint.items())
    )
