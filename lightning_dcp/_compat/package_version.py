"""Which lightning_dcp this is: its version, and the commit of the code that runs, recorded in every checkpoint.

The version comes from git when the package is built (setuptools-scm, ``pyproject.toml``): a release tag gives its
version (``0.2.0``), a commit after it ``0.2.1.dev3+g1a2b3c4`` (``0.1.devN+g...`` before the first tag, ``N`` the
commits so far). The build writes it, with the commit, into ``lightning_dcp/_version.py`` (generated, not in git); a
build from an sdist keeps the sdist's, one from sources without git the fallback ``0.0``. A source tree imported
without being built or installed has no such file: its version is ``0+unknown``.

The commit is read from git at run time when the package is imported from a git checkout of this project (an
editable install or a source tree), since its ``_version.py`` is only as new as the last install; ``-dirty`` marks
uncommitted changes to tracked files. Elsewhere (a wheel, an sdist) it is the commit the build recorded, if any.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess

__all__ = ["UNKNOWN_VERSION", "commit_id", "version"]

UNKNOWN_VERSION = "0+unknown"
"""The version of a source tree that was never built (no ``_version.py``)."""
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROJECT = 'name = "lightning-dcp"'


def _built() -> object | None:
    try:
        return importlib.import_module("lightning_dcp._version")  # written by the build; absent in a bare tree
    except ImportError:
        return None


@functools.cache
def version() -> str:
    """The package version the build derived from git (``0+unknown`` for a source tree never built)."""
    built = _built()
    found = getattr(built, "version", None)
    return found if isinstance(found, str) and found else UNKNOWN_VERSION


@functools.cache
def commit_id() -> str | None:
    """The commit of the code that runs, where known.

    The checkout's (40 hex digits, ``-dirty`` when tracked files changed), else the one the build recorded (its short
    form), else ``None``. Reads git at most once per process.
    """
    checkout = _checkout_commit()
    if checkout is not None:
        return checkout
    recorded = getattr(_built(), "commit_id", None)
    if isinstance(recorded, str) and recorded:
        return recorded.removeprefix("g")  # setuptools-scm writes git's short id as "g1a2b3c4"
    return None


def _checkout_commit() -> str | None:
    """``git describe`` of the project checkout the package is imported from; ``None`` when it is not one."""
    root = os.path.dirname(_PACKAGE_DIR)
    try:
        with open(os.path.join(root, "pyproject.toml")) as f:
            if _PROJECT not in f.read():
                return None
    except OSError:
        return None
    if not os.path.exists(os.path.join(root, ".git")):  # a directory, or a file in a worktree
        return None
    try:
        result = subprocess.run(
            ["git", "-C", root, "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = result.stdout.strip()
    return found if result.returncode == 0 and found else None
