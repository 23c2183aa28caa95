"""One storage contract, run on a local disk, fsspec ``memory://`` and real S3, GCS and Azure Blob servers on loopback.

Every test takes the ``root`` fixture, ``(url, storage_options)`` of an empty directory on one backend, and uses only
the public surface (``Location``, ``DCPCheckpointIO``), so each backend must behave the same.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from lightning_dcp import BucketNotFoundError, DCPCheckpointIO, NotACheckpointError, StorageAccessError
from lightning_dcp.engine.format.marker import COMMIT_FILE
from lightning_dcp.engine.storage.location import Location
from tests._stores import REMOTE_STORES, remote_bucket


@pytest.fixture(params=["local", "memory", *REMOTE_STORES])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store"), {}
    if request.param == "memory":
        return f"memory://contract-{uuid.uuid4().hex[:8]}", {}
    url, options, _ = remote_bucket(request, request.param)
    return url + "/run", options


def _checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((4, 3), value), "b": torch.arange(5.0)}, "epoch": int(value)}


def _io(options) -> DCPCheckpointIO:
    return DCPCheckpointIO(storage_options=options)


def test_write_read_list_remove(root):
    url, options = root
    directory = Location(url, storage_options=options)
    with directory.child("a/x.bin").open(mode="wb") as f:
        f.write(b"payload")
    assert directory.child("a/x.bin").exists() and not directory.child("a/x.bin").isdir()
    with directory.open("a/x.bin") as f:
        assert f.read() == b"payload"
    assert directory.entries() == [("a", "directory")]
    assert directory.child("a").entries() == [("x.bin", "file")]
    directory.child("a").remove()
    assert not directory.child("a").exists()
    assert directory.child("a").entries() == []


def test_save_is_visible_only_once_committed(root):
    url, options = root
    io = _io(options)
    target = Location(url + "/m.ckpt", storage_options=options)
    io.save_checkpoint(_checkpoint(1.0), target.url)
    assert target.is_committed()
    loaded = io.load_checkpoint(target.url)
    assert torch.equal(loaded["state_dict"]["w"], torch.full((4, 3), 1.0)) and loaded["epoch"] == 1
    # The same files without the commit marker are an interrupted save: never loaded.
    with target.open(COMMIT_FILE) as f:
        marker = f.read()
    target.fs.rm_file(target.join(COMMIT_FILE))
    with pytest.raises(NotACheckpointError, match="did not finish"):
        io.load_checkpoint(target.url)
    with target.open(COMMIT_FILE, "wb") as f:
        f.write(marker)
    assert io.load_checkpoint(target.url)["epoch"] == 1


def test_overwrite_replaces_and_leaves_no_staging(root):
    url, options = root
    io = _io(options)
    path = url + "/m.ckpt"
    io.save_checkpoint(_checkpoint(1.0), path)
    io.save_checkpoint(_checkpoint(2.0), path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.full((4, 3), 2.0))
    assert [name for name, _ in Location(url, storage_options=options).entries()] == ["m.ckpt"]


def test_sync_and_async_saves_load_with_stock_dcp(root):
    """Records written straight from tensor memory (local files or fsspec streams) are what stock DCP reads."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    url, options = root
    big = torch.randn(300, 1000)  # 1.2 MB: written from memory in pieces (direct I/O on a local disk)
    for mode, io in (("sync", _io(options)), ("async", DCPCheckpointIO(storage_options=options, async_save=True))):
        path = f"{url}/{mode}.ckpt"
        io.save_checkpoint({"state_dict": {"w": torch.full((4, 3), 2.0), "big": big}, "epoch": 2}, path)
        io.teardown()  # the async save completes and commits
        location = Location(path, storage_options=options)
        assert location.is_committed()
        reader = FileSystemReader(location.path) if location.local else FsspecReader(path, **options)
        target = {"state_dict": {"w": torch.zeros(4, 3), "big": torch.zeros(300, 1000)}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's single-process notice
            dcp.load(target, storage_reader=reader, no_dist=True)
        assert torch.equal(target["state_dict"]["w"], torch.full((4, 3), 2.0)), mode
        assert torch.equal(target["state_dict"]["big"], big), mode


def test_stale_staging_is_removed_by_the_next_save(root):
    url, options = root
    target = Location(url + "/m.ckpt", storage_options=options)
    stale = target.staging("deadbeef0000")
    with stale.child("__0_0.distcp").open(mode="wb") as f:
        f.write(b"half written")
    _io(options).save_checkpoint(_checkpoint(3.0), target.url)
    assert not stale.exists()
    assert [name for name, _ in target.parent().entries()] == ["m.ckpt"]


def test_pointers_resolve_to_their_target(root):
    url, options = root
    io = _io(options)
    directory = Location(url, storage_options=options)
    io.save_checkpoint(_checkpoint(4.0), url + "/epoch=0.ckpt")
    last, chained = directory.child("last.ckpt"), directory.child("latest.ckpt")
    last.write_pointer(directory.child("epoch=0.ckpt"))
    chained.write_pointer(last)
    assert last.read_pointer() == "epoch=0.ckpt"
    assert last.resolve().url == chained.resolve().url == directory.child("epoch=0.ckpt").url
    assert io.load_checkpoint(chained.url)["epoch"] == 4
    # A checkpoint named by its commit marker (an object that has a modification time) resolves to the directory.
    assert directory.child(f"epoch=0.ckpt/{COMMIT_FILE}").resolve().url.rstrip("/") == url + "/epoch=0.ckpt"
    # Not pointers: a checkpoint directory, a regular file.
    assert directory.child("epoch=0.ckpt").read_pointer() is None
    # Re-pointing replaces the pointer; a cycle is an error, not a hang.
    last.write_pointer(chained)
    with pytest.raises(NotACheckpointError, match="chain"):
        last.resolve()


def test_interrupted_overwrite_rolls_forward(root):
    url, options = root
    if Location(url, storage_options=options).local:
        pytest.skip("local commits are one atomic rename: there is no window to roll forward from")
    io = _io(options)
    target = Location(url + "/m.ckpt", storage_options=options)
    io.save_checkpoint(_checkpoint(1.0), target.url)
    staging = target.staging("0123456789ab")
    # A complete new version in the staging prefix, not yet copied into place. Saves refuse staging names, so it is
    # written under an ordinary name and its objects are copied there, as the interrupted save left them.
    written = Location(url + "/new.ckpt", storage_options=options)
    io.save_checkpoint(_checkpoint(2.0), written.url)
    for obj in written.fs.find(written.path):
        written.fs.copy(obj, staging.path + obj[len(written.path) :])
    written.remove()
    target.fs.rm_file(target.join(COMMIT_FILE))  # the crash happened after the old version was invalidated
    assert target.resolve().url == staging.url
    assert io.load_checkpoint(target.url)["epoch"] == 2
    target.commit_from(staging)
    assert target.resolve().url == target.url and io.load_checkpoint(target.url)["epoch"] == 2
    assert not staging.exists()


def test_missing_bucket_fails_clearly(root):
    url, options = root
    location = Location(url, storage_options=options)
    if location.bucket is None:
        pytest.skip("local disks and memory:// have no buckets")
    protocol = url.split("://", 1)[0]
    missing = f"{protocol}://no-such-bucket-{uuid.uuid4().hex[:6]}/run/a.ckpt"
    io = _io(options)
    with pytest.raises(BucketNotFoundError, match=r"no-such-bucket-\w+' .* does not exist. Create it"):
        io.save_checkpoint(_checkpoint(1.0), missing)
    with pytest.raises(BucketNotFoundError):
        io.load_checkpoint(missing)
    with pytest.raises(BucketNotFoundError):  # nothing created it on the way
        Location(missing, storage_options=options).parent().entries()


@pytest.mark.parametrize("store", ["s3", "az"])  # fake-gcs-server accepts any credentials: nothing to refuse
def test_wrong_credentials_fail_clearly(request, store):
    url, options, server = remote_bucket(request, store)
    bad = server.storage_options(**({"secret": "not-the-secret"} if store == "s3" else {"key": "bm90LXRoZS1rZXk="}))
    io = _io(bad)
    with pytest.raises(StorageAccessError) as err:
        io.save_checkpoint(_checkpoint(1.0), url + "/a.ckpt")
    message = str(err.value)
    hint = {"s3": "AWS_SECRET_ACCESS_KEY", "az": "connection_string"}[store]  # names the options that fix it
    assert url.split("://", 1)[1] in message and hint in message and isinstance(err.value, PermissionError)
    assert "not-the-secret" not in message and "bm90LXRoZS1rZXk=" not in message
    with pytest.raises(StorageAccessError):
        io.load_checkpoint(url + "/a.ckpt")
    assert not Location(url, storage_options=options).entries()  # nothing was written with the refused key
