"""The package version comes from git, and every way of building the package still works (issue 51).

On 7471de6 every commit called itself 0.1.0. Built from a fresh clone, the wheel's version is setuptools-scm's for
that commit (``0.1.devN+g<hash>`` before the first release tag) and the commit is recorded in the package; an sdist
builds a wheel of the same version without git; sources without git (an archive) build with the fallback ``0.0``.
Real builds (``pip wheel`` through the PEP 517 backend, no build isolation: no index needed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

setuptools_scm = pytest.importorskip("setuptools_scm")
pytest.importorskip("setuptools")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args: str, cwd: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _wheel(source: str, out: str) -> tuple[str, str]:
    """Build a wheel of ``source`` into ``out``: its version (from the file name) and its ``_version.py``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, source],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (name,) = os.listdir(out)
    with zipfile.ZipFile(os.path.join(out, name)) as wheel:
        return name.split("-")[1], wheel.read("lightning_dcp/_version.py").decode()


def test_a_clone_an_sdist_and_an_archive_build_with_versions_from_git(tmp_path):
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout of the project")
    clone = str(tmp_path / "clone")
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", ROOT, clone], check=True)
    head = _git("rev-parse", "HEAD", cwd=clone)
    expected = setuptools_scm.get_version(root=clone)
    assert expected != "0.1.0" and head[:7] in expected
    if not _git("tag", "--list", cwd=clone):  # before the first release: the commits so far count up the version
        assert expected.startswith(f"0.1.dev{_git('rev-list', '--count', 'HEAD', cwd=clone)}+g")

    version, module = _wheel(clone, str(tmp_path / "from-clone"))
    assert version == expected and f"__version__ = version = {expected!r}" in module
    assert "commit_id = 'g" + head[:7] in module  # the commit the build saw

    sdist_dir = str(tmp_path / "sdist")
    subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({sdist_dir!r})"],
        cwd=clone,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (sdist,) = os.listdir(sdist_dir)
    with tarfile.open(os.path.join(sdist_dir, sdist)) as archive:
        archive.extractall(str(tmp_path / "unpacked"), filter="data")
    (unpacked,) = os.listdir(tmp_path / "unpacked")
    assert not os.path.exists(tmp_path / "unpacked" / unpacked / ".git")
    assert _wheel(str(tmp_path / "unpacked" / unpacked), str(tmp_path / "from-sdist"))[0] == expected

    archive_dir = str(tmp_path / "archive")
    os.makedirs(archive_dir)
    tar = subprocess.run(["git", "archive", "HEAD"], cwd=clone, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", archive_dir], input=tar, check=True)
    assert _wheel(archive_dir, str(tmp_path / "from-archive"))[0] == "0.0"  # the fallback: it still builds
