"""What a checkpoint's non-tensor state may name: the allow-list of :mod:`~lightning_dcp.engine.format.codec`.

A tag names a class or function by its dotted name (``torch.optim.adamw.AdamW``); :func:`lookup` finds it here, never
by importing it. The list: torch's optimizers and lr schedulers (the callables of Hydra's ``_partial_: true``
configs), builtin types and OmegaConf's two config classes as values, what :func:`add_safe_globals` registered, and
what ``torch.serialization.add_safe_globals`` registered. :func:`stock_pickle_globals` lists what a plain pickle of
the same values names, for loading stock Lightning files (:func:`lightning_dcp.engine.format.blob.load_stock_file`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import pathlib
import sys
from collections.abc import Iterable
from typing import Any

import torch

from lightning_dcp._compat import omegaconf_hydra

__all__ = ["OMEGACONF_CLASSES", "add_safe_globals", "installed", "lookup", "name_of", "stock_pickle_globals"]

OMEGACONF_CLASSES = ("omegaconf.dictconfig.DictConfig", "omegaconf.listconfig.ListConfig")
"""OmegaConf's config classes: Lightning records ``type(hparams)``, so a checkpoint may name them as values."""
_PATHS = (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath)
_registered: dict[str, Any] = {}
"""Objects registered with :func:`add_safe_globals`, by dotted name."""


def add_safe_globals(objects: Iterable[Any]) -> None:
    """Allow classes and functions in checkpoints' non-tensor state, for saving and for loading.

    Registered, a dataclass or named tuple class has its instances stored field by field, an enum class its members
    by name; any class or function may be the callable of a ``functools.partial`` (``partial(MyOptimizer,
    lr=...)``, Hydra's ``_partial_: true``) or a value itself. Unlike ``torch.serialization.add_safe_globals``
    (which lightning_dcp also honours), this does not change what ``torch.load`` accepts elsewhere. Register in the
    module that defines the objects, so that every process that saves or loads (also processes a strategy launches)
    has them.

    Args:
        objects: Classes and functions, each with a ``__module__`` and ``__qualname__``.

    Raises:
        TypeError: An object that is not a class or function with a dotted name.
    """
    for obj in objects:
        name = name_of(obj)
        if name is None or not callable(obj):
            raise TypeError(f"add_safe_globals takes classes and functions, got {type(obj).__name__} {obj!r:.60}")
        _registered[name] = obj


def stock_pickle_globals() -> list[Any]:
    """The globals a plain ``torch.save`` of the codec's kinds names.

    A stock Lightning ``.ckpt`` holding Hydra configs, partial optimizers, paths, ... needs them allowed for
    ``weights_only`` loading (see :func:`lightning_dcp.engine.format.blob.load_stock_file`, which rebuilds the result
    through this codec).
    """
    found: list[Any] = [functools.partial, argparse.Namespace, *_PATHS, datetime.datetime, datetime.date, datetime.time]
    hydra_partial = omegaconf_hydra.hydra_partial_class(load=installed("hydra"))
    found += [hydra_partial] if hydra_partial is not None else []
    found += [datetime.timedelta, datetime.timezone, frozenset, *_partial_callables().values(), *_registered.values()]
    if installed("omegaconf"):
        import typing
        from collections import defaultdict

        import omegaconf
        from omegaconf import base, nodes

        found += [omegaconf.DictConfig, omegaconf.ListConfig, base.ContainerMetadata, base.Metadata, typing.Any]
        found += [getattr(nodes, n) for n in dir(nodes) if n.endswith("Node") and n not in ("Node", "ValueNode")]
        found += [dict, list, int, str, float, bool, defaultdict]
    return found


def name_of(obj: Any) -> str | None:
    """``module.qualname`` of a class or function; ``None`` for lambdas and local classes."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qualname, str)) or "<" in qualname:
        return None  # lambdas and local classes have no name another process could look up
    return f"{module}.{qualname}"


def lookup(name: str) -> Any:
    """The allowed object named ``name`` (built-in, registered here, or with torch), or ``None``."""
    if name in OMEGACONF_CLASSES and installed("omegaconf"):
        import omegaconf  # noqa: F401 - ``type(hparams)`` of a config saved by Lightning: the codec's own support
    found = _builtin_names().get(name) or _registered.get(name)
    if found is not None:
        return found
    for entry in torch.serialization.get_safe_globals():
        obj, entry_name = entry if isinstance(entry, tuple) else (entry, name_of(entry))
        if entry_name == name:
            return obj
    return None


@functools.cache
def _partial_callables() -> dict[str, Any]:
    """Torch's optimizers and lr schedulers: what Hydra's ``_partial_: true`` configs hand to a LightningModule."""
    from torch.optim import lr_scheduler, swa_utils

    bases = (torch.optim.Optimizer, lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)
    found = {}
    for module in (torch.optim, lr_scheduler, swa_utils):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, bases) and name_of(obj):
                found[name_of(obj)] = obj
    return found


def _builtin_names() -> dict[str, Any]:
    """The built-in part of the list (OmegaConf's classes once omegaconf is imported)."""
    names = dict(_partial_callables())
    for cls in (dict, list, tuple, set, frozenset, str, int, float, bool, bytes, complex, argparse.Namespace):
        names[name_of(cls)] = cls
    if "omegaconf" in sys.modules:  # a config class as a value: Lightning records ``type(hparams)``
        from omegaconf import DictConfig, ListConfig

        names.update({name_of(DictConfig): DictConfig, name_of(ListConfig): ListConfig})
    return names


def installed(module: str) -> bool:
    """Whether ``module`` is imported or importable (found without importing it)."""
    import importlib.util

    return module in sys.modules or importlib.util.find_spec(module) is not None
