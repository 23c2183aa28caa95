"""Sync saves copy each record's tensor to the host one record ahead of the writer (the GPU path's order logic).

On a GPU :class:`CudaCopier` makes the copies on a side stream; here :class:`ThreadCopier` makes them in threads, so
the same :class:`CopyAhead` runs through the real writer into real files.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from lightning_dcp.engine.save.copy_ahead import CopyAhead, ThreadCopier, copy_ahead
from lightning_dcp.engine.save.datafiles import FileJob, write_local


def _job() -> tuple[FileJob, dict]:
    data = {
        "blob": io.BytesIO(b"x" * 100),
        "a": torch.randn(512, 1024),  # large: written directly, piece by piece
        "small": torch.arange(10.0),  # small: framed in the output's buffer
        "b": torch.randn(300, 700, dtype=torch.float64),
        "strided": torch.randn(64, 128).t(),  # not contiguous
    }
    items = [
        WriteItem(
            index=MetadataIndex(name, [0]), type=WriteItemType.BYTE_IO if name == "blob" else WriteItemType.TENSOR
        )
        for name in data
    ]
    return FileJob("__0_0.distcp", items), data


def test_copies_run_one_record_ahead_and_every_record_is_byte_identical(tmp_path):
    job, data = _job()
    resolved: list[str] = []

    def resolve(item):
        resolved.append(item.index.fqn)
        value = data[item.index.fqn]
        if isinstance(value, io.BytesIO):
            value.seek(0)
        return value

    plain = write_local(str(tmp_path / "plain"), job, resolve, sync=True)
    resolved.clear()
    copier = ThreadCopier()
    ahead = write_local(str(tmp_path / "ahead"), job, CopyAhead(job.items, resolve, copier), sync=True)
    # The same records (padding before a direct-I/O record depends on the source's address, so offsets may differ).
    before, after = (tmp_path / "plain").read_bytes(), (tmp_path / "ahead").read_bytes()
    assert [(r.item.index.fqn, r.length, r.digest) for r in plain] == [
        (r.item.index.fqn, r.length, r.digest) for r in ahead
    ]
    for p, a in zip(plain, ahead, strict=True):
        assert before[p.offset : p.offset + p.length] == after[a.offset : a.offset + a.length]
    assert resolved == [item.index.fqn for item in job.items]  # each item resolved once, in the writer's order
    # Every tensor was copied, in order, never the blob; the copy of a record started before the previous was returned.
    tensors = [name for name in data if name != "blob"]
    assert copier.started == [data[name].data_ptr() for name in tensors]


def test_without_cuda_the_writer_resolves_as_before():
    job, data = _job()

    def resolve(item):
        return data[item.index.fqn]

    assert copy_ahead(job.items, resolve) is resolve or torch.cuda.is_available()
