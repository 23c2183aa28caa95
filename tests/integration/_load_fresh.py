"""Run in a fresh process (no process group): load checkpoint directories the way Lightning users do.

``python -m tests.integration._load_fresh SPEC.json OUT.pt``: SPEC has ``ddp``/``fsdp`` (local checkpoint paths),
optionally ``s3_ddp``/``s3_fsdp`` and ``storage_options``; OUT receives what was loaded, for the test to compare.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import lightning_dcp  # noqa: F401  (installs the load_from_checkpoint hook)
from tests._models import FSDP2Model, RandomDataModule, TinyModel


class WiderModel(TinyModel):
    """TinyModel plus one layer the checkpoint does not have (``strict`` decides)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.extra = nn.Linear(2, 2)


class FSDP2Inference(FSDP2Model):
    """What an FSDP2 model needs for ``load_from_checkpoint``: Lightning calls ``configure_model`` there, without a
    device mesh (one process, no process group), so sharding is skipped then."""

    def configure_model(self) -> None:
        if self.device_mesh is not None:
            super().configure_model()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    options = spec.get("storage_options")
    out: dict = {}
    model = TinyModel.load_from_checkpoint(spec["ddp"], map_location="cpu")
    out["ddp"] = {"weights": _weights(model), "hparams": dict(model.hparams), "extra": model.extra_saved}
    out["fsdp"] = {"weights": _weights(FSDP2Inference.load_from_checkpoint(spec["fsdp"]))}
    try:
        WiderModel.load_from_checkpoint(spec["ddp"])
    except RuntimeError as err:  # strict (the default): Lightning's load_state_dict names the missing keys
        out["strict_error"] = str(err)
    out["wider"] = _weights(WiderModel.load_from_checkpoint(spec["ddp"], strict=False))
    out["datamodule"] = dict(RandomDataModule.load_from_checkpoint(spec["ddp"]).hparams)
    if "s3_ddp" in spec:
        out["s3_ddp"] = _weights(TinyModel.load_from_checkpoint(spec["s3_ddp"], storage_options=options))
        out["s3_fsdp"] = _weights(FSDP2Inference.load_from_checkpoint(spec["s3_fsdp"], storage_options=options))
        datamodule = RandomDataModule.load_from_checkpoint(spec["s3_ddp"], storage_options=options)
        out["s3_datamodule"] = dict(datamodule.hparams)
    out["process_group"] = dist.is_initialized()
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
