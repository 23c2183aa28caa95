"""OmegaConf and Hydra private APIs that the codec of the non-tensor state needs (omegaconf 2.3, hydra-core 1.3.8)."""

from __future__ import annotations

import functools
import importlib
from typing import Any

__all__ = [
    "HYDRA_PARTIAL_ATTRIBUTES",
    "OMEGACONF_CHECKED_AGAINST",
    "hydra_partial_class",
    "omegaconf_build",
    "omegaconf_tree",
]

# ------------------------------------------------------------------------------------------ OmegaConf
# The codec (lightning_dcp.engine.format.codec) stores a DictConfig / ListConfig as the node tree of its root plus the
# path to the node (interpolations resolve against the same root after a load, as with pickle). OmegaConf has no public
# API for a node's own flags or its place in the tree: these read ``node._metadata.flags`` (the flags set on that
# node, not inherited), ``_get_parent()``, ``_key()`` and ``_get_node(key)``, and set flags with ``_set_flag``
# (what ``OmegaConf.set_struct`` / ``set_readonly`` call). Checked against omegaconf 2.3.
OMEGACONF_CHECKED_AGAINST = "2.3"


_OMEGACONF_MAX_DEPTH = 1000


def omegaconf_tree(node: Any) -> tuple[tuple[Any, ...], list[Any]]:
    """``(tree, path)``: the tree of ``node``'s root and the keys from the root down to ``node``.

    A tree node is ``(kind, flags, content)``: kind ``"dict"`` (content: ``[[key, child], ...]``), ``"list"``
    (``[child, ...]``) or ``"value"`` (the raw value: interpolations as their ``${...}`` string, ``"???"`` for a
    missing value); a container that is missing, an interpolation or ``None`` has that raw value as its content.
    ``flags`` holds only the flags set on that node (``struct``, ``readonly``, ...).
    """
    from omegaconf import Container

    path: list[Any] = []
    root = node
    while root._get_parent() is not None:
        if len(path) >= _OMEGACONF_MAX_DEPTH:
            raise ValueError("an OmegaConf node nested deeper than 1000 levels (or in a cycle)")
        path.append(root._key())
        root = root._get_parent()
    if not isinstance(root, Container):
        raise ValueError(f"an OmegaConf node whose root is a {type(root).__name__}")
    return _omegaconf_node(root), path[::-1]


def _omegaconf_node(node: Any) -> tuple[Any, ...]:
    from omegaconf import DictConfig, ListConfig

    flags = dict(node._metadata.flags)
    if isinstance(node, (DictConfig, ListConfig)):
        kind = "dict" if isinstance(node, DictConfig) else "list"
        if node._is_missing() or node._is_interpolation() or node._is_none():
            return kind, flags, node._value()
        if kind == "dict":
            return kind, flags, [[key, _omegaconf_node(node._get_node(key))] for key in node.keys()]
        return kind, flags, [_omegaconf_node(node._get_node(i)) for i in range(len(node))]
    return "value", flags, node._value()


def omegaconf_build(tree: tuple[Any, ...], path: list[Any]) -> Any:
    """The node at ``path`` of a config rebuilt from :func:`omegaconf_tree`'s ``tree`` (flags set as recorded).

    Raises:
        ValueError: ``tree`` is not such a tree, or ``path`` does not lead to a container in it.
    """
    from omegaconf import Container, OmegaConf

    kind, flags, content = _omegaconf_check(tree)
    if kind == "value" or not isinstance(content, list):
        raise ValueError("an OmegaConf root must be a dict or list config with content")
    root = OmegaConf.create(_omegaconf_plain(tree), flags={"allow_objects": True})
    if (kind == "dict") != OmegaConf.is_dict(root):
        raise ValueError(f"an OmegaConf {kind} config came back as {type(root).__name__}")
    root._set_flag("allow_objects", None)
    _omegaconf_flags(root, tree)
    node = root
    for key in path:
        node = node._get_node(key) if isinstance(node, Container) else None
        if not isinstance(node, Container):
            raise ValueError(f"an OmegaConf path {path!r} that leads to no container")
    return node


def _omegaconf_check(tree: Any) -> tuple[str, dict[str, bool], Any]:
    if not (type(tree) is tuple and len(tree) == 3 and tree[0] in ("dict", "list", "value")):
        raise ValueError(f"an OmegaConf node is {type(tree).__name__} {str(tree)[:60]!r}, not (kind, flags, content)")
    kind, flags, content = tree
    if type(flags) is not dict or not all(type(k) is str and type(v) is bool for k, v in flags.items()):
        raise ValueError(f"OmegaConf flags are {str(flags)[:60]!r}, not names and booleans")
    if kind == "dict" and type(content) is list:
        if not all(type(item) is list and len(item) == 2 for item in content):
            raise ValueError("OmegaConf dict items are not [key, node] pairs")
    return kind, flags, content


def _omegaconf_plain(tree: Any) -> Any:
    kind, _, content = _omegaconf_check(tree)
    if kind == "value" or type(content) is not list:
        return content
    if kind == "dict":
        return {key: _omegaconf_plain(child) for key, child in content}
    return [_omegaconf_plain(child) for child in content]


def _omegaconf_flags(node: Any, tree: tuple[Any, ...]) -> None:
    kind, flags, content = tree
    if kind != "value" and type(content) is list:
        children = content if kind == "dict" else enumerate(content)
        for key, child in children:
            _omegaconf_flags(node._get_node(key), child)
    for name, value in flags.items():
        node._set_flag(name, value)


# ------------------------------------------------------------------------------------------ Hydra
# Hydra 1.3.8 returns ``_partial_: true`` targets as ``hydra._internal.target_policy._DeferredTarget``, a private
# ``functools.partial`` subclass that authorizes its target again when called; it carries the attributes
# ``_hydra_resolved_from`` (the target's dotted name) and ``_hydra_full_key`` (its key in the config). The codec keeps
# the type, so a loaded optimizer factory is called under Hydra's policy as before. Checked against hydra-core 1.3.8.
HYDRA_PARTIAL_ATTRIBUTES = ("_hydra_resolved_from", "_hydra_full_key")


_HYDRA_PARTIAL = ("hydra._internal.target_policy", "_DeferredTarget")


def hydra_partial_class(*, load: bool = False) -> type | None:
    """Hydra's deferred-target partial class, or ``None`` (Hydra older than 1.3.8, or not imported and not ``load``)."""
    import sys

    module = sys.modules.get(_HYDRA_PARTIAL[0])
    if module is None and load:
        try:
            module = importlib.import_module(_HYDRA_PARTIAL[0])
        except ImportError:
            return None
    cls = getattr(module, _HYDRA_PARTIAL[1], None)
    return cls if isinstance(cls, type) and issubclass(cls, functools.partial) else None
