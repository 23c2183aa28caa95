"""``DCPModelCheckpoint``: Lightning's ``ModelCheckpoint`` on any fsspec storage, with DCP checkpoint directories.

What it changes, each checked against Lightning 2.6.6:

- ``save_last="link"`` works everywhere: Lightning's ``_link_checkpoint`` calls ``os.symlink`` and ``setup`` refuses
  remote ``dirpath``. Here ``last.ckpt`` is a symlink on local disks and, where symlinks fail or on any other
  storage, a small pointer object naming the checkpoint it designates (see :meth:`Location.resolve`).
- ``ckpt_path="last"``: Lightning's ``_find_last_checkpoints`` drops the URL protocol (``os.path.normpath`` on
  ``s3://b/k`` gives ``s3:/b/k``) and the Trainer then calls ``fs.modified()`` on each candidate, which fails for
  S3 "directories". Here candidates are full URLs of objects that can be stat-ed (the pointer, or a checkpoint's
  ``.commit`` marker), and only committed checkpoints count: a save interrupted by a crash is never "last".
- Every storage call uses the ``storage_options`` of the Trainer's ``DCPCheckpointIO`` (or the ones given here),
  also Lightning's own check of the "last" candidate (see :class:`_StatDefaults`).
- With ``DCPCheckpointIO(local_dir=...)`` (tiered checkpoints) "last", ``file_exists`` and the clean-up cover both
  tiers, and fitting starts by resuming the uploads a previous run left unfinished.
- Checkpoints half written by a crash (no ``.commit`` marker) and stale staging prefixes in ``dirpath`` are removed
  when fitting starts; an overwrite interrupted mid-commit is completed first.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from typing import Any

import fsspec.config
import fsspec.utils
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dcp._compat import lightning_run
from lightning_dcp.engine import (
    Location,
    canonical_url,
)
from lightning_dcp.engine.tiers import DurableCatalog, Tiers
from lightning_dcp.trainer.checkpoint_io import DCPCheckpointIO
from lightning_dcp.trainer.metrics import log_checkpoint_metrics

__all__ = ["DCPModelCheckpoint", "find_last"]

_PRIVATE = (
    lightning_run.MODEL_CHECKPOINT_FIND_LAST,
    lightning_run.MODEL_CHECKPOINT_LINK,
    lightning_run.MODEL_CHECKPOINT_RESOLVE_DIR,
)
lightning_run.check_private_api(ModelCheckpoint, _PRIVATE)

log = logging.getLogger(__name__)


class DCPModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` for lightning_dcp checkpoints on local disks, ``s3://``, ``gs://`` or any fsspec URL.

    Takes every argument of Lightning's ``ModelCheckpoint`` (``filename``, ``monitor``, ``save_top_k``,
    ``save_last``, ...), keyword-only after ``dirpath``.

    Args:
        dirpath: Directory for the checkpoints (a local path or fsspec URL, ``str``). ``file://`` URLs are accepted.
            URLs are put in canonical form (``s3://b/exp//run`` is ``s3://b/exp/run``; see
            ``lightning_dcp.engine.storage.paths``).
        storage_options: fsspec options for listing, linking and deleting in ``dirpath``. Default: those of the
            Trainer's ``DCPCheckpointIO``, so credentials are configured once.
        **kwargs: Passed to ``ModelCheckpoint``.

    Raises:
        InvalidPathError: ``dirpath`` cannot round-trip through its store (``?``, ``..`` in an object store URL).

    Note:
        ``Trainer.fit(ckpt_path="last")`` stats the chosen candidate with a bare ``fsspec`` filesystem (Lightning's
        checkpoint connector passes no options). So that ``storage_options`` alone are enough, this callback makes
        them fsspec's defaults for the candidate's protocol (``fsspec.config.conf``) from the moment it hands the
        candidate over until its ``setup`` runs (the next step of ``fit``; also undone on an exception), merged over
        and then restoring whatever the user configured there. With a local tier the candidate is a local path
        whenever the newest checkpoint is there, and nothing is changed.
    """

    def __init__(
        self, dirpath: str | os.PathLike | None = None, *, storage_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        # Lightning builds a bare filesystem for `dirpath` here, which fails without credentials for some stores
        # (adlfs raises at once); `setup` builds ours with the storage options. Lightning resolves local paths only.
        super().__init__(dirpath=None, **kwargs)
        if dirpath is not None:
            dirpath = os.fspath(dirpath)
            if dirpath.startswith("file://"):
                dirpath = dirpath[len("file://") :]
            if fsspec.utils.get_protocol(dirpath) == "file":
                dirpath = os.path.realpath(os.path.expanduser(dirpath))
            dirpath = canonical_url(dirpath)  # the path door: refused here, before anything is written
        self.dirpath = dirpath
        self._storage_options = None if storage_options is None else dict(storage_options)
        self._stat_defaults = _STAT_DEFAULTS
        self._not_empty = False  # rank 0: `dirpath` held committed checkpoints at `setup` (warned unless resuming)

    # ----------------------------------------------------------------------------------------------- storage
    def _options(self, trainer: pl.Trainer) -> dict[str, Any]:
        return _options(self, trainer)

    def _tiers(self, trainer: pl.Trainer) -> Tiers | None:
        return _tiers(trainer)

    def _committed(self, trainer: pl.Trainer, directory: Location) -> list[tuple[float, Location]]:
        """Committed checkpoints of ``directory``, newest first; with a local tier, of both tiers (local first)."""
        return _committed(trainer, directory)

    def _directory(self, trainer: pl.Trainer) -> Location:
        return _directory(self, trainer)

    def _is_last_name(self, name: str) -> bool:
        return _is_last_name(self, name)

    # ------------------------------------------------------------------------------------------------ public
    def last_checkpoint(self, trainer: pl.Trainer) -> str | None:
        """URL of the checkpoint ``ckpt_path="last"`` resumes from, or ``None`` when nothing is committed.

        The newest committed checkpoint in ``dirpath`` that passes the fast checks, whatever a ``last*.ckpt`` link
        or pointer says (a link can dangle after a kill, lag behind, or lead elsewhere); with a local tier, the
        newest on either tier (the local copy first). Loading falls back further if that checkpoint's data turns out
        to be damaged. Rank 0 only.
        """
        found = _catalog(trainer).newest_valid(self._directory(trainer))
        return None if found is None else found[0].url

    def latest_checkpoint(self, trainer: pl.Trainer) -> str | None:
        """URL of the newest committed checkpoint in ``dirpath`` whose ``.commit`` is valid, or ``None``.

        Newest by the save order its ``.commit`` records, never a clock. Its data files are not checked
        (`last_checkpoint` does). Rank 0 only.
        """
        found = _catalog(trainer).newest_committed(self._directory(trainer))
        return found[1].url if found else None

    def remove_incomplete(self, trainer: pl.Trainer) -> list[str]:
        """Delete checkpoints in ``dirpath`` whose save did not finish, and stale staging prefixes.

        An overwrite interrupted mid-commit (target uncommitted, its staging prefix committed) is completed instead.
        With a local tier mirroring ``dirpath``, its uncommitted directories go now and ``dirpath`` is cleaned by the
        tier's uploader, in the background (remote prefixes still being uploaded stay). Call when no save to
        ``dirpath`` is in flight. Rank 0 only.

        Returns:
            The URLs removed (with a local tier: from the local tier).
        """
        directory = self._directory(trainer)
        tiers = self._tiers(trainer)
        if tiers is not None and tiers.mirrors(directory):  # remote calls belong to the uploader, off the loop

            def clean() -> None:
                removed = directory.remove_incomplete(self.FILE_EXTENSION, busy=tiers.pending())
                if removed:
                    log.info("lightning_dcp: removed incomplete checkpoint(s) from %s: %s", directory.url, removed)

            tiers.defer(clean, what=f"clean-up of {directory.url}")
            return tiers.remove_incomplete()
        removed = tiers.remove_incomplete() if tiers is not None else []
        return removed + directory.remove_incomplete(
            self.FILE_EXTENSION, busy=tiers.pending() if tiers is not None else ()
        )

    # --------------------------------------------------------------------------------------------- overrides
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve ``dirpath`` (broadcast from rank 0) and, when fitting, clean up after crashed saves.

        With a local tier, rank 0 then resumes the uploads a previous run left unfinished.

        Collective: call on all ranks (Lightning does).
        """
        self._stat_defaults.restore()
        io = lightning_run.unwrap_checkpoint_io(trainer.strategy.checkpoint_io)
        if not isinstance(io, DCPCheckpointIO) and not hasattr(trainer.strategy, "_dcp_sharded"):
            rank_zero_warn(
                f"`DCPModelCheckpoint` saves through the Trainer's `{type(io).__name__}` under"
                f" `{type(trainer.strategy).__name__}`, which writes Lightning's single-file checkpoints, not DCP"
                " directories. Add `plugins=[lightning_dcp.DCPCheckpointIO()]` to the Trainer, or use a `dcp_*`"
                " strategy (e.g. `strategy='dcp_ddp'`)."
            )
        self.dirpath = trainer.strategy.broadcast(getattr(self, lightning_run.MODEL_CHECKPOINT_RESOLVE_DIR)(trainer))
        directory = self._directory(trainer)
        self._fs = directory.fs
        if trainer.is_global_zero and stage == "fit":
            tiers = self._tiers(trainer)
            if tiers is not None and tiers.covers(directory):
                tiers.bind(directory)  # its remote calls (clean-up, uploads) run in the tier's uploader
            removed = self.remove_incomplete(trainer)
            if removed:
                rank_zero_info(_removed_message(removed))
            # Told in `on_train_start` unless the fit resumes (the checkpoint to resume is chosen after `setup`).
            self._not_empty = self.save_top_k != 0 and bool(_catalog(trainer).known(directory, wait=False))
            if tiers is not None:
                tiers.resume()
        trainer.strategy.barrier("DCPModelCheckpoint.setup")

    # Checkpoint metrics (trainer/metrics.py): logged from the main thread at each hook after a save or restore.
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Warn about a non-empty ``dirpath`` unless this fit resumed; log ``checkpoint/restore_s`` of the resume.

        Lightning's ``ModelCheckpoint`` warns "exists and is not empty" in ``setup``, also when the fit resumes from
        that very directory (every resume); here only a fit that starts fresh among older checkpoints is told.
        """
        super().on_train_start(trainer, pl_module)
        if self._not_empty and trainer.ckpt_path is None:
            rank_zero_warn(f"Checkpoint directory {self.dirpath} exists and is not empty.")
        self._not_empty = False
        log_checkpoint_metrics(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        """Save as ``ModelCheckpoint`` does, then log the saves committed since the last hook."""
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        log_checkpoint_metrics(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save as ``ModelCheckpoint`` does, then log the saves committed since the last hook."""
        super().on_train_epoch_end(trainer, pl_module)
        log_checkpoint_metrics(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save as ``ModelCheckpoint`` does, then log the saves committed since the last hook."""
        super().on_validation_end(trainer, pl_module)
        log_checkpoint_metrics(trainer)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Log the last saves (the strategy's teardown has waited for the one in flight)."""
        super().on_fit_end(trainer, pl_module)
        log_checkpoint_metrics(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Undo the fsspec defaults of ``_find_last`` if ``fit`` failed before ``setup``."""
        self._stat_defaults.restore()
        super().on_exception(trainer, pl_module, exception)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Undo the fsspec defaults of ``_find_last`` (when ``setup`` did not run)."""
        self._stat_defaults.restore()
        super().teardown(trainer, pl_module, stage)

    @override
    def file_exists(self, filepath: str | os.PathLike, trainer: pl.Trainer) -> bool:
        """Whether a checkpoint (committed directory, pointer or file) exists at ``filepath``, decided on rank 0.

        A directory left by a crashed save does not count, so the next save reuses its name and replaces it. With a
        local tier, the tier answers (committed locally, on its way, or known to be held remotely): no remote call.
        Collective: call on all ranks.
        """
        exists = False
        if trainer.is_global_zero:
            location = Location(os.fspath(filepath), storage_options=self._options(trainer))
            tiers = self._tiers(trainer)
            if tiers is not None and tiers.covers(location) and tiers.mirrors(location.parent()):
                exists = tiers.exists(location)  # the local tier and the uploader know: no remote call in the loop
            else:
                exists = location.exists() and (not location.isdir() or location.is_committed())
        return trainer.strategy.reduce_boolean_decision(exists, all=False)

    def _link(self, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        """``save_last="link"``: make ``linkpath`` designate ``filepath``. Collective: call on all ranks."""
        if trainer.is_global_zero and filepath != linkpath:
            options = self._options(trainer)
            link, target = Location(linkpath, storage_options=options), Location(filepath, storage_options=options)
            tiers = self._tiers(trainer)
            if tiers is not None and tiers.covers(link) and tiers.mirrors(link.parent()):
                tiers.link(link, target)  # written remotely behind the target's upload, off the training loop
            elif not (link.local and _symlink(target.path, link.path)):
                link.write_pointer(target)
        trainer.strategy.barrier("DCPModelCheckpoint.link")

    def _find_last(self, trainer: pl.Trainer) -> set[str]:
        """The candidate Lightning resolves ``ckpt_path="last"`` to; see ``find_last`` in this module."""
        return find_last(self, trainer, stat_defaults=self._stat_defaults)


def find_last(
    callback: ModelCheckpoint, trainer: pl.Trainer, *, stat_defaults: _StatDefaults | None = None
) -> set[str]:
    """The candidate ``ckpt_path="last"`` resolves to for ``callback``; empty when its directory holds no commit.

    For ``DCPModelCheckpoint``, and for Lightning's own ``ModelCheckpoint`` in a Trainer that checkpoints through
    lightning_dcp (:mod:`lightning_dcp.trainer.hooks` routes its ``_find_last_checkpoints`` here): Lightning loads
    nothing when no ``last*.ckpt`` entry exists, which a kill between ``_link_checkpoint``'s removal of the old link
    and the new one's creation leaves beside committed checkpoints.

    Lightning stats the candidate with a bare filesystem and then hands it to the strategy's loader, which reads a
    ``last*`` name (or a ``.commit`` marker) as "the newest valid checkpoint of this directory"
    (:func:`lightning_dcp.engine.catalog.lookup.candidates`). So the candidate is a local ``last*.ckpt`` entry when
    one resolves, else the newest committed checkpoint's ``.commit`` (an object with a modification time, also on
    object stores, where "directories" have none). A save with ``save_last=False`` still resumes: a run never
    starts from scratch while a committed checkpoint exists. With a local tier, the newest checkpoint of both tiers
    (a local ``.commit`` when the local tier holds it).

    Lightning stats a remote candidate with a bare filesystem: with ``stat_defaults`` (``DCPModelCheckpoint``'s),
    the callback's storage options become fsspec's defaults for its protocol until its ``setup`` (see the class
    note). Every rank asks (Lightning's checkpoint connector runs on all ranks); the loader reads rank 0's answer.
    """
    if any(getattr(c, "tier", None) is not None and c is not callback for c in trainer.callbacks):
        return set()  # a MemoryCheckpoint answers for every tier, this directory included
    directory = _directory(callback, trainer)
    found = _committed(trainer, directory)
    if not found:
        return set()
    if directory.local:
        for name, _ in directory.entries(follow_links=False):
            entry = directory.child(name)
            if _is_last_name(callback, name) and os.path.exists(entry.path):  # not dangling
                return {entry.url}
    newest = found[0][1]
    others = sorted({getattr(entry, "run", None) for entry in found} - {getattr(found[0], "run", None), None})
    if others:
        rank_zero_warn(
            f"lightning_dcp: no `last*.ckpt` in {directory.url!r} names a committed checkpoint, and {len(others) + 1}"
            f" runs saved into it; resuming the newest checkpoint, {newest.url!r} (run {found[0].run}), and passing"
            f" over run(s) {', '.join(others)}. Pass a checkpoint of another run as `ckpt_path` to resume it instead."
        )
    if not newest.local and stat_defaults is not None:
        stat_defaults.set(newest.url, _options(callback, trainer))
    return {newest.marker_url}


def _options(callback: ModelCheckpoint, trainer: pl.Trainer) -> dict[str, Any]:
    """The callback's own storage options, else those of the Trainer's ``DCPCheckpointIO``."""
    own = getattr(callback, "_storage_options", None)
    if own is not None:
        return own
    io = lightning_run.unwrap_checkpoint_io(trainer.strategy.checkpoint_io)
    return dict(io.storage_options) if isinstance(io, DCPCheckpointIO) else {}


def _tiers(trainer: pl.Trainer) -> Tiers | None:
    io = lightning_run.unwrap_checkpoint_io(trainer.strategy.checkpoint_io)
    return io.tiers if isinstance(io, DCPCheckpointIO) else None


def _catalog(trainer: pl.Trainer) -> DurableCatalog:
    """The durable tiers' catalog of the Trainer's ``DCPCheckpointIO`` (one of no local tier without it)."""
    io = lightning_run.unwrap_checkpoint_io(trainer.strategy.checkpoint_io)
    return io.checkpointer.catalog if isinstance(io, DCPCheckpointIO) else DurableCatalog(None)


def _committed(trainer: pl.Trainer, directory: Location) -> list[tuple[float, Location]]:
    return _catalog(trainer).checkpoints(directory)


def _directory(callback: ModelCheckpoint, trainer: pl.Trainer) -> Location:
    dirpath = getattr(callback, lightning_run.MODEL_CHECKPOINT_RESOLVE_DIR)(trainer)
    return Location(os.fspath(dirpath), storage_options=_options(callback, trainer))


def _is_last_name(callback: ModelCheckpoint, name: str) -> bool:
    stem, ext = os.path.splitext(name)
    pattern = rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-(\d+))?$"
    return ext == callback.FILE_EXTENSION and re.match(pattern, stem) is not None


def _removed_message(removed: list[str]) -> str:
    """One line per directory cleaned: what interrupted saves (and, in a local tier, uploads) left there."""
    by_directory: dict[str, list[str]] = {}
    for url in removed:
        parent, _, name = url.rstrip("/").rpartition("/")
        by_directory.setdefault(parent or ".", []).append(name)
    return "\n".join(
        f"Removed what interrupted saves or uploads left in {parent} (never committed, never loaded): {sorted(names)}"
        for parent, names in by_directory.items()
    )


class _StatDefaults:
    """fsspec defaults (``fsspec.config.conf[protocol]``) for a protocol, set for a while and then restored exactly.

    Lightning's checkpoint connector resolves ``ckpt_path="last"`` with ``get_filesystem(path).exists/.modified``:
    a filesystem built from the URL alone, which fsspec completes with ``fsspec.config.conf[protocol]`` before it
    looks up its instance cache. The instance so built is cached under the completed options, so filesystems that
    users build later without options are not affected. While the defaults are set, any filesystem of that protocol
    built without these options in this process gets them. One instance serves every callback of the process, so the
    user's own configuration is what the first ``set`` found, whatever the number of callbacks.
    """

    _MISSING = object()

    def __init__(self) -> None:
        self._saved: dict[str, Any] = {}

    def set(self, url: str, options: dict[str, Any]) -> None:
        """Make ``options`` the defaults of ``url``'s protocol (merged over the user's own) until :meth:`restore`."""
        if not options or "://" not in url:
            return
        protocol = url.split("://", 1)[0]
        if protocol not in self._saved:
            user = fsspec.config.conf.get(protocol, self._MISSING)
            self._saved[protocol] = user if user is self._MISSING else copy.deepcopy(user)
        user = self._saved[protocol]
        fsspec.config.conf[protocol] = {**({} if user is self._MISSING else user), **options}

    def restore(self) -> None:
        """Put back exactly what ``fsspec.config.conf`` held before :meth:`set`."""
        for protocol, value in self._saved.items():
            if value is self._MISSING:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = value
        self._saved.clear()


_STAT_DEFAULTS = _StatDefaults()


def _symlink(target: str, link: str) -> bool:
    """Replace ``link`` with a relative symlink to ``target``; False where symlinks are not possible."""
    Location(link).remove()
    try:
        os.symlink(os.path.relpath(target, os.path.dirname(os.path.abspath(link))), link)
    except OSError:
        return False
    return True


# Lightning's private names are bound here, through _compat, so that a rename in Lightning fails at import above.
setattr(DCPModelCheckpoint, lightning_run.MODEL_CHECKPOINT_LINK, DCPModelCheckpoint._link)
setattr(DCPModelCheckpoint, lightning_run.MODEL_CHECKPOINT_FIND_LAST, DCPModelCheckpoint._find_last)
