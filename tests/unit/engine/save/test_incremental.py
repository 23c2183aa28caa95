"""Incremental saves at the engine level: own-file placement and names, links of unchanged records, probing."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from lightning_dcp import verify_checkpoint
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.format.marker import is_plain_name
from lightning_dcp.engine.save.datafiles import assign_files
from lightning_dcp.engine.save.incremental import Incremental, own_file_name

MIB = 1 << 20
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _item(fqn: str, rows: int, offset: int = 0, cols: int = 256) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size([offset, 0]), sizes=torch.Size([rows, cols]))
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size([offset, 0])),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=chunk.sizes),
    )


def test_own_file_names_are_stable_plain_and_distinct():
    a, a_again = _item("model.embed.weight", 1024), _item("model.embed.weight", 1024)
    names = {own_file_name(i) for i in (a, _item("model.embed.weight", 1024, offset=1024), _item("model.head", 1024))}
    assert own_file_name(a) == own_file_name(a_again)
    assert len(names) == 3
    assert all(is_plain_name(n) and n.startswith("__r_") and n.endswith(".distcp") for n in names)
    assert own_file_name(_item("a/b\\c", 4)).count("/") == 0


def test_assign_files_gives_large_records_their_own_files():
    big = [_item("big.a", 1024), _item("big.b", 2048)]  # 1 MiB and 2 MiB of float32
    small = [_item(f"small.{i}", 4) for i in range(5)]
    save = Incremental(min_bytes=MIB)
    writer = type("W", (), {})()
    save.attach(writer, previous=None, local=True)
    jobs = assign_files([*small, *big], prefix="__0_", files=2, suffix=".distcp", own_file=writer.incremental.own_file)
    own = {job.name: [i.index.fqn for i in job.items] for job in jobs if job.name.startswith("__r_")}
    assert sorted(own.values()) == [["big.a"], ["big.b"]]
    assert own_file_name(big[0]) in own
    shared = sorted(i.index.fqn for job in jobs if job.name.startswith("__0_") for i in job.items)
    assert shared == [f"small.{i}" for i in range(5)]
    plain = assign_files([*small, *big], prefix="__0_", files=2, suffix=".distcp")
    assert [job.name for job in plain] == ["__0_0.distcp", "__0_1.distcp"]


def _tree(frozen: torch.Tensor, head: torch.Tensor, small: torch.Tensor) -> dict:
    return {"state_dict": {"frozen": frozen, "head": head, "small": small}}


def _load(path: str) -> dict:
    """Stock ``dcp.load`` (no lightning_dcp reader), and lightning_dcp's verifying loader: both must agree."""
    target = _tree(torch.zeros(MIB // 4), torch.zeros(MIB // 2), torch.zeros(10))
    dcp.load(target, checkpoint_id=path, no_dist=True)
    ours = _tree(torch.zeros(MIB // 4), torch.zeros(MIB // 2), torch.zeros(10))
    Checkpointer().load(path, target=ours)
    assert all(torch.equal(target["state_dict"][k], v) for k, v in ours["state_dict"].items())
    return target["state_dict"]


def _files(path: str) -> dict[str, os.stat_result]:
    return {name: os.stat(os.path.join(path, name)) for name in os.listdir(path) if name.startswith("__r_")}


def test_unchanged_records_are_linked_and_every_checkpoint_stands_alone(tmp_path):
    frozen, head, small = torch.randn(MIB // 4), torch.randn(MIB // 2), torch.randn(10)
    checkpointer = Checkpointer(CheckpointerConfig(incremental=True))
    checkpointer.incremental.probe_every = 1  # compare at every save (the default skips records seen changing)
    saved = []
    for step in range(4):
        head.add_(1.0)
        small.add_(1.0)
        if step == 2:  # one byte of the "frozen" tensor changes: it must be written, never linked
            frozen.view(torch.uint8)[-1] ^= 1
        path = str(tmp_path / f"step{step}")
        checkpointer.save(_tree(frozen, head, small), path, objects={})
        saved.append((path, frozen.clone(), head.clone(), small.clone()))
    stats = checkpointer.incremental.stats
    assert (stats.linked_files, stats.linked_bytes > MIB) == (1, True)  # step 3 links step 2's frozen file
    inodes = [{n: s.st_ino for n, s in _files(p).items()} for p, *_ in saved]
    sizes = _files(saved[0][0])
    frozen_name, head_name = sorted(sizes, key=lambda n: sizes[n].st_size)  # 1 MiB frozen, 2 MiB head
    assert inodes[0][frozen_name] == inodes[1][frozen_name] != inodes[2][frozen_name] == inodes[3][frozen_name]
    assert len({ino[head_name] for ino in inodes}) == 4  # the changing record is written every time
    assert os.stat(os.path.join(saved[1][0], frozen_name)).st_nlink == 2
    # Remove checkpoints in a shuffled order: the others keep loading exactly what was saved.
    for gone in (1, 3, 0):
        shutil.rmtree(saved[gone][0])
        for path, f, h, s in saved:
            if os.path.isdir(path):
                verify_checkpoint(path)
                loaded = _load(path)
                assert torch.equal(loaded["frozen"], f) and torch.equal(loaded["head"], h)
                assert torch.equal(loaded["small"], s)


def test_a_previous_file_with_other_bytes_is_never_linked(tmp_path):
    frozen, head, small = torch.randn(MIB // 4), torch.randn(MIB // 2), torch.randn(10)
    checkpointer = Checkpointer(CheckpointerConfig(incremental=True))
    first = str(tmp_path / "a")
    checkpointer.save(_tree(frozen, head, small), first, objects={})
    # Damage the first checkpoint's frozen file in its last byte: equal checksums can no longer be trusted alone.
    sizes = _files(first)
    frozen_name, head_name = sorted(sizes, key=lambda n: sizes[n].st_size)
    with open(os.path.join(first, frozen_name), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    second = str(tmp_path / "b")
    checkpointer.save(_tree(frozen, head, small), second, objects={})
    stats = checkpointer.incremental.stats
    assert (stats.linked_files, stats.written_files) == (1, 2)  # head linked; frozen and the shared file written
    after = _files(second)
    assert after[frozen_name].st_nlink == 1 and after[frozen_name].st_ino != sizes[frozen_name].st_ino
    assert after[head_name].st_ino == sizes[head_name].st_ino
    verify_checkpoint(second)
    loaded = _load(second)
    assert torch.equal(loaded["frozen"], frozen) and torch.equal(loaded["head"], head)


def test_changed_records_are_probed_every_n_saves(tmp_path):
    checkpointer = Checkpointer(CheckpointerConfig(incremental=True))
    checkpointer.incremental.probe_every = 3
    frozen, head, small = torch.randn(MIB // 4), torch.randn(MIB // 2), torch.randn(10)
    seen = []
    for step in range(6):
        head.add_(1.0)
        checkpointer.save(_tree(frozen, head, small), str(tmp_path / f"s{step}"))
        stats = checkpointer.incremental.stats
        seen.append((stats.linked_files, stats.skipped, stats.ruled_out, stats.compared_bytes))
    # save 0: nothing to compare; 1: head compared (changed); 2-3: head skipped; 4: compared; 5: skipped. A changed
    # head is ruled out from its first bytes: only the frozen tensor's file (1 MiB and its header) is read.
    frozen_record = seen[1][3]
    assert MIB < frozen_record < MIB + 4096
    expected = [(0, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 0), (1, 0, 1), (1, 1, 0)]
    assert [s[:3] for s in seen] == expected and all(s[3] == frozen_record for s in seen[1:])
    # A skipped record goes to the shared file, except at the save before its comparison (its own file again).
    head_files = []
    for step in range(6):
        metadata = dcp.FileSystemReader(str(tmp_path / f"s{step}")).read_metadata()
        head_files.append(next(i.relative_path for k, i in metadata.storage_data.items() if k.fqn.endswith("head")))
    assert [name.startswith("__r_") for name in head_files] == [True, True, False, True, True, False]


def test_incremental_options_are_checked():
    with pytest.raises(ValueError, match="probe_every"):
        Incremental(probe_every=0)
