"""Lightning users' habits on checkpoint directories, from 2-rank DDP and FSDP2 runs (local and on S3).

``Model.load_from_checkpoint(<directory>)`` in a fresh process; Lightning's checkpoint upgrade on directories and
folders of them; the checkpoint log line once per save; a stock ``ModelParallelStrategy`` given ``DCPCheckpointIO``
warns; ``DCPCheckpointIO(async_save=True)`` under stock DDP saves without torch's single-process warning.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

import lightning_dcp
from harness.ranks import spawn
from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, DCPModelParallelStrategy, load_checkpoint
from tests._models import FSDP2Model, RandomDataModule, TinyModel
from tests._trainer import assert_same, load_result, make_trainer, save_result, seed, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _worker(rank: int, world_size: int, tmp: str, s3_url: str | None) -> None:
    logger = logging.getLogger("lightning_dcp.engine.checkpointer")
    logger.setLevel(logging.INFO)
    counter = _Count()
    logger.addHandler(counter)
    dirpaths = [os.path.join(tmp, "ddp")] + ([s3_url + "/ddp"] if s3_url else [])
    seed()
    monitors = ["val_loss", "step"]  # one state key per callback
    callbacks = [
        DCPModelCheckpoint(d, monitor=m, mode="min" if m == "val_loss" else "max", save_top_k=1, save_last="link")
        for d, m in zip(dirpaths, monitors[: len(dirpaths)], strict=True)
    ]
    trainer = make_trainer(world_size, max_epochs=2, callbacks=callbacks)
    model = TinyModel(hidden=12)
    trainer.fit(model, datamodule=RandomDataModule(n=32))
    save_result(tmp, "ddp", rank, {**snapshot(trainer), "log": counter.lines})

    seed()
    strategy = DCPModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    trainer = make_trainer(world_size, strategy=strategy, max_epochs=1)
    trainer.fit(FSDP2Model(hidden=50), datamodule=RandomDataModule(n=32))
    for target in [tmp] + ([s3_url] if s3_url else []):
        trainer.save_checkpoint(target + "/fsdp.ckpt")
    save_result(tmp, "fsdp", rank, snapshot(trainer))

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stock = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
        trainer = make_trainer(world_size, strategy=stock, max_epochs=1, plugins=[DCPCheckpointIO()])
        trainer.fit(FSDP2Model(hidden=50), datamodule=RandomDataModule(n=16))
        checkpoint = ModelCheckpoint(dirpath=os.path.join(tmp, "async"), every_n_epochs=1, save_top_k=-1)
        plugin = DCPCheckpointIO(async_save=True)
        trainer = make_trainer(world_size, strategy="ddp", max_epochs=2, plugins=[plugin], callbacks=[checkpoint])
        trainer.fit(TinyModel(), datamodule=RandomDataModule(n=16))
    save_result(tmp, "warnings", rank, [str(w.message) for w in seen])


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Both runs, written locally and (when the SeaweedFS server is available) to a fresh S3 bucket."""
    tmp = str(tmp_path_factory.mktemp("habits"))
    try:
        server = request.getfixturevalue("s3_server")
    except pytest.skip.Exception as skipped:  # the local half runs; test_the_s3_half_ran shows this skip
        server, _S3_SKIPPED[:] = None, [str(skipped)]
    s3_url = f"s3://{server.new_bucket()}" if server else None
    spawn(_worker, 2, tmp, s3_url, env=server.env() if server else None)
    return tmp, s3_url, server.storage_options() if server else None


_S3_SKIPPED: list[str] = []
"""Why the S3 half of these runs did not run (the SeaweedFS server's skip reason), if it did not."""


def test_the_s3_half_ran(runs):
    """The runs also write to and read from S3 when the server is available; when not, this skip says so."""
    _, s3_url, options = runs
    if s3_url is None:
        pytest.skip(f"the S3 half of the Lightning habits tests did not run: {_S3_SKIPPED[0]}")
    assert options and s3_url.startswith("s3://")


def test_load_from_checkpoint_in_a_fresh_process(runs, tmp_path):
    tmp, s3_url, options = runs
    spec = {"ddp": os.path.join(tmp, "ddp", "last.ckpt"), "fsdp": os.path.join(tmp, "fsdp.ckpt")}
    if s3_url:
        spec.update(s3_ddp=s3_url + "/ddp/last.ckpt", s3_fsdp=s3_url + "/fsdp.ckpt", storage_options=options)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # credentials only via storage_options
    result = subprocess.run(
        [sys.executable, "-m", "tests.integration._load_fresh", str(tmp_path / "spec.json"), str(tmp_path / "out.pt")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    ddp, fsdp = load_result(tmp, "ddp"), load_result(tmp, "fsdp")
    # last.ckpt (a symlink locally, a pointer object on S3) designates the checkpoint of the run's last epoch.
    assert_same(out["ddp"]["weights"], ddp["params"], "ddp")
    assert out["ddp"]["hparams"] == {"dim": 8, "hidden": 12, "lr": 0.01, "two_optimizers": False}
    assert out["ddp"]["extra"] == {"note": "kept", "values": [1, 2, 3]}  # on_load_checkpoint saw the Trainer state
    assert_same(out["fsdp"]["weights"], fsdp["params"], "fsdp")  # DTensor shards of 2 ranks, read as full tensors
    assert "Missing key(s)" in out["strict_error"] and "extra.weight" in out["strict_error"]
    assert_same({k: v for k, v in out["wider"].items() if not k.startswith("extra.")}, ddp["params"], "strict=False")
    assert out["datamodule"] == {"n": 32, "dim": 8, "batch_size": 4}
    assert out["process_group"] is False
    if s3_url:
        assert_same(out["s3_ddp"], ddp["params"], "s3 ddp")
        assert_same(out["s3_fsdp"], fsdp["params"], "s3 fsdp")
        assert out["s3_datamodule"] == out["datamodule"]


def test_checkpoint_log_line_once_per_save(runs):
    tmp, s3_url, _ = runs
    rank0, rank1 = (load_result(tmp, "ddp", rank)["log"] for rank in (0, 1))
    saves = 2 * (2 if s3_url else 1)  # two epochs (top-1 checkpoint per epoch), per dirpath; "last" is a link
    assert len(rank0) == saves and all("checkpoint saved to" in line for line in rank0), rank0
    assert rank1 == []


_CHILD = textwrap.dedent(
    """
    import sys
    import lightning_dcp
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    base = status("VmRSS:")
    checkpoint = lightning_dcp.load_checkpoint(sys.argv[1], batch_bytes=16 << 20)
    print(base, status("VmHWM:"), sum(t.nbytes for t in checkpoint["state_dict"].values()))
    """
)


def test_load_checkpoint_reads_weights_not_optimizer_states(tmp_path):
    weights = {f"layer{i}.weight": torch.full((4 << 20,), float(i)) for i in range(4)}  # 4 x 16 MiB
    optimizer = {"state": {n: {"exp_avg": w + 1, "exp_avg_sq": w + 2} for n, w in weights.items()}, "param_groups": []}
    checkpoint = {"state_dict": weights, "optimizer_states": [optimizer], "epoch": 3}
    DCPCheckpointIO(sync_files=False).save_checkpoint(checkpoint, str(tmp_path / "big.ckpt"))
    del weights, optimizer, checkpoint
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "big.ckpt")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    base, peak, loaded = map(int, result.stdout.split())
    assert loaded == 64 << 20
    # The 128 MiB of optimizer state are never read: the peak is the 64 MiB of weights plus about two 16 MiB read
    # batches in flight (97 MiB measured; reading everything peaks above 240 MiB).
    assert peak - base < 112 << 20, (peak - base) >> 20
    state = load_checkpoint(str(tmp_path / "big.ckpt"), map_location="meta")
    assert state["epoch"] == 3 and "optimizer_states" not in state
    assert all(t.device.type == "meta" for t in state["state_dict"].values())


def test_stock_model_parallel_warns_and_async_under_stock_ddp_is_quiet(runs):
    tmp, _, _ = runs
    messages = load_result(tmp, "warnings", 0)
    ignored = [m for m in messages if "`DCPCheckpointIO` you passed is ignored" in m]
    assert len(ignored) == 1 and "strategy='dcp_model_parallel'" in ignored[0], messages
    assert not [m for m in messages if "assuming the intent is to save in a single process" in m], messages
    assert not [m for m in load_result(tmp, "warnings", 1) if "is ignored" in m]  # rank 0 only
    assert sorted(os.listdir(os.path.join(tmp, "async"))) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]


def test_upgrade_migrates_directories_and_hands_files_to_lightning(runs, tmp_path, capsys):
    import lightning
    from lightning.pytorch.utilities import upgrade_checkpoint

    from lightning_dcp.engine.checkpointer import Checkpointer
    from lightning_dcp.tools.rewrite import rewrite_trainer_state
    from lightning_dcp.upgrade import main as upgrade_main

    tmp, _, _ = runs
    folder = tmp_path / "run"
    shutil.copytree(os.path.join(tmp, "ddp"), folder, symlinks=True)
    name = os.readlink(folder / "last.ckpt")
    ckpt = str(folder / name)
    before = Checkpointer().load(ckpt)

    def age(state: dict) -> dict:  # as written by Lightning 1.9.5 with apex AMP, which 2.0.0's migration drops
        state.update({"pytorch-lightning_version": "1.9.5", "amp_scaling_state": {"scale": 2.0}})
        return state

    assert rewrite_trainer_state(ckpt, age, backup=False)
    lightning_dcp.consolidate(ckpt, dst=str(folder / "single.ckpt"))  # a file among the directories

    # Lightning's own upgrade function (hooked: this process imported lightning_dcp), on the folder.
    upgrade_checkpoint._upgrade(argparse.Namespace(path=str(folder), extension=".ckpt", map_to_cpu=False))
    out = capsys.readouterr().out
    assert f"migrated: {ckpt} (1.9.5 -> {lightning.__version__}: _drop_apex_amp_state" in out, out
    assert f"lightning: {folder / 'single.ckpt'}" in out
    assert (folder / f".{name}.bak").is_dir() and (folder / "single.bak").is_file()  # the originals
    after = Checkpointer().load(ckpt)
    assert after.objects["pytorch-lightning_version"] == lightning.__version__
    assert after.objects["legacy_pytorch-lightning_version"] == "1.9.5"
    assert "amp_scaling_state" not in after.objects
    for key in ("global_step", "epoch", "loops", "callbacks", "hyper_parameters", "lightning_dcp"):
        assert after.objects[key] == before.objects[key], key
    assert_same(after.tree, before.tree)  # weights, optimizer states and both ranks' own state, unchanged
    assert sorted(after.tree["rank_states"]) == ["0", "1"] and after.saved_world_size == 2

    # Already current: nothing is rewritten; the CLI says so for each checkpoint.
    stamp = os.stat(os.path.join(ckpt, ".commit")).st_mtime_ns
    assert upgrade_main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"current: {ckpt}" in out and "lightning:" in out
    assert os.stat(os.path.join(ckpt, ".commit")).st_mtime_ns == stamp
    assert upgrade_main([str(tmp_path / "missing")]) == 1
    assert "error: Checkpoint file not found" in capsys.readouterr().err


def test_hooks_stay_off_when_the_environment_says_so():
    code = "import lightning_dcp; print(lightning_dcp.trainer.hooks.installed_lightning_hooks())"
    env = {**os.environ, "LIGHTNING_DCP_LIGHTNING_HOOKS": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
