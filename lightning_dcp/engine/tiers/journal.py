"""The local tier's journal: what the uploader still owes the remote store, kept in ``local_dir`` across kills.

Uploads need no journal: every committed local checkpoint whose remote copy is not the same checkpoint is uploaded
again by the next run. What the local directory cannot tell is journaled here, by rank 0's tier, before it is acted
on: removals (top-k pruning) and pointer writes (``save_last="link"``), and what the remote store is known to hold
(so that the training loop never has to ask it). One JSON object per line, appended and fsynced; the file is
rewritten compactly (temporary file, fsync, rename) when a run opens it and after every 512 records.

Records:

- ``{"op": "remove", "seq": n, "name": X, "version": V, "after": [{"name": S, "version": W}]}``: delete ``X`` from
  both tiers. ``V`` identifies the local copy asked to go (``{"committed_at", "metadata"}`` of its ``.commit``, or
  ``null``): a later save under the same name is never removed. ``after`` (``null`` when the request did not wait)
  names the saves in flight when it was asked for: it applies only once they are committed (``W`` was their
  version before), as without a tier, where the removal follows the save.
- ``{"op": "link", "seq": n, "name": P, "target": T}``: make the remote pointer ``P`` designate ``T``.
- ``{"op": "release", "seq": n}``: the saves that removal waited for are committed. ``{"op": "done", "seq": n}``:
  carried out (or dropped: its save failed, its target never arrived).
- ``{"op": "remote", "name": X, "order": K}``: the remote store holds ``X`` committed with order key ``K`` (``null``:
  no longer). ``{"op": "pointer", "name": P, "target": T}`` likewise for pointers. ``{"op": "listing", "remote": {...},
  "pointers": {...}}``: what a full listing of the remote directory showed (replaces both).

A line cut short by a kill, or any record that is not one of these (names must be plain names inside the
directory), is skipped with a warning: the journal is read as untrusted input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from typing import Any

from lightning_dcp.engine.format.marker import is_plain_name
from lightning_dcp.engine.storage.localfs import replace_file
from lightning_dcp.engine.storage.names import STAGING_INFIX, is_staging_of

__all__ = ["JOURNAL_FILE", "Intent", "TierJournal", "version_of"]

log = logging.getLogger(__name__)

JOURNAL_FILE = ".lightning_dcp-tier-journal"
"""In ``local_dir``: the tier's journal (JSON lines)."""
_COMPACT_AFTER = 512


def version_of(marker: dict[str, Any] | None) -> dict[str, Any] | None:
    """What identifies one committed version of a checkpoint in the journal: its commit time and ``.metadata``."""
    return None if marker is None else {"committed_at": marker["committed_at"], "metadata": marker["metadata"]}


@dataclasses.dataclass
class Intent:
    """A removal or a pointer write the uploader has not carried out yet."""

    seq: int
    op: str  # "remove" or "link"
    name: str
    version: dict[str, Any] | None = None
    after: list[dict[str, Any]] | None = None
    target: str = ""


class TierJournal:
    """The journal file of one local tier, and the state it describes. Rank 0 only; thread-safe.

    Args:
        directory: The local tier's directory (created at the first record).
    """

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, JOURNAL_FILE)
        self.intents: dict[int, Intent] = {}
        """Pending removals and pointer writes, by sequence number (ascending: the order they were asked for)."""
        self.remote: dict[str, tuple] = {}
        """Committed checkpoints the remote directory is known to hold: name -> order key."""
        self.pointers: dict[str, str] = {}
        """Pointers the remote directory is known to hold: name -> the name it designates."""
        self.listed = False
        """Whether ``remote`` and ``pointers`` come from a full listing (in this run or an earlier one)."""
        self.skipped = 0
        """Records that :meth:`open` skipped as unreadable (cut short by a kill, or not written by lightning_dcp)."""
        self._lock = threading.RLock()
        self._seq = 0
        self._appended = 0
        self._opened = False

    def open(self) -> None:
        """Read the journal (once): apply every valid record, then rewrite it compactly."""
        with self._lock:
            if self._opened:
                return
            self._opened = True
            directory, journal = os.path.split(self.path)
            for name in os.listdir(directory) if os.path.isdir(directory) else ():
                # a compaction cut short by a kill: replace_file's temporary, or an older version's (journal.tmp-...)
                if is_staging_of(name, journal) or name.startswith(f"{journal}{STAGING_INFIX}"):
                    with contextlib.suppress(IsADirectoryError, FileNotFoundError):
                        os.unlink(os.path.join(directory, name))
            try:
                with open(self.path, "rb") as f:
                    lines = f.read().splitlines()
            except FileNotFoundError:
                return
            for line in lines:
                try:
                    record = json.loads(line)
                    self._apply(record)
                except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
                    self.skipped += 1
            if self.skipped:
                log.warning(
                    "lightning_dcp: skipped %d unreadable record(s) of the tier journal %s", self.skipped, self.path
                )
            self._compact()

    # ------------------------------------------------------------------------------------------------ records
    def add_removal(self, name: str, version: dict | None, after: list[dict[str, Any]] | None) -> Intent:
        """Journal a removal of ``name`` (see the module docstring) and return it."""
        return self._add({"op": "remove", "name": name, "version": version, "after": after})

    def add_link(self, name: str, target: str) -> Intent:
        """Journal a pointer write ``name`` -> ``target`` and return it."""
        return self._add({"op": "link", "name": name, "target": target})

    def release(self, seq: int) -> None:
        """The saves the removal ``seq`` waited for are committed."""
        self._write({"op": "release", "seq": seq})

    def done(self, seq: int | None) -> None:
        """The intent ``seq`` is carried out or dropped."""
        if seq is not None and seq in self.intents:
            self._write({"op": "done", "seq": seq})

    def saw_remote(self, name: str, order: tuple | None) -> None:
        """The remote store now holds ``name`` committed with ``order`` (``None``: it no longer holds it)."""
        self._write({"op": "remote", "name": name, "order": None if order is None else list(order)})

    def saw_pointer(self, name: str, target: str | None) -> None:
        """The remote pointer ``name`` now designates ``target`` (``None``: it is gone)."""
        self._write({"op": "pointer", "name": name, "target": target})

    def saw_listing(self, remote: dict[str, tuple], pointers: dict[str, str] | None = None) -> None:
        """A full listing of the remote directory: its committed checkpoints (and pointers, when read)."""
        record = {"op": "listing", "remote": {n: list(k) for n, k in remote.items()}}
        record["pointers"] = dict(self.pointers if pointers is None else pointers)
        self._write(record)

    def pending(self) -> list[Intent]:
        """Pending intents, in the order they were asked for."""
        with self._lock:
            return [self.intents[seq] for seq in sorted(self.intents)]

    # ------------------------------------------------------------------------------------------------- files
    def _add(self, record: dict[str, Any]) -> Intent:
        with self._lock:
            self.open()
            self._seq += 1
            self._write({"seq": self._seq, **record})
            return self.intents[self._seq]

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.open()
            self._apply(record)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, json.dumps(record, sort_keys=True).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            self._appended += 1
            if self._appended >= _COMPACT_AFTER:
                self._compact()

    def _compact(self) -> None:
        """Rewrite the journal as the records of the current state (one listing, the pending intents)."""
        records = [
            {
                "op": "listing",
                "remote": {n: list(k) for n, k in self.remote.items()},
                "pointers": dict(self.pointers),
                "listed": self.listed,
            }
        ]
        for intent in self.pending():
            fields = {"name": intent.name}
            if intent.op == "remove":
                fields.update(version=intent.version, after=intent.after)
            else:
                fields["target"] = intent.target
            records.append({"seq": intent.seq, "op": intent.op, **fields})
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        replace_file(self.path, b"".join(json.dumps(r, sort_keys=True).encode() + b"\n" for r in records))
        self._appended = 0

    # ------------------------------------------------------------------------------------------------ replay
    def _apply(self, record: Any) -> None:
        """Update the state with one record; ``ValueError`` (and friends) for anything malformed."""
        op = record["op"]
        if op in ("remove", "link"):
            seq, name = record["seq"], _name(record["name"])
            if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
                raise ValueError("seq")
            if op == "remove":
                after = record.get("after")
                if after is not None:
                    after = [{"name": _name(a["name"]), "version": _version(a["version"])} for a in after]
                intent = Intent(seq, op, name, version=_version(record.get("version")), after=after)
            else:
                intent = Intent(seq, op, name, target=_name(record["target"]))
            self.intents[seq] = intent
            self._seq = max(self._seq, seq)
        elif op in ("release", "done"):
            intent = self.intents.get(record["seq"])
            if intent is not None and op == "release":
                intent.after = None
            elif intent is not None:
                del self.intents[intent.seq]
        elif op == "remote":
            name, order = _name(record["name"]), record["order"]
            if order is None:
                self.remote.pop(name, None)
            else:
                self.remote[name] = _order(order)
        elif op == "pointer":
            name, target = _name(record["name"]), record["target"]
            if target is None:
                self.pointers.pop(name, None)
            else:
                self.pointers[name] = _name(target)
        elif op == "listing":
            self.remote = {_name(n): _order(k) for n, k in record["remote"].items()}
            self.pointers = {_name(n): _name(t) for n, t in record["pointers"].items()}
            self.listed = bool(record.get("listed", True))
        else:
            raise ValueError(f"unknown op {op!r}")


def _name(value: Any) -> str:
    if not is_plain_name(value):
        raise ValueError(f"not a plain name: {value!r}")
    return value


def _order(value: Any) -> tuple:
    if not (isinstance(value, list) and len(value) == 3 and all(isinstance(v, (int, float)) for v in value)):
        raise ValueError(f"not an order key: {value!r}")
    return tuple(value)


def _version(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    metadata = value["metadata"]
    if not isinstance(value["committed_at"], (int, float)) or not isinstance(metadata, dict):
        raise ValueError("version")
    return {"committed_at": value["committed_at"], "metadata": metadata}
