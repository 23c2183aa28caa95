"""The doors of issue 21 through a real Trainer: remote path strings and wall clocks.

- A ``//`` in a remote dirpath is the same directory: the next run resumes from the newest checkpoint instead of
  starting over them (SeaweedFS, with and without a local tier).
- ``?``, ``#`` and ``..`` in a remote dirpath are refused when the callback is built, before anything is written.
- Clocks: runs whose clocks are an hour fast or slow (a real clock offset by libfaketime in the training processes,
  as on machines with skewed clocks) never make ``ckpt_path="last"`` resume an older step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import s3fs

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, InvalidPathError
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


class _Steps(TinyModel):
    """Records the global step at which training (re)started."""

    started_at: int | None = None

    def on_train_start(self) -> None:
        self.started_at = self.trainer.global_step


def _fit(dirpath: str, max_steps: int, *, options: dict, ckpt_path: str | None = None, local_dir: str | None = None):
    seed()
    model = _Steps()
    callback = DCPModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    io = DCPCheckpointIO(storage_options=options, local_dir=local_dir)
    trainer = make_trainer(
        1, strategy="dcp_single_device", max_epochs=-1, max_steps=max_steps, callbacks=[callback], plugins=[io]
    )
    trainer.fit(model, datamodule=RandomDataModule(n=16), ckpt_path=ckpt_path)
    return trainer, model


def _objects(options: dict, prefix: str) -> set[str]:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    return {p[len(prefix) + 1 :] for p in fs.find(prefix)}


@pytest.mark.s3
@pytest.mark.parametrize("tiered", [False, True], ids=["direct", "local_dir"])
def test_double_slash_dirpath_resumes_instead_of_starting_over(s3_bucket, tmp_path, tiered):
    url, options = s3_bucket
    local_dir = str(tmp_path / "tier") if tiered else None
    _fit(f"{url}/exp//run", 4, options=options, local_dir=local_dir)
    bucket = url[len("s3://") :]
    saved = _objects(options, f"{bucket}/exp/run")
    assert {"step=2.ckpt/.commit", "step=4.ckpt/.commit"} <= saved
    assert not [key for key in _objects(options, bucket) if "//" in key]  # one place, whatever the spelling
    commits = {n: _objects(options, f"{bucket}/exp/run/{n}") for n in ("step=2.ckpt", "step=4.ckpt")}

    trainer, model = _fit(f"{url}//exp//run/", 6, options=options, ckpt_path="last", local_dir=local_dir)
    assert model.started_at == 4  # resumed from the newest checkpoint: not a fresh start at step 0
    assert trainer.global_step == 6
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    for name in commits:  # run 1's checkpoints were kept, not replaced
        marker = json.loads(fs.cat_file(f"{bucket}/exp/run/{name}/.commit"))
        assert marker["order"]["counter"] == (1 if name == "step=2.ckpt" else 2)
    order = json.loads(fs.cat_file(f"{bucket}/exp/run/step=6.ckpt/.commit"))["order"]
    assert (order["counter"], order["step"]) == (3, 6)


@pytest.mark.parametrize("dirpath", ["s3://b/run?x=1", "s3://b/run#2", "s3://b/exp/../run", "gs://b/./run"])
def test_unround_trippable_dirpath_is_refused_before_anything_is_written(dirpath):
    with pytest.raises(InvalidPathError, match="checkpoint URL") as err:
        DCPModelCheckpoint(dirpath=dirpath, every_n_train_steps=2)
    assert dirpath in str(err.value)


# ------------------------------------------------------------------------------------------------------ clocks
_CLOCK_RUNS = """
import json, sys
from lightning_dcp import DCPModelCheckpoint
from tests._models import RandomDataModule
from tests._trainer import make_trainer, seed
from tests.integration.test_doors_trainer import _Steps

dirpath, clock_file = sys.argv[1], sys.argv[2]
for offset, max_steps, ckpt_path in json.loads(sys.argv[3]):
    with open(clock_file, "w") as f:  # libfaketime re-reads it at every clock call: the clock steps right here
        f.write(offset + "\\n")
    seed()
    model = _Steps()
    callback = DCPModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=-1, max_steps=max_steps, callbacks=[callback])
    trainer.fit(model, datamodule=RandomDataModule(n=16), ckpt_path=ckpt_path)
    print(json.dumps({"offset": offset, "started_at": model.started_at, "global_step": trainer.global_step}))
"""


def _runs_with_clocks(tmp_path, dirpath: str, runs: list[tuple[str, int, str | None]]) -> list[dict]:
    """Fit once per run in one process whose wall clock libfaketime sets to each run's offset (a real clock step)."""
    libfaketime = pytest.importorskip("libfaketime", reason="needs libfaketime (test extra) for a real clock offset")
    _, faked = libfaketime.get_reload_information()
    clock_file = str(tmp_path / "clock")
    with open(clock_file, "w") as f:
        f.write("+0\n")
    env = {**os.environ, **faked, "FAKETIME_TIMESTAMP_FILE": clock_file, "FAKETIME_NO_CACHE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _CLOCK_RUNS, dirpath, clock_file, json.dumps(runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_clock_set_back_never_resumes_an_older_step(tmp_path):
    """The issue's case, then clocks an hour behind and two hours ahead: every resume takes the newest step."""
    dirpath = str(tmp_path / "run")
    runs = [("+1h", 6, None), ("+0", 8, "last"), ("-1h", 10, "last"), ("+2h", 12, "last"), ("-3h", 14, "last")]
    results = _runs_with_clocks(tmp_path, dirpath, runs)
    assert [(r["started_at"], r["global_step"]) for r in results] == [(0, 6), (6, 8), (8, 10), (10, 12), (12, 14)]
    markers = {s: json.loads((tmp_path / "run" / f"step={s}.ckpt" / ".commit").read_text()) for s in (6, 8, 10, 14)}
    assert markers[8]["committed_at"] < markers[6]["committed_at"] - 1800  # the clocks really were an hour apart
    assert markers[10]["committed_at"] < markers[8]["committed_at"] - 1800
    assert [markers[s]["order"]["counter"] for s in (6, 8, 10, 14)] == [3, 4, 5, 7]
