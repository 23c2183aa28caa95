"""The copy that persists a memory-tier part: by the kernel into a local file, in chunks into any other file object."""

from __future__ import annotations

import io
import os

import pytest

from lightning_dcp.engine.tiers.node_disks import copy_file
from lightning_dcp.errors import CorruptCheckpointError


@pytest.fixture
def source(tmp_path):
    data = os.urandom(3 << 20) + b"tail"  # longer than the recorded size: only that much is copied
    path = tmp_path / "src"
    path.write_bytes(data)
    return str(path), data


def test_local_file_gets_the_recorded_bytes_fsynced(source, tmp_path):
    path, data = source
    with open(tmp_path / "dst", "wb") as out:
        copy_file(path, out, len(data) - 4, sync=True)
        out.write(b"!")  # the file position follows the kernel's copy
    assert (tmp_path / "dst").read_bytes() == data[:-4] + b"!"


def test_a_file_object_without_descriptor_gets_chunks(source):
    path, data = source
    out = io.BytesIO()  # as an fsspec remote file: no fileno()
    copy_file(path, out, len(data) - 4, sync=False)
    assert out.getvalue() == data[:-4]


@pytest.mark.parametrize("local", [True, False])
def test_a_short_source_is_refused(source, tmp_path, local):
    path, data = source
    with open(tmp_path / "dst", "wb") if local else io.BytesIO() as out, pytest.raises(CorruptCheckpointError):
        copy_file(path, out, len(data) + 1, sync=False)
