"""``kill -9`` of a Fabric run while an async save is being written: the run resumes from a committed checkpoint
and ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

from harness.ranks import port_env
from lightning_dcp import verify_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 5


def _start(directory: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration._fabric_kill_train", directory, str(STEPS)],
        cwd=ROOT,
        env=port_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _finish(proc: subprocess.Popen, directory: str) -> dict:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-3000:]
    return torch.load(os.path.join(directory, "final.pt"), weights_only=True)


def _in_progress(ckpt_dir: str) -> list[str]:
    """Saves under way or cut short: hidden staging, or a checkpoint directory written in place without .commit."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(n for n in os.listdir(ckpt_dir) if not os.path.isfile(os.path.join(ckpt_dir, n, ".commit")))


def test_kill_during_async_save_resumes_exactly(tmp_path):
    uninterrupted = _start(str(tmp_path / "reference"))  # runs beside the one that is killed
    directory = str(tmp_path / "run")
    ckpt_dir = os.path.join(directory, "ckpts")
    proc = _start(directory)
    deadline = time.monotonic() + 120
    # kill as soon as the background write of a save after the second one is under way
    while not any(n.lstrip(".") > "step-0002" for n in _in_progress(ckpt_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, (
            f"the run ended before it was killed: {proc.stderr.read().decode()[-3000:] if proc.poll() else ''}"
        )
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    left = _in_progress(ckpt_dir)
    assert left, "the kill was meant to hit a save in flight"
    committed = sorted(n for n in os.listdir(ckpt_dir) if os.path.isfile(os.path.join(ckpt_dir, n, ".commit")))
    assert committed and len(committed) < STEPS
    for name in committed:  # every checkpoint that looks complete is complete, byte for byte
        verify_checkpoint(os.path.join(ckpt_dir, name))
    assert not set(left) & set(committed)  # the interrupted save never became a checkpoint

    final = _finish(_start(directory), directory)  # resumes from the newest committed checkpoint
    reference = _finish(uninterrupted, str(tmp_path / "reference"))
    assert final.keys() == reference.keys()
    for key in reference:
        assert torch.equal(final[key], reference[key]), key
    assert not _in_progress(ckpt_dir)  # the resumed run's saves of the same names replaced what the kill left
