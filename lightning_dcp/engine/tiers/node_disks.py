"""Persisting the memory tier to node-local disks: each node keeps its parts on its own disk; the commit stays global.

Where the durable local directory (a local ``dirpath``, or the ``local_dir`` in front of a remote ``dirpath``) is one
filesystem that every node reaches, :mod:`~lightning_dcp.engine.tiers.persist` writes a persisted checkpoint there
whole. Where it is a disk of each machine (the same path on every node, or another), :func:`layout` tells so once per
run (each node's leader creates a probe directory; every rank says whose it sees), and :class:`NodeDisks` persists:

1. each node's disk keeps, in ``{dir}/.lightning_dcp-parts``, every part of the checkpoint its memory area holds: its
   own part and the replicas of its peers' parts (so K replicas protect the disk copies as they protect memory), in
   the memory tier's part format (:mod:`~lightning_dcp.engine.tiers.parts`: ``{name}@{j}`` with ``.metadata``, the
   global ``.commit`` byte for byte, and ``.part``). The node's ranks share the copying; every file and directory is
   fsynced and each part is committed by a rename, so a kill leaves a hidden staging directory (removed at the next
   persist, never read), never a torn part;
2. with a remote ``dirpath``, each node's leader puts its own node's data files to the remote prefix; once every node
   has, rank 0 puts ``.metadata``, checks every size in a fresh listing and writes ``.commit`` last
   (:func:`~lightning_dcp.engine.tiers.upload.begin`, :func:`~lightning_dcp.engine.tiers.upload.finish`). An upload
   that fails (a store that is down) never fails training: the node-local commit stands, rank 0 logs a warning, and
   the upload is retried at the next persist;
3. the disk keeps the newest ``keep`` checkpoints this run persisted; the remote directory keeps the newest ``keep``
   this run uploaded, an older one removed only once a newer one is committed there.

Restores read these parts beside the memory areas' (:mod:`~lightning_dcp.engine.tiers.recovery`): after a restart of
the whole cluster, every memory area empty, the newest checkpoint persisted on the disks is restored, a part that one
node's disk lacks fetched from a peer's disk replica, at any world size.

Every function and method here is collective over the memory tier's group (its background thread when saving).
"""

from __future__ import annotations

import errno
import io
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_dcp.engine.agreement import RankFailure
from lightning_dcp.engine.format.marker import METADATA_FILE, parse_commit
from lightning_dcp.engine.storage.localfs import STAGING_INFIX, new_token, remove_path
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.parts import PartStore, identity, part_name
from lightning_dcp.engine.tiers.upload import abandon, begin, finish, remove_committed
from lightning_dcp.errors import CheckpointError, CorruptCheckpointError

if TYPE_CHECKING:
    from lightning_dcp.engine.tiers.memory import MemoryTier, Saved

__all__ = ["PARTS_DIR", "NodeDisks", "copy_file", "everywhere", "existing_store", "layout", "parts_root"]

log = logging.getLogger(__name__)

PARTS_DIR = ".lightning_dcp-parts"
"""In a node-local ``dirpath`` or ``local_dir``: the node's parts of persisted checkpoints (hidden from listings)."""
_PROBE = ".probe"
_COPY = 16 << 20


def parts_root(base: str) -> str:
    """The directory of the persisted parts in the durable local directory ``base``."""
    return os.path.join(os.path.abspath(base), PARTS_DIR)


def existing_store(base: str) -> PartStore | None:
    """The store of persisted parts in ``base``, or ``None`` when nothing was ever persisted there per node."""
    root = parts_root(base)
    return PartStore(root) if os.path.isdir(root) else None


def layout(tier: MemoryTier, base: str) -> bool:
    """Whether the durable local directory ``base`` is a disk of each node (``True``) or one for all (``False``).

    Collective over the tier's group.

    Raises:
        CheckpointError: ``base`` cannot be written, or some nodes share it and others do not.
    """
    topology = tier.topology
    if topology.nodes == 1:
        return False
    token = tier.broadcast(new_token() if topology.rank == 0 else None)
    root = parts_root(base)

    def probe(node: int) -> str:
        return os.path.join(root, f"{_PROBE}{STAGING_INFIX}{token}-{node}")

    def create() -> None:
        if topology.leader:
            os.makedirs(probe(topology.node))

    everywhere(tier, create, failure=f"Persisting to {base!r} failed")
    seen = [j for j in range(topology.nodes) if os.path.isdir(probe(j))]
    views = tier.gather(seen)
    if topology.leader:
        remove_path(probe(topology.node))
    if all(view == list(range(topology.nodes)) for view in views):
        tier.gather(None)  # every probe is gone
        if topology.rank == 0:
            try:
                os.rmdir(root)
            except OSError:  # parts of an earlier run: they stay
                pass
        return False
    if all(view == [topology.node_of(r)] for r, view in enumerate(views)):
        return True
    raise CheckpointError(
        f"The memory tier persists into {base!r}, which some nodes share and others do not (the nodes whose probe"
        f" each rank sees: {views}). Give every node its own disk there, or one filesystem that every node reaches."
    )


def everywhere(tier: MemoryTier, fn: Callable[[], Any], *, failure: str) -> None:
    """Run ``fn`` on every rank; raise on every rank if it failed on any. Collective over the tier's group.

    Raises:
        CheckpointError: ``{failure}: ...`` naming each rank's error.
    """
    error = None
    try:
        fn()
    except RankFailure as err:  # already agreed by every rank (the same on each): said once
        error = str(err)
    except Exception as err:
        error = f"node {tier.topology.node} (rank {tier.topology.rank}): {type(err).__name__}: {err}"
    failed = list(dict.fromkeys(e for e in tier.gather(error) if e is not None))
    if failed:
        raise CheckpointError(f"{failure}: {'; '.join(failed)}")


def copy_file(src: str, out: Any, size: int, *, sync: bool) -> None:
    """Copy the first ``size`` bytes of the file ``src`` into the open binary file ``out`` (fsynced when ``sync``).

    Where ``out`` is a local file the kernel copies (``sendfile``): reading into Python objects first costs several
    times as much here (fresh pages for every chunk). Other files (fsspec) get chunks of 16 MiB.

    Raises:
        CorruptCheckpointError: ``src`` is shorter than ``size``.
    """
    with open(src, "rb") as f:
        done = _send(f, out, size)
        f.seek(done)
        left = size - done
        while left:
            chunk = f.read(min(_COPY, left))
            if not chunk:
                raise CorruptCheckpointError(f"{src} is shorter than its {size} bytes.", file=os.path.basename(src))
            out.write(chunk)
            left -= len(chunk)
    if sync:
        out.flush()
        os.fsync(out.fileno())


def _send(src: Any, out: Any, size: int) -> int:
    """Bytes of ``src`` copied into ``out`` by ``sendfile`` (0 where ``out`` has no descriptor or refuses it)."""
    try:
        fd = out.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return 0
    out.flush()
    done = 0
    try:
        while done < size:
            sent = os.sendfile(fd, src.fileno(), done, size - done)
            if not sent:  # ``src`` ends early: the caller's read says so
                break
            done += sent
    except OSError as err:
        if done or err.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    return done


class NodeDisks:
    """A node's disk as the memory tier's durable tier: its parts of persisted checkpoints, and their upload.

    Args:
        tier: The memory tier.
        base: This node's durable local directory (a local ``dirpath``, or ``local_dir``).
        remote: The remote directory the checkpoints are uploaded to; ``None`` for a local ``dirpath``.
        keep: Checkpoints persisted by this run that the disk (and the remote directory) keeps; ``0`` keeps all.
    """

    def __init__(self, tier: MemoryTier, base: str, *, remote: Location | None, keep: int) -> None:
        self.tier, self.base, self.remote, self.keep = tier, base, remote, keep
        self.store = PartStore(parts_root(base), sync=True)
        self.persisted: list[tuple[str, tuple]] = []
        """``(name, identity)`` of the checkpoints this run persisted and the disk keeps, oldest first."""
        self.unuploaded: dict[str, tuple[bytes, bytes]] = {}
        """Checkpoints committed on the disks but not remotely yet: ``name -> (.metadata, .commit)``, oldest first."""
        self.uploaded: list[str] = []
        """Checkpoints this run committed remotely and that stay there, oldest first (rank 0)."""
        self.upload_error: str | None = None
        """Why the last upload failed (``None`` once one succeeds)."""
        self._cleaned = False

    # ------------------------------------------------------------------------------------------------- persist
    def persist(self, saved: Saved) -> None:
        """Commit every part of ``saved`` this node's memory area holds on its disk, then upload. Collective.

        Raises:
            CheckpointError: Copying or committing failed on some node (every rank raises); what was written of
                ``saved`` on that node stays uncommitted (a staging directory) and is removed.
        """
        topology = self.tier.topology
        where = self.store.root

        def plan() -> tuple[str, list[tuple[int, str, list[str]]]]:
            if not self._cleaned:
                self.store.remove_stale()  # of a persist killed in an earlier run
            token = new_token()
            held = [p for p in self.tier.store.parts() if p.name == saved.name and p.identity == saved.identity]
            for part in held:
                os.makedirs(self.store.staging(part.name, part.node, token))
            return token, [(p.node, p.path, p.files) for p in held]

        token, held = self._from_leader(plan, failing=where)
        self._cleaned = True
        stagings = {j: self.store.staging(saved.name, j, token) for j, _, _ in held}
        copies = [(j, os.path.join(path, f), f) for j, path, files in held for f in sorted(files)]
        mine = copies[topology.local_rank :: len(topology.ranks[topology.node])]

        def copy() -> None:
            for j, src, name in mine:
                with open(os.path.join(stagings[j], name), "wb") as out:
                    copy_file(src, out, saved.files[name], sync=True)

        def commit() -> None:
            if topology.leader:
                for j, _, files in held:
                    self.store.commit(
                        stagings[j],
                        name=saved.name,
                        node=j,
                        nodes=topology.nodes,
                        files=files,
                        metadata=saved.metadata,
                        marker=saved.marker,
                    )

        try:
            everywhere(self.tier, copy, failure=f"Persisting to {where!r} failed")
            everywhere(self.tier, commit, failure=f"Persisting to {where!r} failed")
        except CheckpointError:
            if topology.leader:
                for staging in stagings.values():
                    remove_path(staging)
            raise
        self.persisted = [e for e in self.persisted if e[0] != saved.name] + [(saved.name, saved.identity)]
        self._prune()
        if self.remote is not None:
            self.unuploaded.pop(saved.name, None)
            self.unuploaded[saved.name] = (saved.metadata, saved.marker)
            for name, (metadata, marker) in list(self.unuploaded.items()):  # the ones that failed before first
                if self._upload(name, metadata, marker):
                    del self.unuploaded[name]

    def _prune(self) -> None:
        """Remove the parts of the checkpoints persisted by this run beyond the newest ``keep`` (leaders)."""
        while self.keep > 0 and len(self.persisted) > self.keep:
            name, ident = self.persisted.pop(0)
            self.unuploaded.pop(name, None)
            if self.tier.topology.leader:
                for part in self.store.parts():
                    if part.name == name and part.identity == ident:
                        self.store.uncommit(part.path)
                        remove_path(part.path)

    # -------------------------------------------------------------------------------------------------- upload
    def _upload(self, name: str, metadata: bytes, marker: bytes) -> bool:
        """Upload the checkpoint ``name`` from the disks; ``False`` (with a warning on rank 0) when it failed."""
        topology, remote = self.tier.topology, self.remote.child(name)
        parsed = parse_commit(marker)

        def start() -> str | None:
            target = begin(remote, parsed)
            return None if target is None else target.url

        error, url = None, None
        if topology.rank == 0:
            try:
                url = start()
            except Exception as err:
                error = f"{type(err).__name__}: {err}"
        error, url = self.tier.broadcast((error, url))
        if error is None and url is None:
            return self._uploaded(name)  # committed there already
        if error is None:
            target = remote.at(url)
            failed = [e for e in self.tier.gather(self._put_own(target, name, parsed)) if e is not None]
            error = "; ".join(failed) or None
            if topology.rank == 0:
                if error is None:
                    try:
                        with target.open(METADATA_FILE, "wb") as f:
                            f.write(metadata)
                        finish(target, remote, marker, parsed)
                    except Exception as err:
                        error = f"{type(err).__name__}: {err}"
                if error is not None:
                    abandon(target, remote)
            error = self.tier.broadcast(error)
        if error is None:
            return self._uploaded(name)
        self.upload_error = error
        if topology.rank == 0:
            log.warning(
                "lightning_dcp: uploading the persisted checkpoint %r to %s failed (%s); it stays committed on the"
                " node-local disks, and the upload is retried at the next persist.",
                name,
                remote.url,
                error,
            )
        return False

    def _put_own(self, target: Location, name: str, parsed: dict[str, Any]) -> str | None:
        """Put this node's own part of ``name`` from its disk to ``target`` (leader); the error, if any."""
        topology = self.tier.topology
        if not topology.leader:
            return None
        try:
            part = self.store.read(part_name(name, topology.node))
            if part is None or part.identity != identity(parsed):
                raise CheckpointError(f"{self.store.root} holds no committed part {part_name(name, topology.node)}.")
            if part.files:
                target.put({f: os.path.join(part.path, f) for f in part.files})
        except Exception as err:
            return f"node {topology.node}: {type(err).__name__}: {err}"
        return None

    def _uploaded(self, name: str) -> bool:
        """Record the upload of ``name``; rank 0 removes what this run uploaded beyond the newest ``keep``."""
        self.upload_error = None
        if self.tier.topology.rank == 0:
            self.uploaded = [n for n in self.uploaded if n != name] + [name]
            while self.keep > 0 and len(self.uploaded) > self.keep:
                old = self.remote.child(self.uploaded.pop(0))
                try:
                    remove_committed(old)
                except Exception as err:
                    log.warning("lightning_dcp: removing %s failed (%s); it stays.", old.url, err)
        return True

    def _from_leader(self, fn: Callable[[], Any], *, failing: str) -> Any:
        """Run ``fn`` on each node's leader; its answer on every rank of its node. Raises everywhere if one failed."""
        topology = self.tier.topology
        outcome = None
        if topology.leader:
            try:
                outcome = (True, fn())
            except Exception as err:
                outcome = (False, f"node {topology.node}: {type(err).__name__}: {err}")
        answers = self.tier.gather(outcome)
        failed = [a[1] for a in answers if a is not None and not a[0]]
        if failed:
            raise CheckpointError(f"Persisting to {failing!r} failed: {'; '.join(failed)}")
        return answers[topology.ranks[topology.node][0]][1]
