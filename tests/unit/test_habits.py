"""Lightning users' habits, one process: missing paths worded as Lightning words them, bad ``storage_options``,
``load_from_checkpoint`` hooks on and off, strategy aliases, the command lines' failures."""

from __future__ import annotations

import os

import lightning
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

import lightning_dcp
from lightning_dcp import (
    CheckpointNotFoundError,
    DCPCheckpointIO,
    DCPDDPStrategy,
    NotACheckpointError,
    StorageAccessError,
    inspect_checkpoint,
    load_checkpoint,
    verify_checkpoint,
)
from lightning_dcp._cli import parse_storage_options, run_cli
from lightning_dcp.consolidate import main as consolidate_main
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.inspect import main as inspect_main
from lightning_dcp.verify import main as verify_main
from tests._models import TinyModel


class NamedOptions(TinyModel):
    """A model whose own hyperparameter is called ``storage_options``: Lightning's meaning wins."""

    def __init__(self, storage_options: str = "default", **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()


def _checkpoint(model: nn.Module, path: str) -> str:
    """A Trainer-like checkpoint directory of ``model`` (weights, hparams, version), written by the plugin."""
    checkpoint = {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "pytorch-lightning_version": lightning.__version__,
        "optimizer_states": [],
        "epoch": 1,
    }
    DCPCheckpointIO(sync_files=False).save_checkpoint(checkpoint, path)
    return path


def test_missing_checkpoint_fails_as_lightning_does(tmp_path):
    missing = str(tmp_path / "epoch=3.ckpt")
    with pytest.raises(FileNotFoundError) as lightning_error:
        TorchCheckpointIO().load_checkpoint(missing)
    for load in (DCPCheckpointIO().load_checkpoint, load_checkpoint, verify_checkpoint, inspect_checkpoint):
        with pytest.raises(CheckpointNotFoundError) as ours:
            load(missing)
        assert isinstance(ours.value, FileNotFoundError)
        assert str(ours.value) == str(lightning_error.value) == f"Checkpoint file not found: {missing}"
    last = Location(str(tmp_path / "last.ckpt"))
    last.write_pointer(last.sibling("step=9.ckpt"))  # a "last" pointer whose checkpoint is gone
    with pytest.raises(FileNotFoundError, match=r"^Checkpoint file not found: .*step=9.ckpt \(designated by .*last"):
        DCPCheckpointIO().load_checkpoint(str(tmp_path / "last.ckpt"))


def test_storage_options_must_be_a_dict(tmp_path):
    state = {"state_dict": {"w": torch.ones(2)}}
    with pytest.raises(TypeError, match=r"`storage_options` must be a dict of fsspec filesystem options.*list"):
        DCPCheckpointIO().save_checkpoint(state, str(tmp_path / "a.ckpt"), storage_options=["anon", True])
    with pytest.raises(TypeError, match="got str"):
        DCPCheckpointIO(storage_options="anon=true")
    with pytest.raises(TypeError):
        load_checkpoint(str(tmp_path / "a.ckpt"), storage_options=[("anon", True)])
    assert not (tmp_path / "a.ckpt").exists()


def test_load_from_checkpoint_hooks_on_and_off(tmp_path):
    model = TinyModel(hidden=6)
    path = _checkpoint(model, str(tmp_path / "a.ckpt"))
    assert torch.equal(TinyModel.load_from_checkpoint(path).head.weight, model.head.weight)
    lightning_dcp.uninstall_lightning_hooks()
    try:
        assert lightning_dcp.trainer.hooks.installed_lightning_hooks() == []
        with pytest.raises(IsADirectoryError):  # Lightning alone: torch.load of a directory
            TinyModel.load_from_checkpoint(path)
    finally:
        installed = lightning_dcp.install_lightning_hooks()
    assert "lightning.pytorch.core.saving.pl_load" in installed
    assert "lightning.pytorch.core.module._load_from_checkpoint" in installed
    loaded = TinyModel.load_from_checkpoint(path, storage_options={}, lr=0.5)  # options taken, hparams overridden
    assert torch.equal(loaded.head.weight, model.head.weight) and loaded.hparams.lr == 0.5

    named = NamedOptions(storage_options="saved", hidden=6)
    named_path = _checkpoint(named, str(tmp_path / "named.ckpt"))
    assert NamedOptions.load_from_checkpoint(named_path).hparams.storage_options == "saved"
    assert NamedOptions.load_from_checkpoint(named_path, storage_options="new").hparams.storage_options == "new"


def test_hooks_switch_follows_the_environment(monkeypatch):
    from lightning_dcp._compat.lightning_hooks import HOOKS_ENV, hooks_enabled_by_env

    monkeypatch.delenv(HOOKS_ENV, raising=False)
    assert hooks_enabled_by_env()
    for value, enabled in (("0", False), ("false", False), (" Off ", False), ("no", False), ("1", True)):
        monkeypatch.setenv(HOOKS_ENV, value)
        assert hooks_enabled_by_env() is enabled, value


def test_find_unused_parameters_aliases():
    for value in (True, False):
        trainer = Trainer(
            strategy=f"dcp_ddp_find_unused_parameters_{str(value).lower()}",
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
        )
        assert isinstance(trainer.strategy, DCPDDPStrategy)
        assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is value


# ------------------------------------------------------------------------------------------------ command lines
def test_verify_names_a_single_file_and_a_folder(tmp_path, capsys):
    path = _checkpoint(TinyModel(), str(tmp_path / "run" / "a.ckpt"))
    _checkpoint(TinyModel(), str(tmp_path / "run" / "b.ckpt"))
    single = lightning_dcp.consolidate(path, dst=str(tmp_path / "single.ckpt"))
    assert verify_main([single]) == 1
    assert "error:" in (err := capsys.readouterr().err) and "is a single file, not a checkpoint directory" in err
    assert verify_main([str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "is a folder of 2 checkpoint(s) (a.ckpt, b.ckpt), not one checkpoint" in err and "b.ckpt'" in err
    assert inspect_main([str(tmp_path / "run")]) == 1
    assert "is a folder of 2 checkpoint(s)" in capsys.readouterr().err
    assert verify_main([path, "--storage-options", "{}"]) == 0
    assert verify_main([path, "--storage-options", "{'anon': true}"]) == 1
    err = capsys.readouterr().err
    assert "error: ValueError: --storage-options is not valid JSON" in err and "e.g. --storage-options" in err
    assert verify_main([path, "--storage-options", "[1, 2]"]) == 1
    assert "`--storage-options` must be a dict" in capsys.readouterr().err


def test_s3_without_credentials_is_a_clear_error(tmp_path, monkeypatch, capsys):
    pytest.importorskip("s3fs")
    import s3fs

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()
    url = "s3://some-bucket/run/step=10.ckpt"
    options = '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}'
    for main in (verify_main, inspect_main, consolidate_main):
        assert main([url, "--storage-options", options]) == 1, main
        err = capsys.readouterr().err
        assert err.startswith("error: No credentials were found to access 's3://some-bucket") and "Traceback" not in err
        assert "AWS_ACCESS_KEY_ID" in err, err
    with pytest.raises(StorageAccessError, match="NoCredentialsError"):
        Location(url).exists()


def test_consolidate_refuses_to_write_over_its_source(tmp_path, capsys):
    path = _checkpoint(TinyModel(), str(tmp_path / "run" / "a.ckpt"))
    os.symlink("a.ckpt", tmp_path / "run" / "last.ckpt")
    files = sorted(os.listdir(path))
    for output, where in ((path, "is"), (os.path.join(path, "out.ckpt"), "lies inside"), (str(tmp_path), "contains")):
        assert consolidate_main([path, "-o", output, "--overwrite"]) == 1
        assert f"The output {output!r} {where} the checkpoint" in capsys.readouterr().err
    assert consolidate_main([str(tmp_path / "run" / "last.ckpt"), "-o", path, "--overwrite"]) == 1  # via the link
    assert "is the checkpoint being consolidated" in capsys.readouterr().err
    assert sorted(os.listdir(path)) == files
    verify_checkpoint(path)


def test_cli_failures_print_one_line():
    def fails(err: Exception):
        def command() -> int:
            raise err

        return command

    assert run_cli(fails(RuntimeError("the writer thread died"))) == 1
    assert run_cli(fails(NotACheckpointError("nope"))) == 1
    with pytest.raises(KeyError):  # a bug keeps its traceback
        run_cli(fails(KeyError("bug")))
    assert parse_storage_options(None) is None and parse_storage_options('{"anon": true}') == {"anon": True}


def test_upgrade_migrates_the_meta_pt_of_a_lightning_sharded_directory(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from lightning_dcp.engine.dist import single_process_ok
    from lightning_dcp.upgrade import main as upgrade_main

    path = tmp_path / "epoch=0-step=4.ckpt"  # what ModelParallelStrategy writes: DCP files plus meta.pt
    with single_process_ok():
        dcp.save({"state_dict": {"w": torch.ones(3)}}, checkpoint_id=str(path), no_dist=True)
    torch.save({"pytorch-lightning_version": "1.9.5", "amp_scaling_state": {}, "epoch": 0}, path / "meta.pt")
    assert upgrade_main([str(tmp_path)]) == 0
    assert f"migrated: {path} (1.9.5 -> {lightning.__version__}" in capsys.readouterr().out
    meta = torch.load(path / "meta.pt", weights_only=True)
    assert meta["pytorch-lightning_version"] == lightning.__version__ and "amp_scaling_state" not in meta
    assert torch.load(path / "meta.pt.bak", weights_only=True)["pytorch-lightning_version"] == "1.9.5"
    assert upgrade_main([str(path)]) == 0
    assert f"current: {path}" in capsys.readouterr().out


def test_example_summary_offers_the_other_process_count():
    from examples.train import resume_commands

    after_one = resume_commands(["train.py", "trainer.devices=1", "ckpt_path=last"], 1)
    assert [title for title, _ in after_one] == ["# resume on 1 process(es):", "# resume on 2 processes:"]
    assert after_one[1][1] == ["train.py", "ckpt_path=last", "trainer.devices=2"]
    after_two = resume_commands(["train.py", "ckpt_path=last"], 2)
    assert [title for title, _ in after_two] == ["# resume on 2 process(es):", "# resume on 1 process:"]
    assert after_two[1][1] == ["train.py", "ckpt_path=last", "trainer.devices=1"]


def test_stock_fsdp_given_the_plugin_warns_at_setup():
    import warnings

    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_dcp import DCPFSDPStrategy

    strategy = FSDPStrategy()
    strategy.checkpoint_io = DCPCheckpointIO()
    # The hooked setup warns first; Lightning's own setup then stops at once (it asserts an accelerator).
    warned = pytest.warns(UserWarning, match=r"is ignored .* `Trainer\(strategy='dcp_fsdp'\)`")
    with warned, pytest.raises(AssertionError):
        strategy.setup(trainer=None)
    ours = DCPFSDPStrategy()
    ours.checkpoint_io = DCPCheckpointIO()
    with warnings.catch_warnings(record=True) as seen, pytest.raises(AssertionError):
        warnings.simplefilter("always")
        ours.setup(trainer=None)
    assert not [w for w in seen if "is ignored" in str(w.message)]
