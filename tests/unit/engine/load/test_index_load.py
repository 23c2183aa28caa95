"""Restores through the record index in ``.commit`` (engine/load/index_load.py): the same values as the general way,
which takes over wherever the index cannot serve; damaged records and hostile indexes fail with a CheckpointError."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dcp import CheckpointError, CorruptCheckpointError, StateDictMismatchError, verify_checkpoint
from lightning_dcp.engine import Checkpointer, CheckpointerConfig
from lightning_dcp.engine.format import plain_values
from lightning_dcp.engine.format.record_index import parse_index
from lightning_dcp.engine.load import local_load
from lightning_dcp.engine.load.dcp_reader import storage_reader
from lightning_dcp.engine.load.reading import SMALL_RECORD
from lightning_dcp.engine.save import planning
from lightning_dcp.engine.storage.location import Location
from tests._crafting import write_commit


def _tree() -> dict:
    torch.manual_seed(3)
    model = {
        "w": torch.nn.Parameter(torch.randn(6, 5)),
        "b": torch.randn(5),
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "half": torch.randn(4, 3).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        **{f"layers.{i}.weight": torch.randn(3 + i % 4, 4) for i in range(40)},
    }
    optimizer = {
        "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, 5)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None, "params": ["w", "b"]}],
    }
    return {"state_dict": model, "optimizer_states": [optimizer]}


def _blank(tree: dict) -> dict:
    """A target of the same structure, every tensor of it filled with another value, every other leaf changed."""

    def blank(value):
        if isinstance(value, torch.Tensor):
            out = torch.full_like(value.detach(), 7) if value.numel() else torch.empty_like(value.detach())
            return torch.nn.Parameter(out) if isinstance(value, torch.nn.Parameter) else out
        if isinstance(value, dict):
            return {k: blank(v) for k, v in value.items()}
        if isinstance(value, list):
            return [blank(v) for v in value]
        return None

    return blank(tree)


def _assert_equal(loaded: dict, tree: dict) -> None:
    flat_loaded, _ = planning.flatten(loaded)
    flat_tree, _ = planning.flatten(tree)
    assert set(flat_loaded) == set(flat_tree)
    for key, value in flat_tree.items():
        got = flat_loaded[key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and torch.equal(got.detach(), value.detach()), key
        else:
            assert got == value, key


@pytest.fixture
def general_calls(monkeypatch):
    """How many restores took the general way (local_load.load) rather than the index."""
    calls = []
    original = local_load.load

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(local_load, "load", counted)
    return calls


def _saved(tmp_path, tree=None, **save) -> str:
    path = str(tmp_path / "c.ckpt")
    Checkpointer(CheckpointerConfig(**save)).save(tree or _tree(), path, objects={"epoch": 4, "hparams": {"lr": 0.1}})
    return path


def test_the_index_names_each_record_as_the_metadata_does(tmp_path, monkeypatch):
    monkeypatch.setattr(planning, "CHUNK_BYTES", 1 << 12)
    tree = _tree()
    tree["state_dict"]["big"] = torch.randn(64, 64)  # 16 KiB: row chunks when saved with 2 threads
    path = _saved(tmp_path, tree, thread_count=2)
    commit = json.loads(open(os.path.join(path, ".commit")).read())
    metadata = storage_reader(Location(path)).read_metadata()
    by_place = {(info.relative_path, info.offset, info.length): key for key, info in metadata.storage_data.items()}
    chunked = 0
    for name, entries in commit["index"]["files"].items():
        for entry, (offset, length, _) in zip(entries, commit["files"][name]["records"], strict=True):
            key = by_place[(name, offset, length)]
            assert entry[0] == key.fqn
            meta = metadata.state_dict_metadata[key.fqn]
            if len(entry) == 1:
                assert not hasattr(meta, "chunks")
                continue
            assert entry[1] == str(meta.properties.dtype)[6:]
            if len(entry) == 3:
                assert entry[2] == list(meta.size) and not any(key.offset)
            else:
                chunked += 1
                assert entry[3] == list(key.offset) and any(tuple(c.sizes) == tuple(entry[2]) for c in meta.chunks)
    assert chunked == 4
    chunks = parse_index(commit)["state_dict.big"]  # the chunks of one tensor, together
    assert sorted((c.chunk, c.shape) for c in chunks) == [((16 * i, 0), (16, 64)) for i in range(4)]


@pytest.mark.parametrize("chunk_bytes", [1 << 12, 3 << 19])
def test_a_tensor_saved_in_row_chunks_restores_through_the_index_in_place(
    tmp_path, monkeypatch, general_calls, chunk_bytes
):
    monkeypatch.setattr(planning, "CHUNK_BYTES", chunk_bytes)
    tree = _tree()
    # 4 KiB: 4 chunks of 16 rows, read in spans; 1.5 MiB: 3 chunks over SMALL_RECORD, read straight in
    tree["state_dict"]["big"] = torch.randn(64, 64) if chunk_bytes < SMALL_RECORD else torch.randn(4000, 200)
    path = _saved(tmp_path, tree, thread_count=2)
    commit = json.loads(open(os.path.join(path, ".commit")).read())
    lengths = [
        rec[1]
        for name, entries in commit["index"]["files"].items()
        for entry, rec in zip(entries, commit["files"][name]["records"], strict=True)
        if len(entry) == 4
    ]
    assert len(lengths) >= 3 and all((n > SMALL_RECORD) == (chunk_bytes > SMALL_RECORD) for n in lengths)
    target = _blank(tree)
    big = target["state_dict"]["big"]
    loaded = Checkpointer().load(path, target=target)
    assert general_calls == []
    _assert_equal(loaded.tree, tree)
    assert loaded.tree["state_dict"]["big"] is big


@pytest.mark.parametrize("edit", ["gap", "overlap", "column", "short", "whole beside"])
def test_chunks_that_do_not_tile_their_tensor_are_refused_by_the_general_way(
    tmp_path, monkeypatch, general_calls, edit
):
    """The index path sees the chunks do not tile and leaves them to the general way, which checks the (resealed)
    index against ``.metadata`` and refuses the checkpoint: its index was not the one written at save."""
    monkeypatch.setattr(planning, "CHUNK_BYTES", 1 << 12)
    tree = _tree()
    tree["state_dict"]["big"] = torch.randn(64, 64)
    path = _saved(tmp_path, tree, thread_count=2)
    commit = json.loads(open(os.path.join(path, ".commit")).read())
    chunks = sorted(
        (entry for entries in commit["index"]["files"].values() for entry in entries if len(entry) == 4),
        key=lambda entry: entry[3][0],
    )
    if edit == "gap":
        chunks[1][3][0] += 1
    elif edit == "overlap":
        chunks[1][3][0] -= 1
    elif edit == "column":
        chunks[1][3][1] = 1
    elif edit == "short":
        chunks[-1][2][0] -= 1
    else:
        chunks[0][1:] = [chunks[0][1], [64, 64]]
    write_commit(path, commit)
    if edit == "whole beside":  # an index the restore cannot use at all (parse_index): .metadata alone is read
        loaded = Checkpointer().load(path, target=_blank(tree))
        assert general_calls == [1]
        _assert_equal(loaded.tree, tree)
        return
    with pytest.raises(CorruptCheckpointError, match="record index in .commit disagrees with .metadata"):
        Checkpointer().load(path, target=_blank(tree))


def test_a_matching_target_restores_through_the_index_bit_equal(tmp_path, general_calls):
    tree = _tree()
    path = _saved(tmp_path, tree)
    target = _blank(tree)
    kept = {k: v for k, v in target["state_dict"].items()}
    loaded = Checkpointer().load(path, target=target)
    assert general_calls == []
    _assert_equal(loaded.tree, tree)
    assert all(loaded.tree["state_dict"][k] is v for k, v in kept.items())  # filled in place
    assert loaded.objects["epoch"] == 4 and loaded.objects["hparams"] == {"lr": 0.1}
    assert loaded.missing_keys == [] and loaded.unexpected_keys == []


@pytest.mark.parametrize(
    "change",
    ["extra key", "missing key", "dtype", "shape", "non-contiguous", "other state dict"],
)
def test_targets_the_index_cannot_serve_take_the_general_way(tmp_path, general_calls, change):
    tree = _tree()
    if change == "other state dict":
        tree["ema"] = {"w": torch.randn(3)}
    path = _saved(tmp_path, tree)
    target = _blank({k: v for k, v in tree.items() if k != "ema"})
    model = target["state_dict"]
    if change == "extra key":
        model["new"] = torch.zeros(2)
    elif change == "missing key":
        del model["b"]
    elif change == "dtype":
        model["b"] = model["b"].double()
    elif change == "shape":
        model["b"] = torch.zeros(6)
    elif change == "non-contiguous":
        model["ids"] = torch.zeros(4, 3, dtype=torch.int64).t()
    if change in ("non-contiguous", "other state dict"):  # loads, the general way
        loaded = Checkpointer().load(path, target=target)
        assert general_calls == [1]
        _assert_equal(loaded.tree["state_dict"], tree["state_dict"])
        if change == "other state dict":
            assert torch.equal(loaded.tree["ema"]["w"], tree["ema"]["w"])
        return
    with pytest.raises(StateDictMismatchError):  # the general way's check of the target, before any read
        Checkpointer().load(path, target=target)
    if change == "missing key":
        loaded = Checkpointer().load(path, target=_blank(tree) | {"state_dict": model}, strict=False)
        assert loaded.unexpected_keys == ["b"] and general_calls == [1]
        _assert_equal(loaded.tree["state_dict"], {k: v for k, v in tree["state_dict"].items() if k != "b"})


def test_a_checkpoint_without_an_index_restores_the_general_way(tmp_path, general_calls):
    tree = _tree()
    path = _saved(tmp_path, tree)
    commit = json.loads(open(os.path.join(path, ".commit")).read())
    del commit["index"]
    write_commit(path, commit)
    loaded = Checkpointer().load(path, target=_blank(tree))
    assert general_calls == [1]
    _assert_equal(loaded.tree, tree)


@pytest.mark.parametrize("where", ["tensor framing", "tensor data", "tensor directory", "object"])
def test_a_damaged_byte_fails_naming_the_file_and_the_entry(tmp_path, general_calls, where):
    tree = _tree()
    path = _saved(tmp_path, tree)
    commit = json.loads(open(os.path.join(path, ".commit")).read())
    want = 1 if where == "object" else 3
    name, offset, length, fqn = next(
        (name, rec[0], rec[1], entry[0])
        for name, entries in commit["index"]["files"].items()
        for entry, rec in zip(entries, commit["files"][name]["records"], strict=True)
        if len(entry) == want and (want == 1 or entry[2] == [6, 5])
    )
    position = {"tensor framing": 3, "tensor data": length // 2, "tensor directory": length - 5, "object": 40}[where]
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(offset + position)
        byte = f.read(1)
        f.seek(offset + position)
        f.write(bytes([byte[0] ^ 0x20]))
    with pytest.raises(CorruptCheckpointError, match=name) as err:
        Checkpointer().load(path, target=_blank(tree))
    assert fqn in str(err.value)
    assert general_calls == []


def test_a_truncated_data_file_fails_before_anything_is_read(tmp_path):
    tree = _tree()
    path = _saved(tmp_path, tree)
    name = max(os.listdir(path), key=lambda n: os.path.getsize(os.path.join(path, n)) if n.endswith(".distcp") else 0)
    os.truncate(os.path.join(path, name), os.path.getsize(os.path.join(path, name)) - 10)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        Checkpointer().load(path, target=_blank(tree))


def test_plain_objects_decode_as_torch_load_does_and_others_go_to_torch_load():
    plain = [{"lr": 0.1, "betas": (0.9, 0.99), "params": [f"p{i}" for i in range(50)]}, b"\x00blob", None, 3, "s"]
    for value in plain:
        data = io.BytesIO()
        torch.save(value, data)
        assert plain_values.plain_value(data.getvalue()) == torch.load(io.BytesIO(data.getvalue()), weights_only=True)
    for value in (collections.OrderedDict(a=1), torch.ones(2), bytearray(b"x"), {1, 2}):  # classes: torch.load
        data = io.BytesIO()
        torch.save(value, data)
        assert plain_values.plain_value(data.getvalue()) is plain_values.NOT_PLAIN
    assert plain_values.plain_value(b"not a zip") is plain_values.NOT_PLAIN
    assert plain_values.plain_value(pickle.dumps([1, 2])) is plain_values.NOT_PLAIN  # a pickle, not an archive


_MUTATIONS = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=10**6),
        st.sampled_from(["drop", "fqn", "dtype", "shape", "kind", "swap", "version", "type", "offsets"]),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("resealed", [False, True])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=_MUTATIONS)
def test_a_hostile_index_never_loads_other_values_or_raises_other_errors(tmp_path_factory, mutations, resealed):
    """Edits of the index (as JSON values) either leave the restore exact, or it fails with a CheckpointError.

    An edit that leaves the marker's own checksum stale is refused whatever it changed; one whose checksum was
    recomputed too (a crafted marker) and that loads other values (two same-shaped records swapped) fails ``verify``.
    """
    tmp = tmp_path_factory.mktemp("hostile")
    tree = _tree()
    tree["state_dict"]["big"] = torch.randn(64, 64)
    with pytest.MonkeyPatch.context() as patched:  # "big" in row chunks
        patched.setattr(planning, "CHUNK_BYTES", 1 << 12)
        path = _saved(tmp, tree, thread_count=2)
    commit = json.loads(open(os.path.join(path, ".commit")).read())
    files = commit["index"]["files"]
    names = sorted(files)
    for pick, kind in mutations:
        entries = files[names[pick % len(names)]]
        if not entries:
            continue
        i = pick % len(entries)
        entry = entries[i]
        if not isinstance(entry, list) or not entry:  # replaced by an earlier edit: nothing more to edit there
            continue
        if kind == "drop":
            entries.pop(i)
        elif kind == "fqn":
            entry[0] = entry[0] + "x"
        elif kind == "dtype" and len(entry) > 1:
            entry[1] = ["float64", "int32", "bfloat16", "nope", 3][pick % 5]
        elif kind == "shape" and len(entry) > 2:
            entry[2] = [d + 1 for d in entry[2]] or [1]
        elif kind == "kind":
            entries[i] = entry[:1] if len(entry) > 1 else [entry[0], "float32", [1]]
        elif kind == "swap" and len(entries) > 1:
            j = (i + 1) % len(entries)
            entries[i], entries[j] = entries[j], entries[i]
        elif kind == "version":
            commit["index"]["version"] = pick % 4
        elif kind == "type":
            entries[i] = [None, {}, "x", 5][pick % 4]
        elif kind == "offsets" and len(entry) == 4 and isinstance(entry[3], list):
            entry[3] = [[d + 1 for d in entry[3]], [0] * len(entry[3]), entry[3][:1], "x"][pick % 4]
    before = open(os.path.join(path, ".commit"), "rb").read()
    if resealed:
        write_commit(path, commit)
    else:
        with open(os.path.join(path, ".commit"), "w") as f:
            json.dump(commit, f)  # a stale checksum of its own
    edited = json.loads(before) != commit
    target = _blank(tree)
    try:
        loaded = Checkpointer().load(path, target=target)
    except CheckpointError:
        return
    assert resealed or not edited, "a marker edited after commit was trusted"
    flat, _ = planning.flatten(loaded.tree)
    for key, value in planning.flatten(tree)[0].items():
        if isinstance(value, torch.Tensor) and flat[key].dtype == value.dtype and flat[key].shape == value.shape:
            if not torch.equal(flat[key].detach(), value.detach()):
                # a swap of two records of one dtype and shape: the framing cannot see it; the check against
                # .metadata that verify runs does
                with pytest.raises(CorruptCheckpointError, match="record index .* disagrees with .metadata"):
                    verify_checkpoint(path)
                return


@pytest.mark.parametrize("index", [True, False])
def test_objects_only_reads_the_blobs_and_no_tensor(tmp_path, general_calls, index):
    tree = {"model": _tree()["state_dict"]}  # a Fabric layout: state dicts under names of the user's choosing
    path = _saved(tmp_path, tree)
    if not index:
        commit = json.loads(open(os.path.join(path, ".commit")).read())
        del commit["index"]
        write_commit(path, commit)
    head = Checkpointer().load(path, target={}, strict=False, objects_only=True)
    assert head.tree == {} and head.objects["epoch"] == 4 and head.objects["hparams"] == {"lr": 0.1}
    assert general_calls == ([] if index else [1])
    everything = Checkpointer().load(path, target={}, strict=False)  # without it: the saved state dicts as well
    _assert_equal(everything.tree["model"], tree["model"])
