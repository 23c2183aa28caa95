"""SIGTERM with Fabric and the memory tier (lightning_dcp/fabric/preemption.py), in one process.

Two ranks preempted together are in tests/distributed/test_memory_fabric.py; here: what happens to SIGTERM around
the saves (a second one, teardown, a process that ignores it) and when the save at hand has failed.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from lightning.fabric import Fabric

from lightning_dcp import MemoryTier
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers import shm_writer
from lightning_dcp.engine.tiers.runs import RUN_FILE
from lightning_dcp.fabric import DCPSingleDeviceStrategy
from lightning_dcp.fabric.preemption import Preemption


class _Preempted(Exception):
    pass


def _raise_preempted(signum, frame):
    raise _Preempted


@pytest.fixture
def user_handler():
    before = signal.signal(signal.SIGTERM, _raise_preempted)
    yield _raise_preempted
    signal.signal(signal.SIGTERM, before)


def test_a_second_sigterm_goes_to_the_previous_handler_at_once(user_handler):
    preemption = Preemption()
    preemption.install()
    os.kill(os.getpid(), signal.SIGTERM)  # recorded: nothing else happens
    assert preemption.received and signal.getsignal(signal.SIGTERM) == preemption._on_sigterm
    with pytest.raises(_Preempted):  # no save came to act on the first one
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is user_handler


def test_uninstall_gives_sigterm_back_and_an_ignored_sigterm_stays_ignored(user_handler):
    preemption = Preemption()
    preemption.install()
    preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) is user_handler
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Preemption().install()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_sigterm_after_a_failed_save_persists_the_newest_committed_checkpoint_and_stops(
    tmp_path, user_handler, monkeypatch
):
    tier = MemoryTier(tmp_path / "shm", replicas=0, persist_every=0, async_save=False)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=DCPSingleDeviceStrategy(memory=tier))
    model = fabric.setup_module(torch.nn.Linear(4, 4))
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fabric.save(str(tmp_path / "durable" / "s1"), {"model": model, "step": 1})

    def no_room(*args):
        raise OSError(28, "No space left on device")  # what a full tmpfs answers

    monkeypatch.setattr(shm_writer, "_copy_record", no_room)
    os.kill(os.getpid(), signal.SIGTERM)  # preempted while s2 is made: recorded
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(_Preempted) as raised:  # s2 failed: s1 persisted, then SIGTERM to the previous handler
        fabric.save(str(tmp_path / "durable" / "s2"), {"model": model, "step": 2})
    assert "No space left" in str(raised.value.__context__)
    assert (
        sorted(set(os.listdir(tmp_path / "durable")) - {RUN_FILE}) == ["s1"]
        and Location(str(tmp_path / "durable" / "s1")).is_committed()
    )
    assert signal.getsignal(signal.SIGTERM) is user_handler
    monkeypatch.undo()
    restored = Fabric(accelerator="cpu", devices=1, strategy=DCPSingleDeviceStrategy())
    fresh = restored.setup_module(torch.nn.Linear(4, 4))
    state = {"model": fresh, "step": 0}
    restored.load(str(tmp_path / "durable" / "s1"), state)
    assert state["step"] == 1 and all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())
    fabric.strategy.teardown()
