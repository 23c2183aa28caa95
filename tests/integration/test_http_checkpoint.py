"""``load_from_checkpoint("http://...")`` of a checkpoint directory (issue 22): served by Python's own ``http.server``
on loopback, which neither answers range requests nor hides hidden files; its ``.commit`` names what to fetch."""

from __future__ import annotations

import functools
import os
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightning_dcp import NotACheckpointError, load_checkpoint
from tests._models import RandomDataModule, TinyModel
from tests._trainer import make_trainer, seed


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def served(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def test_load_from_checkpoint_of_a_directory_over_http(tmp_path, served):
    seed()
    model = TinyModel(hidden=24)
    trainer = make_trainer(1, strategy="dcp_single_device", max_steps=3)
    trainer.fit(model, datamodule=RandomDataModule())
    trainer.save_checkpoint(str(tmp_path / "run" / "a.ckpt"))

    loaded = TinyModel.load_from_checkpoint(f"{served}/run/a.ckpt")
    assert loaded.hparams.hidden == 24
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert load_checkpoint(f"{served}/run/a.ckpt")["global_step"] == 3

    os.remove(tmp_path / "run" / "a.ckpt" / ".commit")  # an uncommitted directory is no checkpoint over http either
    with pytest.raises(NotACheckpointError, match=".commit"):
        load_checkpoint(f"{served}/run/a.ckpt")
