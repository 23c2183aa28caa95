"""``DCPCheckpointIO``: Lightning's CheckpointIO contract, written as torch.distributed.checkpoint directories."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import lightning
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from typing_extensions import override

from lightning_dcp import _format
from lightning_dcp._async import AsyncSaves
from lightning_dcp._loading import fit_target, lightning_model_key, load_file, probe, read_lightning_meta
from lightning_dcp._storage import Location, new_token
from lightning_dcp.errors import (
    CheckpointError,
    checkpoint_failure,
)

__all__ = ["DCPCheckpointIO"]

_T = TypeVar("_T")
log = logging.getLogger(__name__)


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

    Args:
        storage_options: fsspec filesystem options (credentials, endpoint, region) used for every read, write,
            list and delete. Per-call ``storage_options`` given to ``save_checkpoint`` are merged on top.
        thread_count: Writer threads per rank; each writes its own ``__{rank}_{n}.distcp`` file (DCP behaviour).
        sync_files: ``fsync`` each local data file before the checkpoint is committed (never on remote stores).
        async_save: Write in the background (``dcp.async_save`` over a dedicated gloo group): ``save_checkpoint``
            returns once the state is staged into reused CPU buffers (pinned on CUDA). At most one save is in
            flight; the next save, a load, a removal of that checkpoint and ``teardown`` wait for it, and its error
            is raised there. Removals requested while it is in flight run after it commits.

    Raises:
        ValueError: ``thread_count`` is not a positive integer.
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 1,
        sync_files: bool = True,
        async_save: bool = False,
    ) -> None:
        if not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"`thread_count` must be a positive integer, got {thread_count!r}.")
        self.storage_options = dict(storage_options or {})
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.async_save = async_save
        self._async = AsyncSaves() if async_save else None
        self.last_save_seconds: float | None = None
        """Seconds the last ``save_checkpoint`` call blocked its caller (the training-loop stall), on this rank."""

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

        Collective: call on all ranks when ``collective=True``; otherwise on one process only.

        Raises:
            CheckpointError: Writing failed on some rank (the message names it); nothing was committed.
        """
        self._await_pending(collective)
        started = time.perf_counter()
        location = Location(path, storage_options={**self.storage_options, **(storage_options or {})})
        rank, world_size = _rank_and_world(collective)
        # Rank 0 decides where this save writes; all ranks must agree.
        token, direct = _on_rank0(collective, lambda: (new_token(), _writes_in_place(location)))
        target = location if direct else location.staging(token)
        info = {
            **(info or {}),
            "world_size": world_size,
            "torch_version": str(torch.__version__),
            "lightning_version": str(lightning.__version__),
        }

        def commit() -> None:  # rank 0, once every rank finished writing
            if not direct:
                location.commit_from(target)
            location.remove_stale_staging(keep=None if direct else token)

        def abandon() -> None:  # rank 0, after a failure: nothing half-written stays visible
            if not direct:
                target.remove()

        writer = target.storage_writer(thread_count=self.thread_count, sync_files=self.sync_files)
        try:
            dcp_state = _format.to_dcp_state_dict(
                checkpoint, info=info, write_extra=rank == 0, rank=rank, rank_state=rank_state
            )
            if self._async is not None:
                self._async.start(
                    dcp_state,
                    writer=writer,
                    location=location,
                    rank=rank,
                    distributed=_distributed(collective),
                    commit=commit,
                    abandon=abandon,
                )
                self._record(started, location, "staged (writing in the background)")
                return
            with _single_process_ok():
                dcp.save(dcp_state, storage_writer=writer, no_dist=not _distributed(collective))
        except (Exception, dcp.CheckpointException) as err:  # DCP's exception derives from BaseException
            if rank == 0:
                abandon()
            raise checkpoint_failure(err, f"Saving the checkpoint to {location.url!r} failed on rank {rank}") from err
        _on_rank0(collective, commit)
        self._record(started, location, "saved")

    def _record(self, started: float, location: Location, what: str) -> None:
        self.last_save_seconds = time.perf_counter() - started
        log.info("lightning_dcp: checkpoint %s to %s in %.3f s", what, location.url, self.last_save_seconds)

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
        self._await_pending(collective)
        weights_only = True if weights_only is None else weights_only
        found = _on_rank0(collective, lambda: probe(Location(path, storage_options=self.storage_options)))
        location = Location(found.url, storage_options=self.storage_options)
        if found.kind == "file":
            return load_file(location, map_location=map_location, weights_only=weights_only)
        metadata = found.metadata
        lightning_layout = found.kind == "lightning"
        model_key = lightning_model_key(metadata) if lightning_layout else _format.MODEL_KEY
        rank, world_size = _rank_and_world(collective)
        saved_world_size = _format.saved_world_size(metadata)
        if state_dict is None:
            target = _format.metadata_target(metadata)
        else:
            target = {_format.MODEL_KEY: state_dict[_format.MODEL_KEY]} if only_model else dict(state_dict)
            if lightning_layout:
                target = _to_lightning_layout(target, model_key)
            target, missing, unexpected = fit_target(
                location.url, target, metadata, strict=strict, model_key=model_key, exclude=exclude
            )
            if not lightning_layout and not only_model:
                target[_format.EXTRA_KEY] = b""
                if saved_world_size:  # this rank's own state, or rank 0's to derive from at another world size
                    own = rank if saved_world_size == world_size else 0
                    target[_format.RANK_KEY] = {str(own): b""}
        try:
            with _single_process_ok():
                dcp.load(
                    target,
                    storage_reader=location.storage_reader(),
                    planner=_format.SafeLoadPlanner(weights_only=weights_only, allow_partial_load=not strict),
                    no_dist=not _distributed(collective),
                )
        except dcp.CheckpointException as err:  # DCP gathers every rank's failure; raise the first one plainly
            raise checkpoint_failure(err, f"Loading the checkpoint at {location.url!r} failed") from err
        if lightning_layout:
            extra = {} if only_model else read_lightning_meta(location, weights_only=weights_only)
            target = _from_lightning_layout(target, model_key)
        elif _format.EXTRA_KEY in target:
            extra = _format.decode_extra(target.pop(_format.EXTRA_KEY), path=location.url, weights_only=weights_only)
        else:
            extra = {}
        checkpoint = _format.from_dcp_state_dict(target, extra, in_place=state_dict is not None)
        if state_dict is not None:
            checkpoint[_format.INFO_KEY].update(missing_keys=missing, unexpected_keys=unexpected)
        blobs = target.get(_format.RANK_KEY) if state_dict is not None else None
        if blobs:
            checkpoint[_format.INFO_KEY]["rank_state"] = _format.decode_extra(
                next(iter(blobs.values())), path=location.url, weights_only=weights_only
            )
            checkpoint[_format.INFO_KEY]["rank_state_exact"] = saved_world_size == world_size
        return checkpoint

    # --------------------------------------------------------------------------------------------- remove
    @override
    def remove_checkpoint(self, path: str | os.PathLike, *, collective: bool = False) -> None:
        """Delete the checkpoint at ``path`` (and any staging left by an interrupted save to it) once.

        Collective: call on all ranks when ``collective=True``; rank 0 deletes, the others wait for it.
        """
        location = Location(path, storage_options=self.storage_options)
        in_flight = self._async.in_flight if self._async is not None else None
        if in_flight is not None and in_flight.url == location.url:
            self._await_pending(collective)  # removing the checkpoint being written: let it finish first
        elif in_flight is not None:
            if _rank_and_world(collective)[0] == 0 and not self._async.defer_removal(location):
                location.remove()
            return

        def remove() -> None:
            location.remove()
            location.remove_stale_staging()

        _on_rank0(collective, remove)

    @override
    def teardown(self) -> None:
        """Wait for the background save in flight (if any) and release the staging buffers.

        Raises:
            CheckpointError: The background save failed; it was not committed.
        """
        if self._async is not None:
            self._async.close()

    def wait(self, *, collective: bool = False) -> None:
        """Block until the background save in flight (if any) is committed.

        Collective: call on all ranks when ``collective=True``; then every rank raises if any rank's part failed.

        Raises:
            CheckpointError: The background save failed (naming the rank and the path); it was not committed.
        """
        self._await_pending(collective)

    def _await_pending(self, collective: bool) -> None:
        if self._async is None or self._async.in_flight is None:
            return
        error: CheckpointError | None = None
        try:
            self._async.wait()
        except CheckpointError as err:
            error = err
        if _distributed(collective):
            errors: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = error or next((e for e in errors if e is not None), None)
        if error is not None:
            raise error


# --------------------------------------------------------------------------------------------------- helpers
def _distributed(collective: bool) -> bool:
    """Whether this call runs as a collective over the default process group."""
    return collective and dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """Silence DCP's warning that it runs in a single process: here that is intended (``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank_and_world(collective: bool) -> tuple[int, int]:
    if _distributed(collective):
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _on_rank0(collective: bool, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on rank 0 and give every rank its result, or raise its exception on every rank."""
    rank, world_size = _rank_and_world(collective)
    if world_size == 1:
        return fn()
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = (True, fn())
        except Exception as err:  # re-raised on every rank below
            payload[0] = (False, err)
    dist.broadcast_object_list(payload, src=0)
    ok, value = payload[0]
    if not ok:
        raise value
    return value


def _writes_in_place(location: Location) -> bool:
    """Whether a save writes straight into ``location`` (object stores, name free) or into a staging directory.

    Local disks always stage (the commit is one rename). On object stores a name holding no committed checkpoint
    (free, or leftovers of a crashed save, which are removed here) is written in place and committed by ``.commit``;
    only an overwrite of a committed checkpoint pays for staging and a server-side copy. Rank 0 only.
    """
    if location.local:
        return False
    if location.exists() and not location.is_committed():
        location.remove()
    return not location.exists()


def _to_lightning_layout(target: dict[str, Any], model_key: str) -> dict[str, Any]:
    """Our target keys -> Lightning's sharded layout (``state_dict``/``model``, ``optimizer_{i}``)."""
    layout = {model_key: target[_format.MODEL_KEY]}
    for i, state in enumerate(target.get(_format.OPTIMIZER_KEY, [])):
        layout[f"optimizer_{i}"] = state
    return layout


def _from_lightning_layout(target: dict[str, Any], model_key: str) -> dict[str, Any]:
    """Lightning's sharded layout -> ``{"state_dict": ..., "optimizer_states": [...]}``."""
    optimizers = sorted((int(k.split("_", 1)[1]), v) for k, v in target.items() if k.startswith("optimizer_"))
    result: dict[str, Any] = {_format.MODEL_KEY: target[model_key]}
    if optimizers:
        result[_format.OPTIMIZER_KEY] = [state for _, state in optimizers]
    return result
