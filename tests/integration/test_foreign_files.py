"""A file of another format as a checkpoint says what it is and what to use (issue 51).

A safetensors export of the weights as ``ckpt_path`` failed with "Unsupported operand 120"; ``load_model_weights``,
which the message now names, could not read it either. Every door that takes a checkpoint path (``fit(ckpt_path=)``,
``load_from_checkpoint``, ``load_checkpoint``, ``inspect_checkpoint``) raises ``NotACheckpointError`` naming the
format, and ``load_model_weights`` loads a safetensors file's weights.
"""

from __future__ import annotations

import pytest
import torch

import lightning_dcp
from lightning_dcp import NotACheckpointError
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture
def weights_file(tmp_path):
    seed()
    weights = {k: v.clone() for k, v in TinyModel().state_dict().items()}
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(weights, path)
    return path, weights


def test_every_checkpoint_door_names_a_safetensors_file_and_the_fix(weights_file):
    path, _ = weights_file
    expected = f"'{path}' is a safetensors file: tensors only (model weights)"
    fix = f"`lightning_dcp.load_model_weights(model, '{path}')`"
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=1)
    doors = {
        "fit": lambda: trainer.fit(TinyModel(), datamodule=RandomDataModule(n=8), ckpt_path=path),
        "load_from_checkpoint": lambda: TinyModel.load_from_checkpoint(path),
        "load_checkpoint": lambda: lightning_dcp.load_checkpoint(path),
        "inspect_checkpoint": lambda: lightning_dcp.inspect_checkpoint(path),
    }
    for door, call in doors.items():
        with pytest.raises(NotACheckpointError) as err:
            call()
        assert str(err.value).startswith(expected) and fix in str(err.value), (door, str(err.value))
    assert trainer.global_step == 0


def test_load_model_weights_loads_a_safetensors_file(weights_file):
    path, weights = weights_file
    model = TinyModel()
    report = lightning_dcp.load_model_weights(model, path)
    assert report.loaded_keys == sorted(weights) and not report.missing_keys and not report.unexpected_keys
    for key, value in weights.items():
        assert torch.equal(model.state_dict()[key], value), key
    head = next(k for k in weights if k.endswith("bias"))
    fresh = TinyModel()
    before = fresh.state_dict()[head].clone()
    report = lightning_dcp.load_model_weights(fresh, path, exclude=[head])
    assert report.excluded_keys == [head] and torch.equal(fresh.state_dict()[head], before)


def test_other_formats_as_ckpt_path_are_named(tmp_path):
    for name, data, what in (
        ("model.gguf", b"GGUF\x03\x00\x00\x00" + bytes(64), "is a GGUF file"),
        ("empty.ckpt", b"", "is an empty file \\(0 bytes\\)"),
        ("config.yaml", b"model:\n  hidden: 32\n", "is a text file"),
    ):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(NotACheckpointError, match=what) as err:
            lightning_dcp.DCPCheckpointIO().load_checkpoint(str(path))
        assert str(err.value).startswith(f"'{path}' ") and "Pass a checkpoint saved by the Trainer" in str(err.value)
