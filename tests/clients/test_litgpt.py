"""litgpt's real ``pretrain`` through lightning_dcp's Fabric strategies (examples/litgpt_pretrain.py), against stock.

Every run is a real litgpt process (``python -m litgpt pretrain`` for stock, the wrapper for ours) with
``configs/litgpt_tiny.yaml`` on the standard library text of examples/litgpt_data.py; kills are real ``SIGKILL``s of
the run's process group. The runs set ``TORCH_COMPILE_DISABLE=1``: litgpt always compiles its model, and compiled runs
on CPU are not bit-reproducible (two stock runs of this config ended up to 4.2e-5 apart), while uncompiled ones are.

The reference for a resumed run is the uninterrupted run: litgpt's own resume of this config is exact too (a stock run
killed after its step-4 save and resumed ends bit-equal to the uninterrupted stock run; measured, docs/clients.md).

Needs litgpt and LitData (its ``TextFiles`` data module): ``python -m nox -s litgpt`` installs them and runs this.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("litgpt", reason="litgpt is not installed: `python -m nox -s litgpt` installs it and runs these")
pytest.importorskip("litdata", reason="LitData is not installed: `python -m nox -s litgpt` installs it")

from examples.litgpt_data import prepare  # noqa: E402
from lightning_dcp import consolidate, verify_checkpoint  # noqa: E402
from tests._trainer import assert_same  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "litgpt_tiny.yaml")
WRAPPER = str(ROOT / "examples" / "litgpt_pretrain.py")
SAVES = ("step-00000004", "step-00000008", "step-00000012", "final")
TWO = ["--devices", "2", "--train.global_batch_size", "8", "--train.micro_batch_size", "2"]
TWO += ["--train.save_interval", "2"]
"""Two CPU processes (our DDP strategy; litgpt's own FSDP refuses CPUs): 6 optimizer steps, a save every 2."""
LIMIT_S = 600


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The working directory of every run: ``litgpt_data/`` (text and tokenizer) as the config expects it."""
    work = tmp_path_factory.mktemp("litgpt")
    prepare(work / "litgpt_data")
    return work


def _run(work: Path, out: str, *args: str, stock: bool = False, kill_at: str | None = None) -> tuple[int, str]:
    """One ``pretrain`` into ``work/out``: its exit code and output. ``kill_at``: SIGKILL its process group (every
    rank) as soon as a line containing this text is printed."""
    program = ["-m", "litgpt"] if stock else [WRAPPER]
    cmd = [sys.executable, *program, "pretrain", "--config", CONFIG, "--out_dir", str(work / out), *args]
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    timer = threading.Timer(LIMIT_S, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if kill_at is not None and kill_at in line:
                os.killpg(proc.pid, signal.SIGKILL)
                break
        lines.extend(proc.stdout)
        rc = proc.wait()
    finally:
        timer.cancel()
    output = "".join(lines)
    with open(work / f"{out}.log", "a") as log:
        log.write(output)  # kept beside the runs for a failing test's reader
    return rc, output


def _succeeded(rc: int, output: str) -> None:
    assert rc == 0, output[-3000:]
    assert "Traceback" not in output and "terminate called" not in output, output[-3000:]


def _full(path: Path, tmp: Path) -> dict:
    """A checkpoint as one dict: a stock ``lit_model.pth`` file as is, ours consolidated first (``.pth`` beside)."""
    if path.is_dir():
        path = Path(consolidate(path, dst=tmp / f"{path.parent.name}-{path.parent.parent.name}.pth", overwrite=True))
    return torch.load(path, weights_only=True)


def _resumed_from(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("Resuming training from ")).split()[-1]


@pytest.fixture(scope="module")
def stock(work) -> Path:
    """litgpt's own run of the config (uninterrupted)."""
    _succeeded(*_run(work, "stock", stock=True))
    return work / "stock"


@pytest.fixture(scope="module")
def ours(work) -> Path:
    """The same run through examples/litgpt_pretrain.py (uninterrupted), with its output."""
    rc, output = _run(work, "ours")
    _succeeded(rc, output)
    (work / "ours.out").write_text(output)
    return work / "ours"


def test_pretrain_exits_0_with_every_checkpoint_committed(ours):
    output = (ours.parent / "ours.out").read_text()
    for name in SAVES:
        checkpoint = ours / name / "lit_model.pth"
        assert checkpoint.is_dir(), f"{checkpoint}: a DCP directory under litgpt's file name"
        verify_checkpoint(checkpoint)  # committed, every byte checked
        assert {"model_config.yaml", "hyperparameters.yaml", "tokenizer.json"} <= set(os.listdir(ours / name))
        assert f"lightning_dcp: checkpoint saved to {checkpoint}," in output
    # final/ is an async save that litgpt never waits for: the exit finished and committed it (verified above)


def test_every_checkpoint_equals_stock_once_consolidated(ours, stock, tmp_path):
    """Bit-for-bit: weights, optimizer state, ``iter_num``, ``step_count`` and the LitData loader's position."""
    for name in SAVES:
        mine, theirs = _full(ours / name / "lit_model.pth", tmp_path), _full(stock / name / "lit_model.pth", tmp_path)
        assert sorted(theirs) == ["iter_num", "model", "optimizer", "step_count", "train_dataloader"]
        assert_same(mine, theirs, name)


def test_kill_9_mid_training_then_resume_is_exact(work, ours, tmp_path):
    rc, output = _run(work, "killed", kill_at="iter 6 step 6")
    assert rc == -signal.SIGKILL, output[-2000:]
    assert sorted(os.listdir(work / "killed")) == ["logs", "step-00000004"]
    rc, output = _run(work, "killed", "--resume", "auto")
    _succeeded(rc, output)
    assert _resumed_from(output) == str(work / "killed" / "step-00000004" / "lit_model.pth")
    verify_checkpoint(work / "killed" / "final" / "lit_model.pth")
    resumed = _full(work / "killed" / "final" / "lit_model.pth", tmp_path)
    assert_same(resumed, _full(ours / "final" / "lit_model.pth", tmp_path), "final after kill -9 and resume")


def test_kill_9_during_an_async_save_then_resume_is_exact(work, ours, tmp_path):
    """Killed right after litgpt called ``fabric.save`` for step 8: what is left is never taken for a checkpoint."""
    step8 = work / "killed_saving" / "step-00000008" / "lit_model.pth"
    rc, output = _run(work, "killed_saving", kill_at=f"Saving checkpoint to '{step8}'")
    assert rc == -signal.SIGKILL, output[-2000:]
    committed = step8.exists()  # the commit may have landed before the signal: then it is a whole checkpoint
    if committed:
        verify_checkpoint(step8)
    else:  # an interrupted save leaves at most a hidden staging directory, which litgpt's `step-*/*.pth` glob skips
        assert [p.name for p in step8.parent.glob("*.pth")] == []
    rc, output = _run(work, "killed_saving", "--resume", "auto")
    _succeeded(rc, output)
    step4 = work / "killed_saving" / "step-00000004" / "lit_model.pth"
    assert _resumed_from(output) == str(step8 if committed else step4)
    resumed = _full(work / "killed_saving" / "final" / "lit_model.pth", tmp_path)
    assert_same(resumed, _full(ours / "final" / "lit_model.pth", tmp_path), "final after kill -9 mid-save and resume")


def test_stock_litgpt_resumes_and_generates_from_a_consolidated_checkpoint(work, ours, stock, tmp_path):
    """``python -m lightning_dcp.consolidate`` output is a stock ``lit_model.pth``: litgpt's own ``pretrain --resume``
    continues from it exactly, and ``litgpt generate`` loads it (it refuses our directory: ``lit_model.pth`` must be a
    file)."""
    folder = work / "from_ours" / "step-00000008"
    folder.mkdir(parents=True)
    for name in ("model_config.yaml", "hyperparameters.yaml", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ours / "step-00000008" / name, folder / name)
    rc = subprocess.run(
        [sys.executable, "-m", "lightning_dcp.consolidate", str(ours / "step-00000008" / "lit_model.pth")]
        + ["-o", str(folder / "lit_model.pth"), "--no-progress"],
        check=False,
    ).returncode
    assert rc == 0
    rc, output = _run(work, "from_ours", "--resume", "auto", stock=True)
    _succeeded(rc, output)
    assert _resumed_from(output) == str(folder / "lit_model.pth")
    resumed = _full(work / "from_ours" / "final" / "lit_model.pth", tmp_path)
    assert_same(resumed, _full(stock / "final" / "lit_model.pth", tmp_path), "stock resume from the consolidated .pth")

    def generate(checkpoint_dir: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "litgpt", "generate", str(checkpoint_dir), "--prompt", "def ", "--max_new_tokens"]
        cmd += ["16", "--precision", "32-true"]
        env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=LIMIT_S, check=False)

    theirs, mine = generate(stock / "step-00000008"), generate(folder)
    assert theirs.returncode == 0 and mine.returncode == 0, mine.stderr[-2000:]
    sample = mine.stdout[mine.stdout.index("\ndef ") :]  # after the arguments it prints (naming the folder)
    assert sample == theirs.stdout[theirs.stdout.index("\ndef ") :] and len(sample) > len("\ndef ")
    refused = generate(ours / "step-00000008")
    assert refused.returncode != 0 and "is missing the files: ['lit_model.pth']" in refused.stdout + refused.stderr


def test_two_processes_kill_9_then_resume_is_exact(work, tmp_path):
    """Two CPU processes under our DDP strategy (no stock reference: litgpt's FSDP refuses CPUs): the whole job killed
    after its step-4 save, resumed at 2 processes, ends bit-equal to the uninterrupted 2-process run."""
    _succeeded(*_run(work, "two", *TWO))
    for name in ("step-00000002", "step-00000004", "step-00000006", "final"):
        verify_checkpoint(work / "two" / name / "lit_model.pth")
    rc, output = _run(work, "two_killed", *TWO, kill_at="step 5 |")
    assert rc == -signal.SIGKILL, output[-2000:]
    committed = sorted(work.glob("two_killed/step-*/lit_model.pth"))
    assert committed and all(verify_checkpoint(path) is None for path in committed)
    rc, output = _run(work, "two_killed", *TWO, "--resume", "auto")
    _succeeded(rc, output)
    assert _resumed_from(output) == str(committed[-1])
    verify_checkpoint(work / "two_killed" / "final" / "lit_model.pth")
    full, resumed = (_full(work / run / "final" / "lit_model.pth", tmp_path) for run in ("two", "two_killed"))
    assert_same(resumed, full, "2-process final after kill -9 and resume")
