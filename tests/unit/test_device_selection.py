"""Every ``dcp_*`` strategy name takes the accelerator's devices as Lightning's own choice does (Trainer and Fabric).

No GPU is needed: as in Lightning's own tests (``mock_cuda_count`` in its conftest), the CUDA device count is
patched, and only the device selection is checked (nothing runs on the devices). On the first GPU run,
``Trainer(accelerator="gpu", strategy="dcp_single_device")`` built its strategy on ``cpu`` and Lightning raised
"Device should be GPU, got cpu instead" at set-up.
"""

from __future__ import annotations

import lightning.fabric.accelerators.cuda as fabric_cuda
import lightning.pytorch.accelerators.cuda as trainer_cuda
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dcp  # noqa: F401  (registers the dcp_* names)
from lightning_dcp.fabric import DCPSingleDeviceStrategy as FabricSingleDevice
from lightning_dcp.trainer.strategies import DCPSingleDeviceStrategy as TrainerSingleDevice

TRAINER_NAMES = sorted(name for name in StrategyRegistry if name.startswith("dcp_"))
FABRIC_NAMES = sorted(name for name in STRATEGY_REGISTRY if name.startswith("dcp_"))
CUDA = torch.device("cuda", 0)


@pytest.fixture
def cuda_count(monkeypatch):
    """Make Lightning and torch see ``n`` CUDA devices (the way Lightning's tests do)."""

    def patch(n: int) -> None:
        for module in (fabric_cuda, trainer_cuda):
            monkeypatch.setattr(module, "num_cuda_devices", lambda: n)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)

    return patch


def _strategy(front: str, name: str, accelerator: str, devices):
    if front == "trainer":
        trainer = Trainer(
            accelerator=accelerator,
            devices=devices,
            strategy=name,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        return trainer.strategy
    return Fabric(accelerator=accelerator, devices=devices, strategy=name)._strategy


def _single(name: str) -> bool:
    return name == "dcp_single_device"


CASES = [("trainer", name) for name in TRAINER_NAMES] + [("fabric", name) for name in FABRIC_NAMES]


def test_every_dcp_name_is_covered():
    assert {"dcp_single_device", "dcp_ddp", "dcp_fsdp", "dcp_model_parallel"} <= set(TRAINER_NAMES)
    assert {"dcp_single_device", "dcp_ddp", "dcp_fsdp", "dcp_model_parallel"} <= set(FABRIC_NAMES)


@pytest.mark.parametrize(("front", "name"), CASES)
@pytest.mark.parametrize("accelerator", ["gpu", "cuda", "auto"])
@pytest.mark.parametrize(("devices", "index"), [(1, 0), ([2], 2), ([3], 3)])
def test_one_gpu_is_the_accelerators_device(cuda_count, front, name, accelerator, devices, index):
    cuda_count(4)
    strategy = _strategy(front, name, accelerator, devices)
    assert strategy.root_device == torch.device("cuda", index)
    if not _single(name):
        assert strategy.parallel_devices == [torch.device("cuda", index)]


@pytest.mark.parametrize(("front", "name"), [case for case in CASES if not _single(case[1])])
def test_several_gpus_are_the_parallel_devices(cuda_count, front, name):
    cuda_count(4)
    strategy = _strategy(front, name, "gpu", [1, 3])
    assert strategy.parallel_devices == [torch.device("cuda", 1), torch.device("cuda", 3)]
    assert strategy.root_device == torch.device("cuda", 1)  # local rank 0


@pytest.mark.filterwarnings("ignore:GPU available but not used")
@pytest.mark.parametrize(("front", "name"), CASES)
@pytest.mark.parametrize(("accelerator", "gpus"), [("cpu", 4), ("auto", 0)])
def test_cpu_stays_cpu(cuda_count, front, name, accelerator, gpus):
    cuda_count(gpus)
    strategy = _strategy(front, name, accelerator, 1)
    assert strategy.root_device == torch.device("cpu")
    if not _single(name):
        assert strategy.parallel_devices == [torch.device("cpu")]


@pytest.mark.parametrize("cls", [TrainerSingleDevice, FabricSingleDevice])
def test_a_device_given_to_the_single_device_strategy_is_kept(cuda_count, cls):
    cuda_count(4)
    strategy = cls(device=torch.device("cuda", 1))
    if cls is TrainerSingleDevice:
        built = Trainer(accelerator="gpu", devices=1, strategy=strategy, logger=False).strategy
    else:
        built = Fabric(accelerator="gpu", devices=1, strategy=strategy)._strategy
    assert built is strategy and built.root_device == torch.device("cuda", 1)
    assert cls().root_device == torch.device("cpu")  # before the connector chooses
