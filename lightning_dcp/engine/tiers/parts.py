"""A node's part of a checkpoint, as it lies in a node-local area (the memory tier's tmpfs directory, or a node's disk).

A checkpoint saved by ranks on several nodes is split by node: node ``j`` holds the data files its ranks wrote
(``__{rank}_{n}.distcp``) in a *part* directory ``{name}@{j}``, beside copies of the checkpoint's ``.metadata`` and
``.commit`` (the one marker rank 0 made, byte for byte, listing every file of every node with its size and
checksums) and a ``.part`` file (JSON: ``{"node": j, "nodes": N, "files": [...]}``, the files of this part). A
replica of node ``j``'s part on another node has exactly the same form and name.

A part is committed by a rename: it is written under a hidden staging name (``.{name}@{j}.tmp-{token}``), its
``.commit`` goes in last, and the directory takes its name whole; so an area never holds a torn part, whatever is
killed when. A checkpoint can be restored from memory when, over every node's area, each of its parts ``0..N-1`` is
committed with the same marker (:func:`complete`).

Evicted parts of this node become free slots (``.free-{token}``) whose files the next save overwrites in place: the
pages of a tmpfs file are allocated once, and a process keeps its mappings of them (see
:mod:`~lightning_dcp.engine.tiers.shm_writer`), so a save costs a memory copy instead of a page fault per 4 KiB.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from lightning_dcp.engine.format.marker import COMMIT_FILE, METADATA_FILE, MarkerError, order_key, parse_commit
from lightning_dcp.engine.storage.localfs import STAGING_INFIX, fsync_dir, new_token, remove_path
from lightning_dcp.engine.storage.names import staging_name

__all__ = ["FREE_PREFIX", "LOAD_PREFIX", "PART_FILE", "Part", "PartStore", "complete", "identity", "part_name"]

PART_FILE = ".part"
"""In a part directory: ``{"node": j, "nodes": N, "files": [names], "run": token}``, written before ``.commit``."""
FREE_PREFIX = ".free-"
"""A free slot: an evicted part of this node whose files the next save overwrites."""
LOAD_PREFIX = ".load-"
"""A checkpoint assembled for a restore (hard links to the parts held here, files fetched from peers)."""
_MAX_SMALL = 64 << 20


def part_name(name: str, node: int) -> str:
    """The directory name of node ``node``'s part of the checkpoint ``name``."""
    return f"{name}@{node}"


def identity(marker: dict[str, Any]) -> tuple:
    """What makes two markers the same checkpoint: commit time and ``.metadata`` size and checksum."""
    return (marker["committed_at"], marker["metadata"]["size"], marker["metadata"]["checksum"])


@dataclasses.dataclass
class Part:
    """A committed part found in an area.

    Attributes:
        name: The checkpoint's name (as in its durable directory).
        node: The node (0-based, at save) whose ranks wrote its files.
        nodes: Nodes at save: the checkpoint has parts ``0..nodes-1``.
        files: The data files of this part.
        marker: The checkpoint's parsed ``.commit`` (the same in every part).
        path: The part directory.
        run: The token of the run that saved it (:mod:`~lightning_dcp.engine.tiers.runs`); ``None``: unknown.
    """

    name: str
    node: int
    nodes: int
    files: list[str]
    marker: dict[str, Any]
    path: str
    run: str | None = None

    @property
    def key(self) -> tuple:
        """The checkpoint's order (:func:`~lightning_dcp.engine.format.marker.order_key`): larger is newer."""
        return order_key(self.marker)

    @property
    def identity(self) -> tuple:
        """See :func:`identity`."""
        return identity(self.marker)


def complete(parts: list[tuple[int, Part]]) -> list[tuple[tuple, str, tuple]]:
    """The checkpoints whose every part is held somewhere, newest first.

    Args:
        parts: ``(area index, part)`` for every committed part of every area (node) taking part.

    Returns:
        ``(order key, name, identity)`` of each checkpoint restorable from the areas, newest first.
    """
    found: dict[tuple[str, tuple], tuple[tuple, int, set[int]]] = {}
    for _, part in parts:
        key = (part.name, part.identity)
        order, nodes, held = found.get(key, (part.key, part.nodes, set()))
        held.add(part.node)
        found[key] = (order, nodes, held)
    whole = [(order, name, ident) for (name, ident), (order, nodes, held) in found.items() if held >= set(range(nodes))]
    return sorted(whole, reverse=True)


class PartStore:
    """The committed parts, staging directories and free slots of one node-local directory.

    Args:
        root: The directory (created now unless ``create`` is false).
        sync: Commit durably (a disk): the markers and directories are fsynced before and after the rename.
        create: Create ``root`` now.
    """

    def __init__(self, root: str, *, sync: bool = False, create: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.sync = sync
        if create:
            os.makedirs(self.root, exist_ok=True)

    def parts(self) -> list[Part]:
        """Every committed part here (a part whose files or markers are unreadable is skipped)."""
        found = []
        for entry in sorted(os.listdir(self.root) if os.path.isdir(self.root) else []):
            if entry.startswith(".") or "@" not in entry:
                continue
            part = self.read(entry)
            if part is not None:
                found.append(part)
        return found

    def read(self, entry: str) -> Part | None:
        """The committed part in the directory ``entry``, or ``None`` (uncommitted, invalid, not a part)."""
        name, _, node = entry.rpartition("@")
        path = os.path.join(self.root, entry)
        try:
            marker = parse_commit(_read(os.path.join(path, COMMIT_FILE)))
            part = json.loads(_read(os.path.join(path, PART_FILE)))
            files, nodes = list(part["files"]), int(part["nodes"])
            if int(part["node"]) != int(node) or not set(files) <= set(marker["files"]):
                return None
        except (OSError, ValueError, KeyError, TypeError, MarkerError):
            return None
        run = part.get("run")
        run = run if isinstance(run, str) else None
        return Part(name=name, node=int(node), nodes=nodes, files=files, marker=marker, path=path, run=run)

    def staging(self, name: str, node: int, token: str) -> str:
        """The hidden staging directory of a part being written or received (not created)."""
        return os.path.join(self.root, staging_name(part_name(name, node), token))

    def commit(
        self,
        staging: str,
        *,
        name: str,
        node: int,
        nodes: int,
        files: list[str],
        metadata: bytes,
        marker: bytes,
        run: str | None = None,
    ) -> str:
        """Make the staging directory the committed part ``{name}@{node}``: markers in, then one rename.

        ``run`` (the saving run's token) is recorded in ``.part``. An existing part of that name (a checkpoint saved
        again under its name) is replaced once the new one is in place. Returns the part's path.
        """
        fields: dict[str, Any] = {"node": node, "nodes": nodes, "files": files}
        if run is not None:
            fields["run"] = run
        part = json.dumps(fields).encode()
        for entry, data in ((METADATA_FILE, metadata), (PART_FILE, part), (COMMIT_FILE, marker)):
            _write(os.path.join(staging, entry), data, sync=self.sync)
        if self.sync:
            fsync_dir(staging)
        final = os.path.join(self.root, part_name(name, node))
        if os.path.lexists(final):
            self.uncommit(final)
            old = os.path.join(self.root, staging_name(part_name(name, node), f"old-{new_token()}"))
            os.rename(final, old)
            os.rename(staging, final)
            remove_path(old)
        else:
            os.rename(staging, final)
        if self.sync:
            fsync_dir(self.root)
        return final

    @staticmethod
    def uncommit(path: str) -> None:
        """Withdraw a part's ``.commit`` first, so a removal cut short never leaves a part that claims to be whole."""
        try:
            os.unlink(os.path.join(path, COMMIT_FILE))
        except FileNotFoundError:
            pass

    def free(self, part: Part, *, slots: int) -> None:
        """Evict ``part``: keep its files as a free slot while fewer than ``slots`` exist, else delete it."""
        self.uncommit(part.path)
        if len(self.free_slots()) < slots:
            for extra in (METADATA_FILE, PART_FILE):
                try:
                    os.unlink(os.path.join(part.path, extra))
                except FileNotFoundError:
                    pass
            os.rename(part.path, os.path.join(self.root, f"{FREE_PREFIX}{new_token()}"))
        else:
            remove_path(part.path)

    def free_slots(self) -> list[str]:
        """Paths of the free slots."""
        return [os.path.join(self.root, e) for e in sorted(os.listdir(self.root)) if e.startswith(FREE_PREFIX)]

    def take_slot(self, staging: str) -> None:
        """Create the staging directory ``staging``, from a free slot when there is one (its files are reused)."""
        for slot in self.free_slots():
            try:
                os.rename(slot, staging)
                return
            except FileNotFoundError:  # taken meanwhile
                continue
        os.makedirs(staging, exist_ok=True)

    def remove_stale(self, *, keep: tuple[str, ...] = ()) -> list[str]:
        """Delete staging and assembly directories (of saves, receptions and restores cut short). Returns them.

        Call when nothing is being written here; free slots stay.
        """
        removed = []
        for entry in os.listdir(self.root):
            path = os.path.join(self.root, entry)
            stale = (entry.startswith(".") and STAGING_INFIX in entry) or entry.startswith(LOAD_PREFIX)
            stale = stale or ("@" in entry and not entry.startswith(".") and self.read(entry) is None)
            if stale and path not in keep and os.path.isdir(path):
                remove_path(path)
                removed.append(path)
        return removed


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read(_MAX_SMALL + 1)
    if len(data) > _MAX_SMALL:
        raise ValueError(f"{path} is too large")
    return data


def _write(path: str, data: bytes, *, sync: bool = False) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
