"""The output door: ``consolidate -o PATH --overwrite`` replaces an earlier output, never a directory, a checkpoint or a
special file; temporaries of a killed run are cleaned by the next one (issue 21.7), through the CLI as users run it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from lightning_dcp import DCPCheckpointIO, OutputExistsError, consolidate, verify_checkpoint
from lightning_dcp.consolidate import main


@pytest.fixture
def checkpoint(tmp_path):
    path = str(tmp_path / "step=7.ckpt")
    weights = {f"layer{i}.weight": torch.randn(32, 32) for i in range(3)}
    DCPCheckpointIO().save_checkpoint({"state_dict": weights, "global_step": 7}, path)
    return path, weights


def _tree(path) -> dict[str, bytes]:
    found = {}
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                found[os.path.relpath(os.path.join(root, name), path)] = f.read()
    return found


@pytest.mark.parametrize("slash", ["", "/"])
@pytest.mark.parametrize("extra", [[], ["--max-shard-size", "5KB"], ["--format", "safetensors"]])
def test_overwrite_never_deletes_a_directory(checkpoint, tmp_path, capsys, slash, extra):
    src, _ = checkpoint
    precious = tmp_path / "results"
    (precious / "sub").mkdir(parents=True)
    (precious / "notes.txt").write_text("a week of results")
    (precious / "sub" / "model-00001-of-00001.safetensors").write_bytes(b"not ours")
    before = _tree(precious)
    assert main([src, "-o", str(precious) + slash, "--overwrite", "--no-progress", *extra]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "never replaced" in err and str(precious) in err
    assert _tree(precious) == before
    with pytest.raises(OutputExistsError, match="is a directory"):
        consolidate(src, dst=str(precious), overwrite=True)


def test_overwrite_never_replaces_a_checkpoint(checkpoint, tmp_path):
    src, _ = checkpoint
    other = str(tmp_path / "step=9.ckpt")
    DCPCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 9}, other)
    for extra in ([], ["--max-shard-size", "1KB"]):
        assert main([src, "-o", other, "--overwrite", "--no-progress", *extra]) == 1
    verify_checkpoint(other)
    with pytest.raises(OutputExistsError, match="is a checkpoint"):
        consolidate(src, dst=other, overwrite=True)


def test_overwrite_replaces_an_earlier_output_of_the_same_kind(checkpoint, tmp_path):
    src, weights = checkpoint
    out = tmp_path / "model.ckpt"
    out.write_bytes(b"an earlier export")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        consolidate(src, dst=str(out))
    assert out.read_bytes() == b"an earlier export"
    consolidate(src, dst=str(out), overwrite=True, progress=False)
    assert torch.equal(torch.load(out, weights_only=True)["state_dict"]["layer0.weight"], weights["layer0.weight"])
    sharded = tmp_path / "sharded"
    consolidate(src, dst=str(sharded), max_shard_size="5KB", progress=False)
    first = sorted(os.listdir(sharded))
    assert "model.safetensors.index.json" in first and len(first) > 2
    consolidate(src, dst=str(sharded), max_shard_size="100KB", overwrite=True, progress=False)  # its own output
    second = sorted(os.listdir(sharded))
    assert second == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert torch.equal(load_file(str(sharded / second[0]))["layer2.weight"], weights["layer2.weight"])


def test_a_fifo_at_the_output_is_refused_without_blocking(checkpoint, tmp_path):
    src, _ = checkpoint
    fifo = tmp_path / "out.ckpt"
    os.mkfifo(fifo)
    done = threading.Event()
    result = {}

    def run():
        result["code"] = main([src, "-o", str(fifo), "--overwrite", "--no-progress"])
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(60), "consolidate blocked on a FIFO output"
    assert result["code"] == 1
    assert os.path.exists(fifo) and not os.path.isfile(fifo)


_KILLED = """
import os, sys
from lightning_dcp.tools import consolidate as module
real = module.CkptWriter.write_tensor
def write_then_die(self, *args, **kwargs):
    real(self, *args, **kwargs)
    os._exit(9)  # the process dies mid-write, as under kill -9: no cleanup runs
module.CkptWriter.write_tensor = write_then_die
module.consolidate(sys.argv[1], dst=sys.argv[2], progress=False)
"""


def test_temporaries_of_a_killed_run_are_removed_by_the_next(checkpoint, tmp_path):
    src, weights = checkpoint
    out = str(tmp_path / "model.ckpt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    died = subprocess.run([sys.executable, "-c", _KILLED, src, out], env=env, capture_output=True, timeout=120)
    assert died.returncode == 9, died.stderr[-2000:]
    left = [n for n in os.listdir(tmp_path) if n.startswith(".model.ckpt.tmp-")]
    assert len(left) == 1 and not os.path.exists(out)
    live = tmp_path / f".model.ckpt.tmp-{os.getpid()}-abc123"  # a write in progress in a live process: kept
    live.write_bytes(b"in progress")
    assert main([src, "-o", out, "--no-progress"]) == 0
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".model")) == [live.name]
    assert torch.equal(torch.load(out, weights_only=True)["state_dict"]["layer1.weight"], weights["layer1.weight"])
