"""Several runs in one checkpoint directory: ``ckpt_path="last"`` resumes the run it designates, never another's.

Each fit is its own process (a run: a process that starts fresh begins one, a process that resumes continues the
run it resumed). Run A (one architecture) saves with ``save_last="link"``; run B (another architecture, started
fresh into the same ``dirpath``) saves newer checkpoints there without a ``last`` link of its own. ``last.ckpt``
still names A's newest: A resumes from it, where "the directory's newest" (B's) could not even be loaded into A's
model (``StateDictMismatchError``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fit(dirpath: str, model: str, *, filename: str, max_steps: int, ckpt_path=None, save_last="link") -> tuple:
    config = {
        "dirpath": dirpath,
        "model": model,
        "filename": filename,
        "save_last": save_last,
        "max_steps": max_steps,
        "ckpt_path": ckpt_path,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration._runs_train", json.dumps(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    start = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("START "))
    return start, done.stderr


def test_last_follows_its_own_run_past_a_newer_run_in_the_same_directory(tmp_path):
    dirpath = str(tmp_path)
    _fit(dirpath, "a", filename="a-{step}", max_steps=8)  # run A: a-step=4, a-step=8, last.ckpt -> a-step=8
    _fit(dirpath, "b", filename="b-{step}", max_steps=12, save_last=False)  # run B: newer, another architecture
    start, _ = _fit(dirpath, "a", filename="a-{step}", max_steps=12, ckpt_path="last")
    assert start == 8  # A's newest, not B's step 12
    assert os.path.realpath(os.path.join(dirpath, "last.ckpt")) == os.path.join(dirpath, "a-step=12.ckpt")


@pytest.mark.full
def test_last_lagging_behind_its_own_run_takes_the_runs_newest(tmp_path):
    dirpath = str(tmp_path)
    _fit(dirpath, "a", filename="a-{step}", max_steps=8)
    os.unlink(os.path.join(dirpath, "last.ckpt"))
    os.symlink("a-step=4.ckpt", os.path.join(dirpath, "last.ckpt"))  # a link one save behind (a kill before relink)
    start, stderr = _fit(dirpath, "a", filename="a-{step}", max_steps=12, ckpt_path="last")
    assert start == 8
    assert "but a newer checkpoint is committed" in stderr


def test_without_a_last_entry_the_newest_run_resumes_and_the_others_are_named(tmp_path):
    dirpath = str(tmp_path)
    _fit(dirpath, "b", filename="b-{step}", max_steps=4, save_last=False)  # run B
    _fit(dirpath, "a", filename="a-{step}", max_steps=8)  # run A: newer
    os.unlink(os.path.join(dirpath, "last.ckpt"))
    start, stderr = _fit(dirpath, "a", filename="a-{step}", max_steps=12, ckpt_path="last")
    assert start == 8
    assert "names a committed checkpoint, and 2 runs saved into it" in stderr
