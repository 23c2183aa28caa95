"""Reading the ``.commit`` markers of a listing: their ends only when those show the order, else each marker whole;
locally and on S3 (SeaweedFS), where the ends are read with concurrent ranged requests."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from lightning_dcp import CorruptCheckpointError, DCPCheckpointIO
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.format.marker import COMMIT_FILE, ORDER_TAIL_BYTES
from lightning_dcp.engine.storage.commit_reads import read_commit, read_commit_orders
from lightning_dcp.engine.storage.location import Location
from tests._crafting import edit_commit


def _save(path: str, step: int, tensors: int = 400) -> Location:
    state = {"state_dict": {f"layer{i}.weight": torch.full((8,), float(step)) for i in range(tensors)}}
    DCPCheckpointIO().save_checkpoint({**state, "global_step": step}, path)
    return Location(path)


def read_commit_order(location: Location):
    """The listing's answer for one checkpoint (raising what it returns in its place)."""
    (found,) = read_commit_orders(location.parent(), [location.name])
    if isinstance(found, Exception):
        raise found
    return found


def _marker(location: Location) -> bytes:
    with open(os.path.join(location.path, COMMIT_FILE), "rb") as f:
        return f.read()


def test_the_order_comes_from_the_end_alone(tmp_path):
    location = _save(str(tmp_path / "a.ckpt"), 3)
    data = _marker(location)
    assert len(data) > 4 * ORDER_TAIL_BYTES  # 400 records: the end is a small part of the marker
    order = read_commit(location)["order"]
    assert read_commit_order(location) == {"order": order} and order["step"] == 3
    middle = len(data) // 2  # damage the records, not the end: only a whole read can see it
    with open(os.path.join(location.path, COMMIT_FILE), "r+b") as f:
        f.seek(middle)
        f.write(b"9" if data[middle : middle + 1] != b"9" else b"8")
    with pytest.raises(CorruptCheckpointError, match=r"\.commit is not a valid"):
        read_commit(location)
    assert read_commit_order(location) == {"order": order}  # a listing still ranks it; a load reads it whole


def test_a_marker_whose_end_shows_no_order_is_read_whole(tmp_path):
    location = _save(str(tmp_path / "a.ckpt"), 3)
    edit_commit(location.path, lambda m: {k: v for k, v in m.items() if k != "order"})  # as saved before orders
    found = read_commit_order(location)
    assert "order" not in found and found == read_commit(location) and "files" in found
    with open(os.path.join(location.path, COMMIT_FILE), "r+b") as f:
        f.truncate(len(_marker(location)) - 2)  # a damaged end: the whole read says what is wrong
    with pytest.raises(CorruptCheckpointError, match=r"\.commit is not a valid"):
        read_commit_order(location)


def test_no_marker_and_a_marker_that_is_a_directory(tmp_path):
    os.makedirs(tmp_path / "empty.ckpt")
    assert read_commit_order(Location(str(tmp_path / "empty.ckpt"))) is None
    os.makedirs(tmp_path / "odd.ckpt" / COMMIT_FILE)
    with pytest.raises(CorruptCheckpointError, match="is a directory"):
        read_commit_order(Location(str(tmp_path / "odd.ckpt")))


def test_a_listing_by_the_end_ranks_as_a_whole_listing(tmp_path):
    for step in (5, 2, 9, 7):
        _save(str(tmp_path / f"step={step}.ckpt"), step, tensors=50)
    edit_commit(str(tmp_path / "step=2.ckpt"), lambda m: {k: v for k, v in m.items() if k != "order"})  # unordered
    with open(tmp_path / "step=7.ckpt" / COMMIT_FILE, "w") as f:
        f.write("[1, 2]")  # malformed: skipped with a warning either way
    listings = []
    for whole in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = committed_checkpoints(Location(str(tmp_path)), whole=whole)
        assert any("skipping" in str(w.message) and "step=7.ckpt" in str(w.message) for w in caught)
        listings.append([(key, checkpoint.name, entry.run) for entry in found for key, checkpoint in [entry]])
    assert listings[0] == listings[1]
    assert [name for _, name, _ in listings[0]] == ["step=9.ckpt", "step=5.ckpt", "step=2.ckpt"]


def test_on_s3_the_ends_come_from_one_ranged_request_each(s3_bucket):
    import aiobotocore.endpoint

    url, options = s3_bucket
    from lightning_dcp.engine import Checkpointer, CheckpointerConfig

    checkpointer = Checkpointer(CheckpointerConfig(storage_options=options))
    state = {"state_dict": {f"layer{i}.weight": torch.full((8,), 1.0) for i in range(400)}}
    names = [f"step={step}.ckpt" for step in (2, 7, 5)]
    for step, name in zip((2, 7, 5), names, strict=True):
        checkpointer.save(state, f"{url}/run/{name}", objects={"step": step}, step=step)
    directory = Location(f"{url}/run", storage_options=options)
    whole = [read_commit(directory.child(name)) for name in names]
    calls: list[tuple[str, str | None]] = []
    original = aiobotocore.endpoint.AioEndpoint.make_request

    async def counted(self, operation, request):
        calls.append((operation.name, request.get("headers", {}).get("Range")))
        return await original(self, operation, request)

    aiobotocore.endpoint.AioEndpoint.make_request = counted
    try:
        found = read_commit_orders(directory, [*names, "absent.ckpt"])
    finally:
        aiobotocore.endpoint.AioEndpoint.make_request = original
    assert found == [{"order": marker["order"]} for marker in whole] + [None]
    assert sorted(calls) == [("GetObject", f"bytes=-{ORDER_TAIL_BYTES}")] * 4  # no HEAD, no whole marker
    ranked = [(key, c.name, entry.run) for entry in committed_checkpoints(directory, whole=False) for key, c in [entry]]
    assert [name for _, name, _ in ranked] == ["step=5.ckpt", "step=7.ckpt", "step=2.ckpt"]  # the save counter first
    assert ranked == [(key, c.name, entry.run) for entry in committed_checkpoints(directory) for key, c in [entry]]


def test_where_suffix_ranges_are_refused_the_markers_are_read_one_by_one(s3_server, s3_bucket):
    import fsspec

    from lightning_dcp.engine.storage import location as location_module

    _, options = s3_bucket
    bucket = "bucket-" + s3_server.new_bucket()[2:]  # "bucket" in its name: a missing marker is never a missing bucket
    fsspec.filesystem("s3", **options).mkdir(bucket)
    url = f"s3://{bucket}/run"
    from lightning_dcp.engine import Checkpointer, CheckpointerConfig

    checkpointer = Checkpointer(CheckpointerConfig(storage_options=options))
    for step in (3, 4):
        checkpointer.save({"state_dict": {"w": torch.full((8,), float(step))}}, f"{url}/s{step}", step=step)
    fsspec.filesystem("s3", **options).pipe(f"{bucket}/run/unfinished/__0_0.distcp", b"x" * 10)  # no marker yet
    directory = Location(url, storage_options=options)
    fs_class = type(directory.fs)
    location_module._NO_SUFFIX_RANGES.add(fs_class)  # as after adlfs refused one: the file-by-file path
    try:
        found = read_commit_orders(directory, ["s3", "s4", "unfinished"])
    finally:
        location_module._NO_SUFFIX_RANGES.discard(fs_class)
    assert found[2] is None
    assert [f["order"]["step"] for f in found[:2]] == [3, 4]


def test_a_store_that_goes_away_after_the_listing_is_an_error_not_an_empty_listing(s3_server_factory):
    from lightning_dcp import StorageUnavailableError
    from lightning_dcp.engine import Checkpointer, CheckpointerConfig

    server = s3_server_factory()
    options = server.storage_options()
    url = f"s3://{server.new_bucket()}/run"
    checkpointer = Checkpointer(CheckpointerConfig(storage_options=options))
    checkpointer.save({"state_dict": {"w": torch.ones(8)}}, f"{url}/s1", step=1)
    directory = Location(url, storage_options=options)
    assert [name for name, _ in directory.entries()] == ["s1"]
    server.kill()
    with pytest.raises(StorageUnavailableError):
        read_commit_orders(directory, ["s1"])  # "last" must not start from scratch while the store is down
