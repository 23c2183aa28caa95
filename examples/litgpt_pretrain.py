"""litgpt's own ``pretrain`` command with its checkpoints written by lightning_dcp's Fabric strategies.

The same command line as litgpt's, with ``litgpt`` replaced by this script (docs/clients.md)::

    python examples/litgpt_pretrain.py pretrain --config tiny.yaml --out_dir out/pretrain
    python examples/litgpt_pretrain.py pretrain --config tiny.yaml --out_dir out/pretrain --resume auto

litgpt builds ``lightning.Fabric(...)`` itself and takes no strategy argument: while its command runs, ``Fabric``
is a subclass whose constructor swaps litgpt's choice (``"auto"`` on one device, FSDP on more) for the matching
``dcp_*`` strategy with async saves. Every ``fabric.save`` of litgpt (``step-NNNNNNNN/lit_model.pth`` and
``final/lit_model.pth``) then writes a committed DCP directory under that name, and ``--resume`` loads it.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning
import torch
from lightning.fabric.strategies import FSDPStrategy, Strategy

from lightning_dcp.fabric import DCPDDPStrategy, DCPFSDPStrategy, DCPSingleDeviceStrategy


def dcp_strategy(litgpt_choice: str | Strategy, *, async_save: bool = True) -> Strategy:
    """The lightning_dcp strategy that stands in for the one litgpt's ``pretrain`` picked."""
    if not isinstance(litgpt_choice, FSDPStrategy):  # litgpt passes "auto" for a single device
        return DCPSingleDeviceStrategy(async_save=async_save)
    if torch.cuda.is_available():  # litgpt's FSDP settings (wrap each transformer Block)
        from litgpt.model import Block

        return DCPFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="HYBRID_SHARD", async_save=async_save)
    return DCPDDPStrategy(async_save=async_save)  # FSDP1 refuses CPUs; DDP keeps several CPU processes possible


class DCPFabric(lightning.Fabric):
    """``lightning.Fabric`` whose ``strategy`` argument is replaced by :func:`dcp_strategy`'s."""

    def __init__(self, *args: Any, strategy: str | Strategy = "auto", **kwargs: Any) -> None:
        super().__init__(*args, strategy=dcp_strategy(strategy), **kwargs)


def main(argv: list[str] | None = None) -> int:
    """Run ``litgpt pretrain ARGS`` (``argv``: ``["pretrain", *ARGS]``; default ``sys.argv[1:]``) through DCPFabric."""
    if argv is not None:  # Fabric's launcher re-runs sys.argv for the other processes: keep the script's name
        sys.argv[1:] = argv
    if sys.argv[1:2] != ["pretrain"]:
        print("usage: python examples/litgpt_pretrain.py pretrain [litgpt pretrain's arguments]", file=sys.stderr)
        return 2
    from litgpt.__main__ import main as litgpt_main

    stock, lightning.Fabric = lightning.Fabric, DCPFabric  # litgpt.pretrain calls `lightning.Fabric(...)`
    try:
        litgpt_main()
    finally:
        lightning.Fabric = stock
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
