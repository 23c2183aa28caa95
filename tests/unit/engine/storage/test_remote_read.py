"""Object-store reads: concurrent ranged requests in order, a bounded window, records verified as they stream in."""

from __future__ import annotations

import threading

import fsspec
import pytest
import torch

from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.storage import remote_read
from lightning_dcp.engine.storage.remote_read import Range, RangedReads
from lightning_dcp.errors import CorruptCheckpointError


def test_ranges_come_back_in_order_with_a_bounded_window():
    data = bytes(range(256)) * 64
    lock = threading.Lock()
    fetched, outstanding, peak = [], [0], [0]

    def fetch(path: str, start: int, end: int) -> bytes:
        with lock:
            outstanding[0] += end - start
            peak[0] = max(peak[0], outstanding[0])
            fetched.append(start)
        return data[start:end]

    reads = RangedReads(fetch, workers=4, window=3000)
    ranges = [Range("x", s, min(s + 1000, len(data))) for s in range(0, len(data), 1000)]
    for piece, chunk in reads(ranges):
        assert chunk == data[piece.start : piece.end]
        with lock:
            outstanding[0] -= piece.nbytes
    assert sorted(fetched) == [r.start for r in ranges]
    assert peak[0] <= 3000  # never more than the window fetched ahead of the consumer


def test_memory_store_checkpoint_streams_into_targets_and_catches_damage(monkeypatch):
    monkeypatch.setattr(remote_read, "CHUNK", 1 << 16)  # a 1 MB record arrives in 16 ranges
    torch.manual_seed(0)
    tree = {"state_dict": {f"w{i}": torch.randn(30, 30) for i in range(40)}, "big": {"x": torch.randn(512, 512)}}
    url = "memory://remote-read/ckpt"
    checkpointer = Checkpointer()
    checkpointer.save(tree, url, objects={"step": 3})
    target = {key: {name: torch.zeros_like(t) for name, t in part.items()} for key, part in tree.items()}
    loaded = checkpointer.load(url, target=target)
    assert loaded.objects["step"] == 3
    for key, part in tree.items():
        for name, value in part.items():
            assert torch.equal(target[key][name], value), (key, name)
    fs = fsspec.filesystem("memory")
    (data_file,) = [f for f in fs.ls("/remote-read/ckpt", detail=False) if f.endswith(".distcp")]
    original = fs.cat_file(data_file)
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x10  # inside the large record
    fs.pipe_file(data_file, bytes(damaged))
    with pytest.raises(CorruptCheckpointError, match="does not match the checksum"):
        checkpointer.load(url, target=target)
    fs.pipe_file(data_file, original[: len(original) - 100])  # truncated
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        checkpointer.load(url, target=target)
    fs.rm("/remote-read", recursive=True)
