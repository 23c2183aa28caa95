"""Build crafted checkpoints for the hostile-input tests: content of our choosing, checksums consistent.

A crafted checkpoint is one whose ``.commit`` agrees with its files, so the checksums cannot catch it: only the
readers' validation can. :func:`write_committed` saves any state dict through lightning_dcp's own DCP writer (which
commits it); :func:`recommit` rewrites ``.commit`` to match files that were edited afterwards.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.format.marker import COMMIT_FILE, METADATA_FILE, SEAL_KEY, checksum, encode_commit, seal
from lightning_dcp.engine.save.dcp_io import storage_writer
from lightning_dcp.engine.storage.location import Location


def write_committed(path: str, state: dict[str, Any]) -> None:
    """``dcp.save`` ``state`` to ``path`` with lightning_dcp's writer: a committed checkpoint holding exactly it.

    It is the newest of its directory, as a real save would make it (one more than the largest save counter there).
    """
    location = Location(path)
    writer = storage_writer(location, thread_count=1, sync_files=False)
    seen = [key[0] for key, _ in committed_checkpoints(location.parent())]
    writer.order = {"counter": max(seen, default=0) + 1, "step": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)


def recommit(path: str) -> None:
    """Rewrite ``path/.commit`` so that it matches the directory's current ``.metadata`` and data records."""
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        metadata_bytes = f.read()
    metadata = pickle.loads(metadata_bytes)  # our own test file: plain pickle is fine here
    files: dict[str, dict[str, Any]] = {}
    for info in metadata.storage_data.values():
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        entry = files.setdefault(info.relative_path, {"size": 0, "records": []})
        entry["records"].append([info.offset, info.length, checksum(data)])
        entry["size"] = max(entry["size"], os.path.getsize(os.path.join(path, info.relative_path)))
    order = None
    if os.path.isfile(os.path.join(path, COMMIT_FILE)):
        with open(os.path.join(path, COMMIT_FILE), "rb") as f:
            order = json.loads(f.read()).get("order")
    with open(os.path.join(path, COMMIT_FILE), "wb") as f:
        f.write(encode_commit(metadata_bytes=metadata_bytes, files=files, order=order))


def edit_commit(path: str, edit) -> None:
    """Apply ``edit(marker_dict)`` to ``path/.commit`` (whatever it returns is written back, sealed: :func:`sealed`)."""
    with open(os.path.join(path, COMMIT_FILE)) as f:
        marker = json.load(f)
    write_commit(path, edit(marker))


def sealed(marker: Any) -> bytes:
    """``marker`` as ``.commit`` bytes whose own checksum matches them, as the writer seals a marker.

    Anything but a non-empty JSON object is written as plain JSON (there is nothing to seal).
    """
    if not isinstance(marker, dict) or not marker:
        return json.dumps(marker).encode()
    return seal(json.dumps({k: v for k, v in marker.items() if k != SEAL_KEY}, sort_keys=True).encode())


def write_commit(path: str, marker: Any) -> None:
    """Write ``marker`` to ``path/.commit``, sealed (:func:`sealed`): only the readers' checks can refuse it."""
    with open(os.path.join(path, COMMIT_FILE), "wb") as f:
        f.write(sealed(marker))


def torch_bytes(obj: Any) -> bytes:
    """``torch.save(obj)`` as bytes, with no validation (unlike lightning_dcp's own blob encoder)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rewrite_metadata(path: str, mutate) -> None:
    """Rewrite ``path/.metadata`` with ``mutate(metadata)`` applied, and make ``.commit`` vouch for its new bytes
    (the data records it lists stay as they were)."""
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        metadata = pickle.load(f)  # our own test file: plain pickle is fine here
    mutate(metadata)
    crafted = pickle.dumps(metadata)
    with open(os.path.join(path, METADATA_FILE), "wb") as f:
        f.write(crafted)
    edit_commit(path, lambda m: {**m, "metadata": {"size": len(crafted), "checksum": checksum(crafted)}})


def replace_record(path: str, fqn: str, record: bytes) -> str:
    """Append ``record`` to the data file of ``fqn``'s record, point the metadata at it, recommit everything.

    Returns the data file's name.
    """
    with open(os.path.join(path, METADATA_FILE), "rb") as f:
        name = next(i.relative_path for k, i in pickle.load(f).storage_data.items() if k.fqn == fqn)
    with open(os.path.join(path, name), "ab") as f:
        offset = f.tell()
        f.write(record)

    def point(metadata) -> None:
        for index, stored in metadata.storage_data.items():
            if index.fqn == fqn:
                metadata.storage_data[index] = type(stored)(stored.relative_path, offset, len(record))

    rewrite_metadata(path, point)
    recommit(path)
    return name
