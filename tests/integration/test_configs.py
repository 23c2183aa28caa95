"""The configs in configs/ instantiate: Hydra (``_target_``) and LightningCLI (``class_path``) both give our plugin."""

from __future__ import annotations

import os

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from lightning_dcp import DCPCheckpointIO, DCPDDPStrategy, DCPModelCheckpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def open_dict_everywhere(cfg):
    OmegaConf.set_readonly(cfg, False)
    return open_dict(cfg)


def _compose(name: str, tmp_path) -> dict:
    """configs/{name}.yaml composed and resolved as in a real run whose directory is ``tmp_path``."""
    with initialize_config_dir(config_dir=os.path.join(ROOT, "configs"), version_base="1.3"):
        cfg = compose(config_name=name, overrides=[f"hydra.run.dir={tmp_path}"], return_hydra_config=True)
        with open_dict_everywhere(cfg):
            cfg.hydra.runtime.output_dir = str(tmp_path)
            cfg.hydra.runtime.cwd = str(tmp_path)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]  # ${hydra:...} resolves through HydraConfig, as in a real run
        return OmegaConf.to_container(cfg, resolve=True)


def test_hydra_config_instantiates(tmp_path):
    plain = _compose("train", tmp_path)
    io = instantiate(plain["trainer"]["plugins"][0])
    assert isinstance(io, DCPCheckpointIO)
    checkpoint = instantiate(plain["callbacks"]["checkpoint"])
    assert isinstance(checkpoint, DCPModelCheckpoint) and checkpoint.dirpath.startswith(str(tmp_path))
    trainer = instantiate(plain["trainer"], callbacks=[checkpoint], logger=False, _convert_="all")
    assert isinstance(trainer.strategy, DCPDDPStrategy) and trainer.strategy.state_dict_type == "sharded"
    assert isinstance(trainer.strategy.checkpoint_io, DCPCheckpointIO)
    model = instantiate(plain["model"])
    assert 0.8e6 < model.count_parameters() < 1.0e6  # "tiny"


def test_lightning_cli_config_instantiates(tmp_path, monkeypatch):
    from examples.cli import ByteGPTCLI
    from examples.data import StdlibTextDataModule
    from examples.gpt import ByteGPT

    monkeypatch.chdir(tmp_path)
    with open(os.path.join(ROOT, "configs", "cli.yaml")) as f:
        config = yaml.safe_load(f)
    config.pop("ckpt_path")  # an argument of the `fit` subcommand; run=False parses without subcommands
    (tmp_path / "cli.yaml").write_text(yaml.safe_dump(config))
    cli = ByteGPTCLI(ByteGPT, StdlibTextDataModule, run=False, args=["--config", str(tmp_path / "cli.yaml")])
    assert isinstance(cli.trainer.strategy, DCPDDPStrategy)
    assert isinstance(cli.trainer.strategy.checkpoint_io, DCPCheckpointIO)
    assert cli.model.hparams.max_steps == cli.trainer.max_steps == 60


def test_fabric_hydra_config_instantiates(tmp_path):
    from lightning_dcp.fabric import DCPDDPStrategy as FabricDDPStrategy

    plain = _compose("fabric_train", tmp_path)
    fabric = instantiate(plain["fabric"], _convert_="all")  # not launched: no processes start
    assert isinstance(fabric.strategy, FabricDDPStrategy) and fabric.strategy.checkpointer.async_save
    assert fabric.world_size == 2 and plain["ckpt_dir"].startswith(str(tmp_path))
    model = instantiate(plain["model"])
    assert model.hparams.max_steps == plain["max_steps"] == 60
