"""What the fuzzing pass (tests/chaos/fuzz.py) found, each as the smallest checkpoint that shows it.

Crafted files with consistent checksums: readers must refuse them with a CheckpointError naming the file, quickly
and without allocating what a number in the file claims.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import time
import zipfile

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from lightning_dcp import CheckpointError, CorruptCheckpointError, DCPCheckpointIO, verify_checkpoint
from lightning_dcp.engine.format.archive import UnsafeArchiveError, check_archive
from lightning_dcp.engine.format.blob import decode_extra, encode_extra
from tests._crafting import replace_record, rewrite_metadata, torch_bytes, write_committed
from tests.chaos._inputs import NUMPY_TAG, archive, code_pickle


def _committed(tmp_path, state: dict) -> str:
    path = str(tmp_path / "a.ckpt")
    write_committed(path, {**state, "lightning": torch_bytes({"global_step": 1})})
    return path


def _load_quickly(path: str, *, seconds: float = 5.0, megabytes: float = 200.0) -> CheckpointError:
    """The load's error, after checking its time and how far it raised this process's peak memory.

    The peak is reset first (``/proc/self/clear_refs``): ``ru_maxrss`` of a long-lived pytest process is the peak of
    every test before, under which a load's allocation would go unseen.
    """
    base = _reset_peak_rss()
    started = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        DCPCheckpointIO().load_checkpoint(path)
    assert time.monotonic() - started < seconds
    assert _peak_rss() - base < megabytes
    assert path in str(err.value)
    return err.value


def _peak_rss() -> float:
    """This process's peak resident memory since the last reset, in MiB (VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) / 1024


def _reset_peak_rss() -> float:
    """Reset the peak to the current resident memory (Linux >= 4.0) and return it, in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _peak_rss()


def test_the_peak_memory_measure_sees_an_allocation_under_an_older_peak():
    older = bytearray(300 * 2**20)
    older[:: 2**12] = b"x" * len(older[:: 2**12])  # touched: resident
    del older
    base = _reset_peak_rss()
    grown = bytearray(150 * 2**20)
    grown[:: 2**12] = b"x" * len(grown[:: 2**12])
    assert _peak_rss() - base > 140  # ru_maxrss would still read the older 300 MiB peak: no growth
    del grown


# --------------------------------------------------------------------------------------------------- .metadata
def test_list_index_in_planner_data_is_bounded(tmp_path):
    """A path ``("state_dict", 10**9)`` made a plain load append a billion list slots (minutes, gigabytes)."""
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2)}})

    def huge_index(metadata):
        for key in [k for k in metadata.state_dict_metadata if k == "state_dict.w"]:
            metadata.state_dict_metadata["state_dict.1000000000"] = metadata.state_dict_metadata.pop(key)
            metadata.planner_data.pop(key)
            metadata.planner_data["state_dict.1000000000"] = ("state_dict", 10**9)
        metadata.storage_data = {
            MetadataIndex("state_dict.1000000000", index.offset, index.index)
            if index.fqn == "state_dict.w"
            else index: v
            for index, v in metadata.storage_data.items()
        }

    rewrite_metadata(path, huge_index)
    assert "slots" in str(_load_quickly(path))


def test_planner_data_path_must_spell_its_key(tmp_path):
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2)}})
    rewrite_metadata(path, lambda m: m.planner_data.__setitem__("state_dict.w", ("optimizer_states",)))
    assert "not the names and indices of that key" in str(_load_quickly(path))


def test_chunks_cannot_share_one_record(tmp_path):
    """300 chunks pointing at one 4 MB record made a 28 kB .metadata allocate and read 1.2 GB."""
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(1 << 16)}})
    copies = 300

    def alias(metadata):
        meta = metadata.state_dict_metadata["state_dict.w"]
        info = next(v for k, v in metadata.storage_data.items() if k.fqn == "state_dict.w")
        n = meta.size[0]
        meta.size = torch.Size([n * copies])
        meta.chunks = [ChunkStorageMetadata(torch.Size([i * n]), torch.Size([n])) for i in range(copies)]
        metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != "state_dict.w"}
        for i in range(copies):
            metadata.storage_data[MetadataIndex("state_dict.w", torch.Size([i * n]), i)] = info

    rewrite_metadata(path, alias)
    assert "overlap" in str(_load_quickly(path))


# -------------------------------------------------------------------------------------------- blob and records
def _sized_call(callable_module: str, callable_name: str, size: int) -> bytes:
    """A torch.save archive whose pickle is ``callable(size)``: allowed by weights_only, allocating ``size``."""
    pkl = b"\x80\x02c" + f"{callable_module}\n{callable_name}\n".encode() + b"\x8a\x06" + size.to_bytes(6, "little")
    return archive(pkl + b"\x85R.")


def _deflated(pkl: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")
    return out.getvalue()


HUGE = 1 << 40  # a claim, never allocated: the archive is refused before torch.load sees it

SIZED = {
    "bytearray": _sized_call("builtins", "bytearray", HUGE),
    "storage": _sized_call("torch", "FloatStorage", HUGE),
    "untyped-storage": _sized_call("torch.storage", "UntypedStorage", HUGE),
    "tensor": _sized_call("torch", "LongTensor", HUGE),
    "zip-bomb": _deflated(b"\x80\x02X\x00\x00\x00\x04" + b"\0" * (1 << 26) + b"."),  # 64 MiB string in ~65 kB
}


@pytest.mark.parametrize("blob", SIZED.values(), ids=SIZED.keys())
def test_blob_that_would_allocate_what_it_claims_is_refused(blob):
    with pytest.raises(CorruptCheckpointError, match="would allocate|compressed") as err:
        decode_extra(blob, path="ckpt", entry="lightning")
    assert err.value.file == "lightning"


def test_bytes_entry_that_would_allocate_is_refused_naming_its_file(tmp_path):
    """DCP's bytes entries (optimizer param_groups values, the blob's record) go through the same check."""
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2)}})
    name = replace_record(path, "lightning", SIZED["bytearray"])
    err = _load_quickly(path)
    assert isinstance(err, CorruptCheckpointError) and err.file == name
    assert "would allocate" in str(err)


def test_legitimate_archives_pass_the_check():
    values = [
        {"a": 1, "b": [1.5, None, True, "x"], "c": (1, 2), "s": {1, 2}, "z": 1 + 2j},
        torch.ones(3),
        {"p": torch.nn.Parameter(torch.ones(2)), "t": torch.zeros(2, 3).t(), "size": torch.Size([2, 3])},
        bytearray(b"abc"),
        b"bytes",
    ]
    for value in values:
        check_archive(torch_bytes(value))
    check_archive(encode_extra({"n": __import__("numpy").float32(1.5), "a": __import__("numpy").arange(3)}))
    with pytest.raises(UnsafeArchiveError, match="not a torch.save zip"):
        check_archive(pickle.dumps({"a": 1}))


@pytest.mark.parametrize(
    "tag",
    [5, ("ndarray", "float32"), ("x", "float32", 1), ("scalar", "nonsense", 1), ("ndarray", "float32", 5),
     ("ndarray", "object", torch.ones(3)), ("ndarray", "U100000000", torch.ones(8)), ("scalar", "V2000000000", 0),
     ("ndarray", "float64", torch.ones(3, dtype=torch.float32)), ("scalar", "int8", 10**30)],
    ids=["int", "short", "kind", "dtype", "payload", "object", "huge-str", "void", "dtype-mismatch", "overflow"],
)  # fmt: skip
def test_crafted_numpy_entries_are_corrupt_state(tag):
    """Raw TypeError/ValueError/AttributeError escaped decode_extra; ``U100000000`` allocated 3.2 GB."""
    with pytest.raises(CorruptCheckpointError, match="numpy") as err:
        decode_extra(torch_bytes({"x": {NUMPY_TAG: tag}}), path="ckpt", entry="lightning")
    assert err.value.file == "lightning"


def test_payload_in_blob_runs_nothing(tmp_path):
    marker = str(tmp_path / "pwned")
    for kind in ("open", "system", "payload"):
        with pytest.raises(CheckpointError):
            decode_extra(archive(code_pickle(kind, marker)), path="ckpt", entry="lightning")
    assert not os.path.exists(marker)


# ------------------------------------------------------------------------------------------------ local files
def test_symlink_loop_is_a_checkpoint_error(tmp_path):
    """``verify_checkpoint`` raised a raw OSError (ELOOP) for a link to itself."""
    os.symlink("loop.ckpt", tmp_path / "loop.ckpt")
    with pytest.raises(CheckpointError, match="cannot be read"):
        verify_checkpoint(str(tmp_path / "loop.ckpt"))
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2)}})
    os.unlink(os.path.join(path, ".metadata"))
    os.symlink(".metadata", os.path.join(path, ".metadata"))
    with pytest.raises(CorruptCheckpointError, match="cannot be read"):
        verify_checkpoint(path)


# ------------------------------------------------------------------------------- findings in engine/save/dcp_io.py
def test_tensor_record_larger_than_its_chunk_is_refused(tmp_path):
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2, 3)}})
    replace_record(path, "state_dict.w", torch_bytes(torch.full((4, 4), 2.0)))
    with pytest.raises(CorruptCheckpointError):
        DCPCheckpointIO().load_checkpoint(path)


def test_tensor_record_that_would_allocate_is_refused_before_loading(tmp_path):
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2)}})
    replace_record(path, "state_dict.w", SIZED["bytearray"])
    with pytest.raises(CorruptCheckpointError, match="would allocate"):
        DCPCheckpointIO().load_checkpoint(path)


def test_metadata_objects_with_odd_fields_are_refused(tmp_path):
    """An int storage offset raised a raw TypeError, a Metadata without state_dict_metadata an AttributeError, a
    storage_meta of another type an AttributeError inside DCP's reader."""
    from lightning_dcp.engine.catalog.metadata import load_metadata

    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2)}})
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    index = next(k for k in metadata.storage_data if k.fqn == "state_dict.w")
    object.__setattr__(index, "offset", 5)
    with pytest.raises(CheckpointError, match="offset 5"):
        load_metadata(pickle.dumps(metadata))
    object.__setattr__(index, "offset", torch.Size([0]))
    metadata.storage_meta = torch.strided  # DCP's reader then failed with "AttributeError ... load_id"
    with pytest.raises(CheckpointError, match="'storage_meta' is a layout"):
        load_metadata(pickle.dumps(metadata))
    del metadata.state_dict_metadata
    with pytest.raises(CheckpointError, match="state_dict_metadata"):
        load_metadata(pickle.dumps(metadata))


def test_bytes_entry_without_a_record_is_refused(tmp_path):
    """A bytes entry whose record was dropped failed deep in DCP's reader with a KeyError."""
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2)}})
    rewrite_metadata(path, lambda m: m.storage_data.pop(next(k for k in m.storage_data if k.fqn == "lightning")))
    assert "has no storage record" in str(_load_quickly(path))


# --------------------------------------- found by the kill campaign (engine/storage/location.py; fixed: .commit goes
# first)
def test_removal_cut_short_never_leaves_a_commit_marker_without_its_files(tmp_path):
    import subprocess

    from lightning_dcp.engine.storage.location import Location

    path = str(tmp_path / "step=2.ckpt")
    DCPCheckpointIO(thread_count=4, sync_files=False).save_checkpoint(
        {"state_dict": {f"w{i}": torch.ones(64) for i in range(8)}}, path
    )
    stuck = os.path.join(path, ".metadata")  # an undeletable file stops the removal where it stands
    if subprocess.run(["chattr", "+i", stuck], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        with pytest.raises(OSError):
            Location(path).remove()
    finally:
        subprocess.run(["chattr", "-i", stuck], check=True)
    left = set(os.listdir(path))
    if ".commit" in left:
        assert {"__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "__0_3.distcp"} <= left, sorted(left)


# ------------------------------------------------------------------------------------------ optimizer state keys
def test_optimizer_state_for_a_parameter_no_group_lists_is_refused(tmp_path):
    """Found with seed 20261128: a blob that no longer says "keyed by id" beside id-keyed state raised KeyError."""
    optimizer = {"state": {"0": {"exp_avg": torch.ones(2)}}, "param_groups": [{"params": ["w"], "lr": 0.1}]}
    path = _committed(tmp_path, {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [optimizer]})
    err = _load_quickly(path)
    assert "'0'" in str(err) and "param groups" in str(err)


def test_optimizer_state_said_to_be_keyed_by_id_but_keyed_by_name_is_refused(tmp_path):
    from lightning_dcp.engine.format import layout

    optimizer = {"state": {"w": {"exp_avg": torch.ones(2)}}, "param_groups": [{"params": [0], "lr": 0.1}]}
    path = str(tmp_path / "a.ckpt")
    blob = torch_bytes({"global_step": 1, layout.INFO_KEY: {"optimizer_layout": layout.PARAM_ID}})
    write_committed(path, {"state_dict": {"w": torch.ones(2)}, "optimizer_states": [optimizer], "lightning": blob})
    err = _load_quickly(path)
    assert "'w'" in str(err) and "parameter ids" in str(err)
