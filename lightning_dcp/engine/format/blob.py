"""The non-tensor state of a checkpoint: one ``torch.save`` blob that ``weights_only=True`` loading accepts.

Rank 0 writes everything of a checkpoint that is not a tensor tree (Lightning's loop, callback and scheduler state,
hparams; Fabric's plain objects) as one ``bytes`` entry of DCP's state dict, and each rank its own RNG states as
another (:mod:`lightning_dcp.engine.format.layout` places them). :func:`encode_extra` stores what Lightning users keep
there (Hydra configs, partial optimizers, paths, numpy, ...) through the codec of
:mod:`lightning_dcp.engine.format.codec` and refuses at save time what it cannot store (naming the key path and the
fix). :func:`decode_extra` checks the archive before unpickling anything (:mod:`lightning_dcp.engine.format.archive`),
decodes, and turns every failure into a ``CheckpointError``. :func:`load_stock_file` reads a single-file checkpoint that
stock Lightning wrote with the same allow-list.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_dcp.engine.format import allowlist, codec
from lightning_dcp.engine.format.archive import load_checked
from lightning_dcp.engine.format.codec import UnstorableValue
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError, describe_load_error

__all__ = ["decode_extra", "encode_extra", "load_stock_file"]


def encode_extra(extra: Mapping[str, Any], *, what: str = "non-tensor state") -> bytes:
    """Serialize non-tensor state with ``torch.save`` into ``bytes`` that ``weights_only=True`` loading accepts.

    The codec's kinds (OmegaConf configs, ``functools.partial`` of optimizers and schedulers, ``argparse.Namespace``,
    paths, datetimes, numpy, and registered dataclasses, named tuples and enums) are stored as plain tagged values
    and come back as themselves; anything else that ``torch.load(weights_only=True)`` would refuse is refused here,
    at save, so a checkpoint is never written that cannot be loaded.

    Args:
        extra: The state (dicts, lists, tuples, str, numbers, tensors, the codec's kinds; classes allowed with
            ``lightning_dcp.add_safe_globals`` or ``torch.serialization.add_safe_globals``).
        what: What this state is, for messages.

    Raises:
        CheckpointError: Something in ``extra`` cannot be stored; the message names its key path, its type, and the
            fix.
    """
    try:
        state = codec.encode(dict(extra))
    except UnstorableValue as err:
        raise _unstorable(what, err.path, err.culprit, err.hint) from None
    except RecursionError:
        raise CheckpointError(f"The checkpoint's {what} is nested too deeply (or refers to itself).") from None
    buffer = io.BytesIO()
    torch.save(state, buffer)
    blob = buffer.getvalue()
    try:
        torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as err:  # a key of a type torch cannot load back, a value torch pickles differently
        path, culprit = _unloadable_part(state)
        raise _unstorable(
            what, path, culprit, f"`torch.load(weights_only=True)` cannot load it back ({describe_load_error(err)})."
        ) from None
    return blob


def _unstorable(what: str, path: str, culprit: str, hint: str) -> CheckpointError:
    return CheckpointError(
        f"The checkpoint's {what} holds {culprit} at {path or 'the top level'}, which lightning_dcp cannot store so"
        f" that it loads back safely; the checkpoint would be unusable, so it was not written. {hint}"
    )


def decode_extra(blob: bytes, *, path: str, entry: str, weights_only: bool = True) -> dict[str, Any]:
    """Deserialize state written by :func:`encode_extra`; ``weights_only=True`` never runs code from the file.

    The archive is checked first (:func:`~lightning_dcp.engine.format.archive.check_archive`): nothing it claims is
    allocated beyond what it holds.

    Args:
        blob: The bytes of one DCP ``BYTE_IO`` entry.
        path: The checkpoint they come from, for messages.
        entry: The DCP entry (FQN) they were read from, named by the errors (``err.file``).
        weights_only: ``torch.load``'s ``weights_only``; ``False`` only for checkpoints the caller trusts.

    Raises:
        CheckpointError: The state holds classes ``weights_only`` loading refuses (written by another writer);
            the message names them and the fix.
        CorruptCheckpointError: The bytes are not a ``torch.save`` archive of a dict as :func:`encode_extra`
            writes it.
    """
    try:
        state = load_checked(blob, weights_only=weights_only)
    except Exception as err:  # a crafted or damaged archive: zip, pickle or tensor errors of many types
        if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in str(err):
            raise _refused(
                f"The non-tensor state of the checkpoint at {path!r} names a class that `weights_only=True` loading"
                f" refuses ({describe_load_error(err)}). If you trust this checkpoint, allow it with"
                " `torch.serialization.add_safe_globals([...])` before loading.",
                file=entry,
            ) from None
        raise CorruptCheckpointError(
            f"The non-tensor state of the checkpoint at {path!r} is not readable ({describe_load_error(err)}).",
            file=entry,
        ) from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(
            f"The non-tensor state of the checkpoint at {path!r} is a {type(state).__name__}, not a dict.",
            file=entry,
        )
    return _decoded(state, path=path, entry=entry)


def _decoded(state: Any, *, path: str, entry: str | None) -> Any:
    """:func:`codec.decode` with its failures as ``CheckpointError`` s naming ``path``."""
    try:
        return codec.decode(state)
    except codec.DisallowedName as err:
        raise _refused(
            f"The non-tensor state of the checkpoint at {path!r} names the {err.kind} {err.name!r}, which is not in"
            f" lightning_dcp's allow-list, so it was not loaded. If you trust this checkpoint and the {err.kind},"
            f" register it with `lightning_dcp.add_safe_globals([{err.name}])` before loading.",
            file=path if entry is None else entry,
        ) from None
    except (codec.MalformedTag, RecursionError) as err:
        reason = "it is nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise CorruptCheckpointError(
            f"The non-tensor state of the checkpoint at {path!r} holds a value that is not what lightning_dcp"
            f" writes ({reason}).",
            file=entry,
        ) from None


def load_stock_file(load: Callable[[], Any], *, path: str) -> Any:
    """Run ``load`` with the codec's kinds allowed, and rebuild what it gives through the codec.

    ``load`` is a ``torch.load(..., weights_only=True)`` of a single-file checkpoint that stock Lightning or
    ``torch.save`` wrote.

    A plain ``torch.save`` pickles a Hydra config as OmegaConf's internal node classes and a partial optimizer as
    ``functools.partial``; ``weights_only`` loading refuses them. For the duration of ``load`` they (and what
    :func:`~lightning_dcp.engine.format.allowlist.stock_pickle_globals` lists) are added to torch's safe globals (those
    not already there, removed again after; torch keeps one process-wide list), so nothing else can be named by the
    file. The objects it gives are then encoded and decoded by the codec: what comes back is rebuilt from checked plain
    values, and a value the codec would not store (a partial of a function outside the allow-list) fails like a crafted
    blob.

    Raises:
        CheckpointError: The file names or holds something outside the allow-list (``load``'s other errors pass
            through).
    """
    with _allowed_for_stock_files():
        try:
            loaded = load()
        except pickle.UnpicklingError as err:
            reason = _unpickling_reason(err)
            if "GLOBAL" not in reason.upper():
                raise CheckpointError(
                    f"The checkpoint file {path!r} cannot be read with weights-only unpickling ({reason})."
                ) from None
            raise _refused(
                f"The checkpoint file {path!r} names a class or function outside lightning_dcp's allow-list and"
                f" torch's safe globals ({reason}), so it was not loaded. If you trust this file, allow it with"
                " `lightning_dcp.add_safe_globals([...])` (dataclasses, named tuples, enums, callables of"
                " functools.partial) or `torch.serialization.add_safe_globals([...])`, or load with"
                " `weights_only=False`.",
                file=path,
            ) from None
    try:
        stored = codec.encode(loaded)
    except codec.UnstorableValue as err:
        raise _refused(
            f"The checkpoint file {path!r} holds {err.culprit} at {err.path or 'the top level'}, outside"
            f" lightning_dcp's allow-list, so it was not loaded. {err.hint}",
            file=path,
        ) from None
    except Exception as err:  # objects the unpickler built from crafted state may fail in any way when walked
        raise CheckpointError(
            f"The checkpoint file {path!r} holds a value that cannot be checked ({err!s:.160})."
        ) from None
    return _decoded(stored, path=path, entry=None)


def _refused(message: str, *, file: str) -> CheckpointError:
    """The ``CheckpointError`` for state naming what loading refuses; ``err.file``: the entry or file naming it."""
    err = CheckpointError(message)
    err.file = file
    return err


def _unpickling_reason(err: Exception) -> str:
    """The line of torch's weights-only error that says what was refused (its other lines are advice)."""
    advice = ("Weights only load failed", "Check the documentation", "(1)", "(2)", "Please file an issue")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    reasons = [line.removeprefix("WeightsUnpickler error:").strip() for line in lines if not line.startswith(advice)]
    return next((r for r in reasons if r), None) or describe_load_error(err)


def _allowed_for_stock_files() -> contextlib.AbstractContextManager:
    """Torch's own ``safe_globals`` scope over the codec's stock globals that torch does not already allow."""
    present = {id(g[0] if isinstance(g, tuple) else g) for g in torch.serialization.get_safe_globals()}
    added = {id(g): g for g in allowlist.stock_pickle_globals() if id(g) not in present}
    return torch.serialization.safe_globals(list(added.values()))


def _unloadable_part(value: Any, path: str = "") -> tuple[str, str]:
    """The deepest key path (``['callbacks']['x']``) that does not load with ``weights_only=True``, and its type."""
    children: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    for child_path, child in children:
        if not codec.weights_only_loads(child):
            return _unloadable_part(child, child_path)
    return path or "the top level", f"{type(value).__module__}.{type(value).__qualname__}"
