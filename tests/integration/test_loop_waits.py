"""What an async save costs the training loop: every wait for it is in its ``checkpoint/save_blocked_s``.

The loop waits for an async save in its call, in the optimizer steps after it (for its deferred staging copies), in
the next save call (for its write, ``when_busy="wait"``) and at the teardown. Each test measures those waits from the
outside (around the save calls, between a step's closure and the end of its ``optimizer.step``, over the fit's end)
and compares them with what the real loggers received.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import torch
from lightning.fabric.loggers import Logger as FabricLogger
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.storage.location import Location
from tests._faults import FaultProxy
from tests._trainer import make_trainer, seed

_STEPS = 6
_BLOCKED = "checkpoint/save_blocked_s"


class _FabricRows(FabricLogger):
    """A Fabric logger that keeps what it is given (``fabric.log_dict``) in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "rows"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class _Rows(_FabricRows, Logger):
    """The same for the Trainer (``log_metrics``); Lightning's ``Logger`` is a Fabric logger."""

    def saves(self) -> dict[int, float]:
        return {step: m[_BLOCKED] for step, m in self.rows if _BLOCKED in m}


class _Held(LightningModule):
    """A 256 MiB parameter that AdamW holds but no loss uses (its update costs nothing: it has no gradient, yet its
    staging copy is deferred to the background, so the next step waits for it), beside a tiny head.

    ``gate[s]``: seconds from the end of the closure of the step that follows the save of step ``s`` to the end of its
    ``optimizer.step`` (where the Trainer's step waits for the save's copies; the head's update is a few microseconds).
    """

    def __init__(self) -> None:
        super().__init__()
        self.held = torch.nn.Parameter(torch.zeros(8192, 8192))
        self.head = torch.nn.Linear(8, 1)
        self.gate: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.head(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        step, ended = self.trainer.global_step, []

        def closure():
            loss = optimizer_closure()
            ended.append(time.perf_counter())
            return loss

        optimizer.step(closure=closure)
        self.gate[step] = time.perf_counter() - ended[0]


class _TimedIO(DCPCheckpointIO):
    """``DCPCheckpointIO`` that times its save calls (skipped ones included)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[float] = []

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            super().save_checkpoint(*args, **kwargs)
        finally:
            self.calls.append(time.perf_counter() - started)


class _End(Callback):
    """The span from the end of training to the end of ``fit`` (the teardown waits for the save in flight there)."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.started = time.perf_counter()

    def on_fit_end(self, trainer, pl_module) -> None:
        self.seconds = time.perf_counter() - self.started


@pytest.fixture
def slow_store(s3_server):
    """``(dirpath, storage_options)``: a fresh bucket behind a fault proxy adding 50 ms before every answer chunk."""
    proxy = FaultProxy(s3_server.ports["s3"]).start()
    proxy.set("pass", delay=0.05)
    options = s3_server.storage_options()
    options["client_kwargs"]["endpoint_url"] = proxy.endpoint
    yield f"s3://{s3_server.new_bucket()}/run", options
    proxy.stop()


def test_steps_waiting_behind_a_slow_store_are_counted_and_skip_skips(slow_store):
    """A save every step to a slow S3 store with ``when_busy="skip"``: the steps' waits for each committed save's
    copies, the skipped calls and the teardown's wait are in its ``save_blocked_s``; the saves called while one was
    being written are skipped."""
    dirpath, options = slow_store
    seed()
    model, logger, end = _Held(), _Rows(), _End()
    io = _TimedIO(async_save=True, when_busy="skip", storage_options=options)
    checkpoint = DCPModelCheckpoint(dirpath, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=_STEPS, callbacks=[checkpoint, end], plugins=[io])
    trainer.loggers = [logger]
    data = DataLoader(TensorDataset(torch.randn(4 * _STEPS, 8)), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=data)
    skips = [str(w.message) for w in caught if "when_busy='skip'" in str(w.message)]

    skipped = [step for step, _ in io.checkpointer.skipped]
    saves = logger.saves()
    store = Location(dirpath, storage_options=options)
    committed = sorted(
        int(loc.name.removeprefix("step=").removesuffix(".ckpt")) for _, loc in committed_checkpoints(store)
    )
    assert skipped and len(skips) == len(skipped)  # the store is slower than the steps: saves were skipped, warned
    assert sorted(saves) == committed and sorted([*skipped, *committed]) == list(range(1, _STEPS + 1))

    # The step after each save waited for its copies: that wait is in the save's blocked time.
    waited = {step: model.gate[step] for step in saves if step in model.gate}
    assert max(waited.values()) > 0.1, waited  # a 256 MiB copy into fresh buffers, at least the first save's
    for step, gate in waited.items():
        assert saves[step] >= gate - 0.02, (step, saves[step], gate)

    # Everything the loop waited for the saves (calls, steps at the gate, the end) and nothing else: the records
    # sum the waits inside those spans.
    spans = sum(io.calls) + sum(model.gate.values()) + end.seconds
    assert sum(saves.values()) <= spans + 0.05, (saves, spans)
    assert sum(saves.values()) >= 0.8 * spans, (saves, io.calls, model.gate, end.seconds)


def test_the_next_calls_and_the_final_waits_for_a_write_count_on_that_save(tmp_path):
    """``when_busy="wait"`` (Fabric): the second save's call waits for the first one's write, ``wait_for_save`` for
    the second's; each wait is on the record of the save waited for, and together they are what the loop waited."""
    from lightning.fabric import Fabric

    from lightning_dcp.fabric import DCPSingleDeviceStrategy, log_checkpoint_metrics

    logger = _FabricRows()
    strategy = DCPSingleDeviceStrategy(device="cpu", async_save=True)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, loggers=logger)
    big = torch.zeros(16384, 4096)  # 256 MiB, copied at each call (not a module's): written for far longer
    started = time.perf_counter()
    fabric.save(str(tmp_path / "a"), {"big": big, "step": 1})
    training = time.perf_counter()
    big.add_(1.0)  # the training between the saves: no wait for them
    training = time.perf_counter() - training
    fabric.save(str(tmp_path / "b"), {"big": big, "step": 2})
    second = time.perf_counter()
    strategy.wait_for_save()
    ended = time.perf_counter()
    assert log_checkpoint_metrics(fabric) == 2
    blocked = {step: m[_BLOCKED] for step, m in logger.rows}
    loop = ended - started - training  # the two calls (the second one waits for the first write), the final wait
    assert blocked[1] + blocked[2] <= loop + 0.01, (blocked, loop)
    assert blocked[1] + blocked[2] >= 0.9 * loop, (blocked, loop)
    assert blocked[2] >= 0.9 * (ended - second), (blocked, ended - second)  # the final wait is the second save's
    strategy.teardown()
