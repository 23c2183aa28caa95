"""litgpt's real ``pretrain`` through lightning_dcp's Fabric strategies (examples/litgpt_pretrain.py), against stock.

The command lines are docs/clients.md's (the blocks whose ``norun`` note names this file), run as written in a working
directory where ``examples/`` and ``configs/`` are the repository's and ``python`` and ``litgpt`` are this Python's;
only ``--out_dir`` changes from run to run, and a few runs append litgpt options. Every run is a real litgpt process
(stock ``litgpt pretrain`` or ours) with ``configs/litgpt_tiny.yaml`` on the standard library text that
examples/litgpt_data.py writes; kills are real ``SIGKILL``s of the run's process group.

The runs set ``TORCH_COMPILE_DISABLE=1``: litgpt always compiles its model, and compiled runs on CPU are not
bit-reproducible (two stock runs of this config ended up to 4.2e-5 apart), while uncompiled ones are. They also set
``OMP_NUM_THREADS=1``: on two cores shared with other work a step of this model took 0.7 s with two threads and 11 ms
with one (the same values either way; both sides of each comparison run alike).

The reference for a resumed run is the uninterrupted run: litgpt's own resume of this config is exact (a stock run
resumed from a checkpoint ends bit-equal to the uninterrupted stock run; the consolidation test below shows it).

Needs litgpt and LitData (its ``TextFiles`` data module): ``python -m nox -s litgpt`` installs them and runs this.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("litgpt", reason="litgpt is not installed: `python -m nox -s litgpt` installs it and runs these")
pytest.importorskip("litdata", reason="LitData is not installed: `python -m nox -s litgpt` installs it")

from lightning_dcp import consolidate, verify_checkpoint  # noqa: E402
from tests._docs import ROOT, blocks, commands  # noqa: E402
from tests._trainer import assert_same  # noqa: E402

DOCUMENT = "docs/clients.md"
SAVES = ("step-00000004", "step-00000008", "step-00000012", "final")
TWO = ["--devices", "2", "--train.global_batch_size", "8", "--train.micro_batch_size", "2"]
TWO += ["--train.save_interval", "2"]
"""Two CPU processes (our DDP strategy; litgpt's own FSDP refuses CPUs): 6 optimizer steps, a save every 2."""
SHORT = ["--train.max_tokens", "1024", "--train.save_interval", "2"]
"""4 optimizer steps, saves at steps 2 and 4, then ``final/``: the runs of the exit-code loop."""
RUNS = int(os.environ.get("LIGHTNING_DCP_LITGPT_RUNS", "5"))
"""How many runs the exit-code loop makes."""
LIMIT_S = 600
ENV = {"TORCH_COMPILE_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _documented() -> dict[str, list[str]]:
    """docs/clients.md's commands by role: ``data``, ``stock``, ``ours``, ``verify``, ``resume``, ``consolidate``,
    ``copy``, ``generate`` (the blocks whose ``norun`` note names this file)."""
    found = [b for b in blocks(DOCUMENT) if b.reason and "test_litgpt.py" in b.reason]
    assert found, f"{DOCUMENT}: the blocks this test runs are gone"
    roles: dict[str, list[str]] = {}
    for argv in (argv for block in found for argv in commands(block.code)):
        if argv[:2] == ["python", "examples/litgpt_data.py"]:
            roles["data"] = argv
        elif argv[:2] == ["litgpt", "pretrain"]:
            roles["stock"] = argv
        elif argv[:2] == ["python", "examples/litgpt_pretrain.py"]:
            roles["resume" if "--resume" in argv else "ours"] = argv
        elif argv[:3] == ["python", "-m", "lightning_dcp.verify"]:
            roles["verify"] = argv
        elif argv[:3] == ["python", "-m", "lightning_dcp.consolidate"]:
            roles["consolidate"] = argv
        elif argv[:2] == ["litgpt", "generate"]:
            roles["generate"] = argv
        elif argv[0] == "cp":
            roles["copy"] = argv
    missing = {"data", "stock", "ours", "verify", "resume", "consolidate", "copy", "generate"} - set(roles)
    assert not missing, f"{DOCUMENT}: no documented command for {sorted(missing)}"
    stock, ours = (argv[: argv.index("--out_dir")] for argv in (roles["stock"], roles["ours"]))
    assert stock[1:] == ours[2:], "ours must be stock's command line with `litgpt` replaced (and another --out_dir)"
    return roles


DOCUMENTED = _documented()


def _env() -> dict[str, str]:
    """``python`` and ``litgpt`` on the ``PATH`` are this interpreter's (its environment's ``bin``)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return {**os.environ, **ENV, "PATH": path}


def _moved(argv: list[str], moves: dict[str, Path]) -> list[str]:
    """``argv`` with each argument under a documented folder (a key of ``moves``: ``out/pretrain``) moved to its
    value (``moves`` in order: the first that matches)."""
    out = []
    for arg in argv:
        old = next((old for old in moves if arg == old or arg.startswith(f"{old}/")), None)
        out.append(arg if old is None else str(moves[old]) + arg[len(old) :])
    return out


def _out_dir(role: str) -> str:
    """The ``--out_dir`` of the documented ``pretrain`` ``role``."""
    argv = DOCUMENTED[role]
    return argv[argv.index("--out_dir") + 1]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The working directory of every run: the repository's ``examples/`` and ``configs/``, and ``litgpt_data/``
    written by the documented command."""
    work = tmp_path_factory.mktemp("litgpt")
    for name in ("examples", "configs"):
        (work / name).symlink_to(Path(ROOT) / name)
    subprocess.run(DOCUMENTED["data"], cwd=work, env=_env(), check=True, timeout=LIMIT_S)
    return work


def _run(work: Path, out: str, *args: str, role: str = "ours", kill_at: str | None = None) -> tuple[int, str]:
    """One documented ``pretrain`` (``role``: ``ours``, ``stock`` or ``resume``) into ``work/out``, ``args``
    appended: its exit code and output. ``kill_at``: SIGKILL its process group (every rank) as soon as a line
    containing this text is printed."""
    cmd = [*_moved(DOCUMENTED[role], {_out_dir(role): work / out}), *args]
    proc = subprocess.Popen(
        cmd, cwd=work, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
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
        dst = tmp / f"{path.parent.parent.name}-{path.parent.name}.pth"
        path = Path(consolidate(path, dst=dst, overwrite=True))
    return torch.load(path, weights_only=True)


def _resumed_from(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("Resuming training from ")).split()[-1]


def _committed(run: Path) -> list[Path]:
    """The ``step-*/lit_model.pth`` that litgpt's ``--resume auto`` can find (an interrupted save leaves only a hidden
    staging directory), each verified, oldest first."""
    found = sorted(run.glob("step-*/lit_model.pth"))
    for path in found:
        verify_checkpoint(path)
    return found


@pytest.fixture(scope="module")
def stock(work) -> Path:
    """litgpt's own run of the config (uninterrupted)."""
    _succeeded(*_run(work, "stock", role="stock"))
    return work / "stock"


@pytest.fixture(scope="module")
def ours(work) -> Path:
    """The same run through examples/litgpt_pretrain.py (uninterrupted), its output in ``ours.out``."""
    rc, output = _run(work, "ours")
    _succeeded(rc, output)
    (work / "ours.out").write_text(output)
    return work / "ours"


def test_pretrain_exits_0_with_every_checkpoint_committed(work, ours):
    output = (work / "ours.out").read_text()
    for name in SAVES:
        checkpoint = ours / name / "lit_model.pth"
        assert checkpoint.is_dir(), f"{checkpoint}: a DCP directory under litgpt's file name"
        verify_checkpoint(checkpoint)  # committed, every byte checked
        assert {"model_config.yaml", "hyperparameters.yaml", "tokenizer.json"} <= set(os.listdir(ours / name))
        assert f"lightning_dcp: checkpoint saved to {checkpoint}," in output
    # final/ is an async save that litgpt never waits for: the exit finished and committed it; the documented check
    cmd = _moved(DOCUMENTED["verify"], {_out_dir("ours"): ours})
    assert cmd[3:] == [str(ours / "final" / "lit_model.pth")]
    verify = subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, check=False)
    assert verify.returncode == 0 and verify.stdout.startswith("OK: "), verify.stdout + verify.stderr


def test_every_checkpoint_equals_stock_once_consolidated(ours, stock, tmp_path):
    """Bit for bit: weights, optimizer state, ``iter_num``, ``step_count`` and the LitData loader's position."""
    for name in SAVES:
        mine, theirs = _full(ours / name / "lit_model.pth", tmp_path), _full(stock / name / "lit_model.pth", tmp_path)
        assert sorted(theirs) == ["iter_num", "model", "optimizer", "step_count", "train_dataloader"]
        assert theirs["step_count"] == (12 if name == "final" else int(name.split("-")[1]))
        assert_same(mine, theirs, name)


def test_the_printed_losses_equal_stock(work, ours, stock):
    """The training loss litgpt prints at every step, ours against stock's (12 steps, same values to the digit)."""

    def losses(log: str) -> list[str]:
        return [line.split("loss train: ")[1].split(",")[0] for line in log.splitlines() if "loss train: " in line]

    mine, theirs = losses((work / "ours.log").read_text()), losses((work / "stock.log").read_text())
    assert len(theirs) == 12 and mine == theirs


def test_repeated_runs_all_exit_0_with_a_committed_final_save(work, tmp_path):
    """The exit that joins the last async save, counted: ``RUNS`` short runs (saves at 2, 4, final), every exit code
    0, no ``terminate called`` (the abort behind the exit 134 of issue 51), every ``final/`` committed and all equal."""
    codes: collections.Counter[int] = collections.Counter()
    aborts = 0
    finals = []
    for i in range(RUNS):
        rc, output = _run(work, f"loop{i}", *SHORT)
        codes[rc] += 1
        aborts += "terminate called" in output
        final = work / f"loop{i}" / "final" / "lit_model.pth"
        verify_checkpoint(final)
        finals.append(_full(final, tmp_path))
    assert codes == {0: RUNS} and aborts == 0, (dict(codes), aborts)
    for i, final in enumerate(finals[1:], 1):
        assert_same(final, finals[0], f"loop{i} final")
    assert finals[0]["iter_num"] == 4 and finals[0]["step_count"] == 4


def test_kill_9_mid_training_then_resume_is_exact(work, ours, tmp_path):
    """Killed at step 10: the step-4 save is committed (the step-8 save waited for it), the step-8 one may be; the
    documented ``--resume auto`` continues from the newest committed one and ends bit-equal to the uninterrupted run."""
    rc, output = _run(work, "killed", kill_at="iter 10 step 10")
    assert rc == -signal.SIGKILL, output[-2000:]
    committed = _committed(work / "killed")
    assert committed[0] == work / "killed" / "step-00000004" / "lit_model.pth", committed
    rc, output = _run(work, "killed", role="resume")
    _succeeded(rc, output)
    assert _resumed_from(output) == str(committed[-1])
    assert "Epoch 1 | iter 1 step 1 " not in output  # it did not start over
    verify_checkpoint(work / "killed" / "final" / "lit_model.pth")
    resumed = _full(work / "killed" / "final" / "lit_model.pth", tmp_path)
    assert_same(resumed, _full(ours / "final" / "lit_model.pth", tmp_path), "final after kill -9 and resume")


def test_kill_9_during_an_async_save_then_resume_is_exact(work, ours, tmp_path):
    """Killed right after litgpt called ``fabric.save`` for step 8: what is left is never taken for a checkpoint."""
    step8 = work / "killed_saving" / "step-00000008" / "lit_model.pth"
    rc, output = _run(work, "killed_saving", kill_at=f"Saving checkpoint to '{step8}'")
    assert rc == -signal.SIGKILL, output[-2000:]
    committed = _committed(work / "killed_saving")
    assert committed[0].parent.name == "step-00000004" and committed[-1] in (committed[0], step8), committed
    rc, output = _run(work, "killed_saving", role="resume")
    _succeeded(rc, output)
    assert _resumed_from(output) == str(committed[-1])
    resumed = _full(work / "killed_saving" / "final" / "lit_model.pth", tmp_path)
    assert_same(resumed, _full(ours / "final" / "lit_model.pth", tmp_path), "final after kill -9 mid-save and resume")


def test_consolidated_checkpoint_is_stock_litgpt_s(work, ours, stock, tmp_path):
    """The documented ``python -m lightning_dcp.consolidate`` writes a stock ``lit_model.pth``: litgpt's own
    ``pretrain --resume`` continues from it exactly, and the documented ``litgpt generate`` loads it and samples what it
    samples from stock's (it refuses our directory: ``lit_model.pth`` must be a file)."""
    folder = work / "from_ours" / "step-00000008"
    documented = DOCUMENTED["consolidate"]  # final/ into a litgpt folder; here step 8 (to resume), as documented
    final, consolidated = documented[3], documented[documented.index("-o") + 1]
    assert final == f"{_out_dir('ours')}/final/lit_model.pth"
    moves = {f"{_out_dir('ours')}/final": ours / "step-00000008", os.path.dirname(consolidated): folder}
    for role in ("consolidate", "copy"):
        subprocess.run(_moved(DOCUMENTED[role], moves), cwd=work, env=_env(), check=True, timeout=LIMIT_S)
    assert sorted(os.listdir(folder)) == [
        "lit_model.pth",
        "model_config.yaml",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (folder / "lit_model.pth").is_file()
    rc, output = _run(work, "from_ours", "--resume", "auto", role="stock")
    _succeeded(rc, output)
    assert _resumed_from(output) == str(folder / "lit_model.pth")
    resumed = _full(work / "from_ours" / "final" / "lit_model.pth", tmp_path)
    assert_same(resumed, _full(stock / "final" / "lit_model.pth", tmp_path), "stock resume from the consolidated .pth")

    def generate(checkpoint_dir: Path) -> subprocess.CompletedProcess:
        cmd = [*DOCUMENTED["generate"][:2], str(checkpoint_dir), *DOCUMENTED["generate"][3:]]  # the folder moved
        return subprocess.run(cmd, cwd=work, env=_env(), capture_output=True, text=True, timeout=LIMIT_S, check=False)

    theirs, mine = generate(stock / "step-00000008"), generate(folder)
    assert theirs.returncode == 0 and mine.returncode == 0, mine.stderr[-2000:]
    sample = mine.stdout[mine.stdout.index("\ndef ") :]  # after the arguments it prints (naming the folder)
    assert sample == theirs.stdout[theirs.stdout.index("\ndef ") :] and len(sample) > len("\ndef ")
    refused = generate(ours / "step-00000008")
    assert refused.returncode != 0 and "is missing the files: ['lit_model.pth']" in refused.stdout + refused.stderr


def test_two_processes_kill_9_then_resume_is_exact(work, tmp_path):
    """Two CPU processes under our DDP strategy (no stock reference: litgpt's FSDP refuses CPUs): the whole job killed
    at step 5, resumed at 2 processes from the newest committed save, ends bit-equal to the uninterrupted 2-process
    run."""
    _succeeded(*_run(work, "two", *TWO))
    for name in ("step-00000002", "step-00000004", "step-00000006", "final"):
        verify_checkpoint(work / "two" / name / "lit_model.pth")
    rc, output = _run(work, "two_killed", *TWO, kill_at="step 5 |")
    assert rc == -signal.SIGKILL, output[-2000:]
    committed = _committed(work / "two_killed")
    assert committed and committed[0].parent.name == "step-00000002", committed
    rc, output = _run(work, "two_killed", *TWO, role="resume")
    _succeeded(rc, output)
    assert _resumed_from(output) == str(committed[-1])
    verify_checkpoint(work / "two_killed" / "final" / "lit_model.pth")
    full, resumed = (_full(work / run / "final" / "lit_model.pth", tmp_path) for run in ("two", "two_killed"))
    assert_same(resumed, full, "2-process final after kill -9 and resume")
