"""Records written straight from tensor memory: torch.save's format, readable by every DCP reader, verified on read."""

from __future__ import annotations

import io
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from lightning_dcp import CorruptCheckpointError
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.format.records import raw_bytes, tensor_record
from lightning_dcp.engine.save import saving
from lightning_dcp.engine.save.dcp_io import storage_writer
from lightning_dcp.engine.save.planning import BalancedSavePlanner, balanced_dedup
from lightning_dcp.engine.storage.fileout import DIRECT_MIN
from lightning_dcp.engine.storage.location import Location

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))), "data")

CASES = [
    torch.randn(3, 4),
    torch.randn(()),
    torch.zeros(0, 5),
    torch.zeros(5, 0),
    torch.randn(7).to(torch.bfloat16),
    torch.tensor([True, False]),
    torch.randn(2, 2, dtype=torch.complex64),
    torch.randn(4).to(torch.float8_e4m3fn),
    torch.arange(5, dtype=torch.int32).to(torch.uint16),
    torch.arange(6).reshape(1, 2, 3),
]


def _torch_save_pickle(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return bytes(torch._C.PyTorchFileReader(io.BytesIO(buffer.getvalue())).get_record("data.pkl"))


@pytest.mark.parametrize("tensor", CASES, ids=lambda t: f"{t.dtype}{tuple(t.shape)}")
def test_record_is_what_torch_save_writes_and_torch_load_reads(tensor):
    layout = tensor_record(tensor.dtype, tuple(tensor.shape))
    record = layout.prefix + bytes(raw_bytes(tensor)) + layout.suffix
    assert len(record) == layout.length and layout.data_offset % 64 == 0
    reader = torch._C.PyTorchFileReader(io.BytesIO(record))
    assert bytes(reader.get_record("data.pkl")) == _torch_save_pickle(tensor)
    assert reader.get_record_offset("data/0") == layout.data_offset
    loaded = torch.load(io.BytesIO(record), weights_only=True)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
    assert bytes(raw_bytes(loaded)) == bytes(raw_bytes(tensor))


def test_records_past_4_gib_use_zip64(tmp_path):
    size = (1 << 32) + 100
    layout = tensor_record(torch.uint8, (size,))
    path = tmp_path / "big"
    with open(path, "wb") as f:  # sparse: the raw bytes are a hole
        f.write(layout.prefix)
        f.seek(layout.data_offset + size)
        f.write(layout.suffix)
    with open(path, "rb") as f:
        reader = torch._C.PyTorchFileReader(f)
        assert reader.get_record_offset("data/0") == layout.data_offset
        assert b"_rebuild_tensor_v2" in bytes(reader.get_record("data.pkl"))


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 1000, generator=g)
    return {
        "big": big,  # 1.2 MB: split into row chunks, sent with direct I/O
        "view": torch.randn(2 * DIRECT_MIN, generator=g)[17:],  # a view at an odd address: only its own elements
        "columns": torch.randn(400, 300, generator=g).t(),  # not contiguous: copied first
        "half": torch.randn(513, 257, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "small": torch.arange(10),
    }


def _save_chunked(path: str, state: dict) -> None:
    writer = storage_writer(Location(path), thread_count=2, sync_files=True)
    saving.save(
        layout.build_state({"state_dict": state}, objects={}, info={}),
        writer=writer,
        planner=BalancedSavePlanner(split=True, chunk_bytes=1 << 18),
        distributed=False,
    )


def test_chunked_direct_io_checkpoint_reads_with_every_reader(tmp_path):
    state, path = _state(), str(tmp_path / "c.ckpt")
    _save_chunked(path, state)
    metadata = FileSystemReader(path).read_metadata()
    assert len(metadata.state_dict_metadata["state_dict.big"].chunks) == 5  # 1.2 MB in chunks of 256 KiB
    assert len([f for f in os.listdir(path) if f.endswith(".distcp")]) == 2  # two writer threads, balanced
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
        dcp.load(stock, storage_reader=FileSystemReader(path), no_dist=True)
        dcp_to_torch_save(path, str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)["state_dict"]
    # Ours: into a target (the big tensor's target is not contiguous: read through a scratch tensor) and without.
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
    target["state_dict"]["big"] = torch.zeros(1000, 300).t()
    Checkpointer().load(path, target=target, strict=False, only=["state_dict"])
    for key, value in state.items():
        assert torch.equal(stock["state_dict"][key], value), key
        assert torch.equal(full[key], value), key
        assert torch.equal(target["state_dict"][key], value), key


def test_checkpoints_written_by_earlier_versions_still_load():
    loaded = Checkpointer().load(os.path.join(DATA, "v1_main.ckpt"))  # torch.save records, no gaps
    state = loaded.tree["state_dict"]
    assert torch.equal(state["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(state["b"], torch.arange(5, dtype=torch.bfloat16))
    assert state["s"].item() == 7 and loaded.objects["global_step"] == 3


@pytest.mark.parametrize("where", ["data", "suffix"])
def test_damage_in_a_record_read_in_place_names_the_file(tmp_path, where):
    state, path = _state(), str(tmp_path / "c.ckpt")
    _save_chunked(path, state)
    commit = __import__("json").loads((tmp_path / "c.ckpt" / ".commit").read_text())
    name, entry = next((n, e) for n, e in commit["files"].items() if any(r[1] > DIRECT_MIN for r in e["records"]))
    offset, length, _ = max(entry["records"], key=lambda r: r[1])
    position = offset + length // 2 if where == "data" else offset + length - 10
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0x10]))
    target = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
    with pytest.raises(CorruptCheckpointError, match=name):
        Checkpointer().load(path, target=target, only=["state_dict"])


def _item(fqn: str, rows: int, offset: int = 0) -> WriteItem:
    size = torch.Size([rows, 4])
    chunk = __import__("torch.distributed.checkpoint.metadata", fromlist=["x"]).ChunkStorageMetadata(
        offsets=torch.Size([offset, 0]), sizes=size
    )
    props = __import__("torch.distributed.checkpoint.metadata", fromlist=["x"]).TensorProperties(dtype=torch.float32)
    return WriteItem(
        index=MetadataIndex(fqn, [offset, 0]),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size),
    )


def test_balanced_dedup_gives_each_replicated_item_to_one_rank_evenly():
    replicated = [_item(f"t{i}", 8) for i in range(9)]
    own = _item("rank2_only", 8)
    plans = balanced_dedup([SavePlan(list(replicated)), SavePlan(list(replicated)), SavePlan([*replicated, own])])
    owned = [sorted(i.index.fqn for i in p.items) for p in plans]
    assert sorted(sum(owned, [])) == sorted(i.index.fqn for i in [*replicated, own])  # each written exactly once
    assert "rank2_only" in owned[2]
    assert sorted(len(o) for o in owned) == [3, 3, 4]  # 10 equal items over 3 ranks
