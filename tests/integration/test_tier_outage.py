"""Store outages during training, through a real Trainer and a real S3 server (SeaweedFS) behind a fault proxy.

The proxy (``tests/_faults.py``) is a real TCP proxy on loopback: s3fs meets refused connections as from a store that
went down. With ``local_dir`` nothing remote runs in the training loop: the fit goes on, each save warns, and once the
store answers the remote holds exactly what top-k and ``save_last`` ask for. Without ``local_dir`` a save that cannot
reach the store stops training with ``StorageUnavailableError``. The long campaign: ``python -m tests.chaos.remote``.
"""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback

from lightning_dcp import DCPCheckpointIO, DCPModelCheckpoint, StorageUnavailableError
from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.format.marker import COMMIT_FILE
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.engine.tiers.uploader import Retry
from tests._faults import FaultProxy
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed

_FAST_FAILURES = {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5}


@pytest.fixture
def proxied(s3_server):
    """``(dirpath, storage_options, proxy)``: a fresh bucket of the session's server, reached through a fault proxy."""
    proxy = FaultProxy(s3_server.ports["s3"]).start()
    options = s3_server.storage_options()
    options["client_kwargs"]["endpoint_url"] = proxy.endpoint
    options["config_kwargs"] = _FAST_FAILURES
    yield f"s3://{s3_server.new_bucket()}/run", options, proxy
    proxy.stop()


class _Outage(Callback):
    """The store goes down before the save of step ``start`` and comes back at step ``end``, once the uploader has
    failed ``attempts`` times (waited for on the uploader's own condition: the training loop itself never waits)."""

    def __init__(self, proxy: FaultProxy, start: int | None, end: int, attempts: int = 2) -> None:
        self.proxy, self.start, self.end, self.attempts = proxy, start, end, attempts

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.start:
            self.proxy.set("refuse")
        if trainer.global_step == self.end:
            uploader = trainer.strategy.checkpoint_io.tiers.uploader
            with uploader.cond:
                met = uploader.cond.wait_for(
                    lambda: uploader.outage is not None and uploader.outage.attempts >= self.attempts, timeout=120
                )
                assert met, (
                    f"the uploader never met the outage: active {uploader.active}, queue {list(uploader.queue)},"
                    f" failed {list(uploader.failed)}, deferred {list(uploader.deferred)}, thread alive"
                    f" {uploader._thread is not None and uploader._thread.is_alive()}"
                )
            self.proxy.set("pass")


def _fit(dirpath, options, local_dir, *, steps, callbacks=(), ckpt_path=None, at_teardown=30.0):
    seed()
    checkpoint = DCPModelCheckpoint(
        dirpath, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last="link"
    )
    io = DCPCheckpointIO(storage_options=options, local_dir=local_dir, local_keep=2)
    io.tiers.retry = Retry(first_delay=0.2, max_delay=1.0, at_teardown=at_teardown, first_listing=2.0)
    trainer = make_trainer(1, max_steps=steps, callbacks=[checkpoint, *callbacks], plugins=[io])
    return trainer, checkpoint


def _assert_remote_is_exactly_top_k(dirpath, options, local_dir, checkpoint) -> None:
    remote = Location(dirpath, storage_options=options)
    expected = sorted(os.path.basename(p) for p in checkpoint.best_k_models)
    assert sorted(loc.name for _, loc in committed_checkpoints(remote)) == expected
    assert sorted(name for name, _ in remote.entries()) == sorted([*expected, "last.ckpt"])  # nothing else
    newest = os.path.basename(checkpoint.best_model_path)  # monitor="step", mode="max": the newest is the best
    assert remote.child("last.ckpt").read_pointer() == newest
    local = Location(str(local_dir))
    assert sorted(loc.name for _, loc in committed_checkpoints(local)) == expected  # local_keep=2 = top-k
    for name in expected:  # bit-equal: every file of every checkpoint on both tiers
        files = sorted(os.listdir(os.path.join(local_dir, name)))
        assert sorted(remote.child(name).sizes()) == files
        for file in files:
            with remote.child(name).open(file) as f, open(os.path.join(local_dir, name, file), "rb") as g:
                assert f.read() == g.read(), (name, file)


def test_an_outage_during_fit_with_local_dir_loses_nothing_and_the_remote_ends_exactly_top_k(
    proxied, tmp_path, recwarn
):
    dirpath, options, proxy = proxied
    local_dir = tmp_path / "local"
    outage = _Outage(proxy, start=4, end=10)
    trainer, checkpoint = _fit(dirpath, options, local_dir, steps=14, callbacks=[outage])
    trainer.fit(TinyModel(), datamodule=RandomDataModule())

    assert trainer.global_step == 14 and trainer.state.finished  # the fit went on through the outage
    unreachable = [w for w in recwarn if "has been unreachable for" in str(w.message)]
    assert 1 <= len(unreachable) <= 6, [str(w.message) for w in recwarn]  # one per save while the store was down
    _assert_remote_is_exactly_top_k(dirpath, options, local_dir, checkpoint)
    fresh = DCPCheckpointIO(storage_options=options, local_dir=tmp_path / "fresh")
    loaded = fresh.load_checkpoint(dirpath + "/last.ckpt")  # the remote copy alone: the final state
    assert loaded["global_step"] == 14
    for key, value in trainer.lightning_module.state_dict().items():
        assert torch.equal(loaded["state_dict"][key], value), key


def test_a_store_down_at_teardown_and_at_the_next_start_loses_nothing(proxied, tmp_path, recwarn):
    dirpath, options, proxy = proxied
    local_dir = tmp_path / "local"
    # Run 1: the store goes down at step 3 and stays down: the fit trains to the end, then teardown raises.
    trainer, _ = _fit(dirpath, options, local_dir, steps=6, callbacks=[_Outage(proxy, start=3, end=-1)], at_teardown=2)
    with pytest.raises(StorageUnavailableError, match=r"unreachable for .* Not uploaded yet: \[.*step=6\.ckpt'\]"):
        trainer.fit(TinyModel(), datamodule=RandomDataModule())
    assert trainer.global_step == 6
    assert {loc.name for _, loc in committed_checkpoints(Location(str(local_dir)))} == {
        "epoch=0-step=5.ckpt",
        "epoch=0-step=6.ckpt",
    }  # every checkpoint top-k keeps is committed locally

    # Run 2 starts while the store is still down: it resumes from the local tier, and the store returns at step 8.
    trainer, checkpoint = _fit(dirpath, options, local_dir, steps=10, callbacks=[_Outage(proxy, None, 8, attempts=1)])
    with pytest.warns(UserWarning, match="cannot be read .* loading from the local tier only"):
        trainer.fit(TinyModel(), datamodule=RandomDataModule(), ckpt_path="last")
    assert trainer.ckpt_path == os.path.join(str(local_dir), "epoch=0-step=6.ckpt", COMMIT_FILE)
    assert trainer.global_step == 10
    _assert_remote_is_exactly_top_k(dirpath, options, local_dir, checkpoint)


def test_without_local_dir_a_save_that_cannot_reach_the_store_stops_training(proxied, tmp_path):
    dirpath, options, proxy = proxied
    seed()
    checkpoint = DCPModelCheckpoint(dirpath, every_n_train_steps=2, save_top_k=-1)
    stop = _Outage(proxy, start=3, end=-1)
    trainer = make_trainer(
        1, max_steps=8, callbacks=[checkpoint, stop], plugins=[DCPCheckpointIO(storage_options=options)]
    )
    with pytest.raises(StorageUnavailableError, match=rf"{dirpath}/epoch=0-step=4\.ckpt' cannot be reached"):
        trainer.fit(TinyModel(), datamodule=RandomDataModule())
    assert trainer.global_step == 4  # training stopped at the save that could not reach the store
    proxy.set("pass")
    remote = Location(dirpath, storage_options=options)
    assert [loc.name for _, loc in committed_checkpoints(remote)] == ["epoch=0-step=2.ckpt"]  # intact

    proxy.set("refuse")  # down before the first save: the fit does not start
    trainer = make_trainer(
        1, max_steps=2, callbacks=[DCPModelCheckpoint(dirpath)], plugins=[DCPCheckpointIO(storage_options=options)]
    )
    with pytest.raises(StorageUnavailableError, match=rf"{dirpath}.* cannot be reached"):
        trainer.fit(TinyModel(), datamodule=RandomDataModule())
    assert trainer.global_step == 0
