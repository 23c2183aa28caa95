"""Local files: the one atomic small-file write (``replace_file``); the local commit across filesystems (``EXDEV``),
on real mounts: a tmpfs, and an overlayfs whose lower layer holds the checkpoint being replaced (as in a container
image). The mounts are skipped where this process may not mount (needs root)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator

import pytest
import torch

from lightning_dcp import DCPCheckpointIO, verify_checkpoint
from lightning_dcp.engine.storage.localfs import replace_directory, replace_file


def test_replace_file_swaps_the_whole_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "pointer"
    replace_file(str(path), b"first")
    replace_file(str(path), b"second, longer")
    assert path.read_bytes() == b"second, longer" and os.listdir(path.parent) == ["pointer"]


def test_replace_file_that_fails_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "manifest"
    replace_file(str(path), b"old")
    with pytest.raises(TypeError):
        replace_file(str(path), "not bytes")  # type: ignore[arg-type]  # fails inside the write
    os.makedirs(tmp_path / "a-dir")
    with pytest.raises(IsADirectoryError):
        replace_file(str(tmp_path / "a-dir"), b"new")
    assert path.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["a-dir", "manifest"]


def test_replace_file_removes_a_directory_only_once_the_new_file_is_on_disk(tmp_path):
    checkpoint = tmp_path / "last.ckpt"  # a checkpoint directory that a pointer object replaces
    os.makedirs(checkpoint)
    (checkpoint / ".commit").write_bytes(b"{}")
    with pytest.raises(TypeError):
        replace_file(str(checkpoint), "not bytes", replace_directory=True)  # type: ignore[arg-type]
    assert os.listdir(checkpoint) == [".commit"] and os.listdir(tmp_path) == ["last.ckpt"]  # the write failed first
    replace_file(str(checkpoint), b"pointer", replace_directory=True)
    assert checkpoint.read_bytes() == b"pointer" and os.listdir(tmp_path) == ["last.ckpt"]


@contextlib.contextmanager
def _mounted(args: list[str], target: str) -> Iterator[None]:
    os.makedirs(target, exist_ok=True)
    result = subprocess.run(["mount", *args, target], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount here ({result.stderr.strip() or result.returncode})")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", target], check=False)


def _tree(path: str) -> dict[str, bytes]:
    out = {}
    for directory, _, files in os.walk(path):
        for name in files:
            full = os.path.join(directory, name)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


@pytest.mark.parametrize("chmod", ["allowed", "refused"])
def test_replace_directory_copies_across_filesystems(tmp_path, chmod, monkeypatch):
    if chmod == "refused":  # as on mounts that refuse permission changes (Lightning's cross-device test does this)
        monkeypatch.setattr(os, "chmod", lambda *a, **k: (_ for _ in ()).throw(PermissionError("not permitted")))
    mnt = str(tmp_path / "tmpfs")
    with _mounted(["-t", "tmpfs", "-o", "size=16m", "tmpfs"], mnt):
        src = os.path.join(mnt, "staging")
        os.makedirs(os.path.join(src, "sub"))
        for name, data in (("a", b"new-a"), ("sub/b", b"new-b")):
            with open(os.path.join(src, name), "wb") as f:
                f.write(data)
        dst = str(tmp_path / "disk" / "step=2.ckpt")
        os.makedirs(tmp_path / "disk")
        with pytest.raises(OSError) as rename:  # the situation is real: the kernel refuses the rename
            os.rename(src, dst)
        assert rename.value.errno == errno.EXDEV
        os.makedirs(dst)
        with open(os.path.join(dst, "old"), "wb") as f:
            f.write(b"old")
        expected = _tree(src)
        replace_directory(src, dst)
        assert _tree(dst) == expected and not os.path.exists(src)
        assert sorted(os.listdir(tmp_path / "disk")) == ["step=2.ckpt"]  # no hidden copy or old version left


def test_save_over_a_checkpoint_in_an_overlay_lower_layer(tmp_path):
    lower, upper, work, merged = (str(tmp_path / n) for n in ("lower", "upper", "work", "merged"))
    for d in (lower, upper, work):
        os.makedirs(d)
    DCPCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "step": 1}, f"{lower}/run/a.ckpt")
    with _mounted(["-t", "overlay", "overlay", "-o", f"lowerdir={lower},upperdir={upper},workdir={work}"], merged):
        with pytest.raises(OSError) as rename:  # overlayfs cannot rename a lower-layer directory
            os.rename(f"{merged}/run/a.ckpt", f"{merged}/run/moved")
        assert rename.value.errno == errno.EXDEV
        io = DCPCheckpointIO()
        io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "step": 2}, f"{merged}/run/a.ckpt")
        loaded = io.load_checkpoint(f"{merged}/run/a.ckpt")
        assert torch.equal(loaded["state_dict"]["w"], torch.ones(4)) and loaded["step"] == 2
        verify_checkpoint(f"{merged}/run/a.ckpt")
        assert os.listdir(f"{merged}/run") == ["a.ckpt"]
