"""A checkpoint records which code wrote it: the torch, Lightning and lightning_dcp versions and the commit (issue 51).

On 7471de6 every commit called itself 0.1.0 and a checkpoint recorded only the torch and Lightning versions. Now the
version comes from git at build time (setuptools-scm; tests/integration/test_packaging.py builds it), and a save
records it with the commit of the code that ran; ``inspect`` shows both.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess

import torch

import lightning_dcp
from lightning_dcp import DCPCheckpointIO, inspect_checkpoint
from lightning_dcp._compat import package_version
from lightning_dcp.inspect import main as inspect_main

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(lightning_dcp.__file__)))


def _expected_commit() -> str | None:
    """What the commit must be, asked of git here: the checkout's HEAD (and -dirty), or the build's record."""
    if os.path.exists(os.path.join(PACKAGE_ROOT, ".git")) and shutil.which("git"):
        head = subprocess.run(["git", "-C", PACKAGE_ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
        changed = subprocess.run(
            ["git", "-C", PACKAGE_ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
        return head.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")
    try:
        from lightning_dcp import _version  # written by the build
    except ImportError:
        return None
    return str(_version.commit_id).removeprefix("g") if getattr(_version, "commit_id", None) else None


def test_a_checkpoint_records_the_versions_and_the_commit_that_wrote_it(tmp_path, capsys):
    path = str(tmp_path / "step=1.ckpt")
    DCPCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "global_step": 1}, path)
    versions = inspect_checkpoint(path)["versions"]
    assert versions == {
        "torch": str(torch.__version__),
        "lightning": importlib.metadata.version("lightning"),
        "lightning_dcp": lightning_dcp.__version__,
        "lightning_dcp_commit": _expected_commit(),
    }
    assert lightning_dcp.__version__ == package_version.version() != "0.1.0"
    loaded = DCPCheckpointIO().load_checkpoint(path)
    assert loaded["lightning_dcp"]["lightning_dcp_version"] == lightning_dcp.__version__  # what hooks see at load
    assert inspect_main([path]) == 0
    commit = f" (commit {versions['lightning_dcp_commit']})" if versions["lightning_dcp_commit"] else ""
    assert f"written by   lightning_dcp {lightning_dcp.__version__}{commit}, torch {torch.__version__}," in (
        capsys.readouterr().out
    )


def test_a_checkpoint_from_before_the_record_shows_what_it_has(tmp_path, capsys):
    from lightning_dcp.engine.checkpointer import Checkpointer

    path = str(tmp_path / "old.ckpt")
    Checkpointer().save({"state_dict": {"w": torch.zeros(2)}}, path, objects={"global_step": 1})
    assert inspect_checkpoint(path)["versions"]["lightning_dcp"] == lightning_dcp.__version__
    plain = str(tmp_path / "plain")
    torch.distributed.checkpoint.save({"w": torch.zeros(2)}, checkpoint_id=plain, no_dist=True)
    assert inspect_checkpoint(plain)["versions"] == dict.fromkeys(
        ("torch", "lightning", "lightning_dcp", "lightning_dcp_commit")
    )
    assert inspect_main([plain]) == 0 and "written by   not recorded" in capsys.readouterr().out
