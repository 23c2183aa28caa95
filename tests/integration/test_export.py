"""Exports in a real Trainer: ExportCallback, consolidated checkpoints resuming, and streaming peak memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_dcp import DCPCheckpointIO, ExportCallback, consolidate
from tests._models import RandomDataModule, TinyModel
from tests._trainer import assert_same, make_trainer, seed


def test_export_callback_best_and_final(tmp_path):
    seed()
    model = TinyModel()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), monitor="val_loss", save_top_k=1)
    export = ExportCallback(str(tmp_path / "export"), on_best=True, dtype="bf16")
    export_ckpt = ExportCallback(str(tmp_path / "export"), filename="weights", format="ckpt", on_best=True)
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=3, callbacks=[ckpt, export, export_ckpt])
    trainer.fit(model, datamodule=RandomDataModule())

    final = load_file(str(tmp_path / "export" / "model.safetensors"))
    expected = {k: v.bfloat16() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    assert_same(final, expected)
    best = load_file(str(tmp_path / "export" / "model-best.safetensors"))
    best_state = DCPCheckpointIO().load_checkpoint(ckpt.best_model_path)["state_dict"]
    assert_same(best, {k: v.bfloat16() if v.is_floating_point() else v for k, v in best_state.items()})
    assert len(export.exported) >= 2

    # The weights-only .ckpt exports load into the LightningModule directly.
    loaded = TinyModel.load_from_checkpoint(str(tmp_path / "export" / "weights.ckpt"))
    assert_same(loaded.state_dict(), model.state_dict())
    best_loaded = torch.load(str(tmp_path / "export" / "weights-best.ckpt"), weights_only=True)
    assert_same(best_loaded["state_dict"], dict(best_state))
    assert not [n for n in os.listdir(tmp_path / "export") if n.startswith(".")]


def test_consolidated_checkpoint_resumes_and_loads(tmp_path):
    seed()
    model = TinyModel()
    trainer = make_trainer(1, strategy="dcp_single_device", max_epochs=1)
    trainer.fit(model, datamodule=RandomDataModule())
    trainer.save_checkpoint(str(tmp_path / "dcp.ckpt"))
    single = consolidate(str(tmp_path / "dcp.ckpt"), dst=str(tmp_path / "single.ckpt"))

    assert_same(TinyModel.load_from_checkpoint(single).state_dict(), model.state_dict())
    resumed_model = TinyModel()
    resumed = make_trainer(1, strategy="auto", max_epochs=2)
    resumed.fit(resumed_model, datamodule=RandomDataModule(), ckpt_path=single)
    assert resumed.global_step == 2 * trainer.global_step
    opt_state = resumed.optimizers[0].state_dict()["state"]
    assert all(int(s["step"]) == resumed.global_step for s in opt_state.values())


_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    import lightning_dcp
    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    base = rss()
    for dst in sys.argv[2:]:
        lightning_dcp.consolidate(sys.argv[1], dst=dst, progress=False)
    print(base, hwm())
    """
)


def test_streaming_peak_rss_stays_far_below_checkpoint_size(tmp_path):
    tensor_bytes = 64 << 20
    state = {f"layer{i}.weight": torch.full((tensor_bytes // 4,), float(i)) for i in range(8)}
    DCPCheckpointIO(sync_files=False).save_checkpoint({"state_dict": state, "epoch": 0}, str(tmp_path / "big"))
    del state
    outputs = [str(tmp_path / "big.consolidated"), str(tmp_path / "big.safetensors")]
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "big"), *outputs], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    base, peak = map(int, result.stdout.split())
    # Checkpoint: 512 MiB. Streaming holds the tensor being read about three times (record bytes, decoded tensor,
    # target) and nothing else; loading everything would need > 512 MiB.
    assert peak - base < 0.5 * 8 * tensor_bytes, (peak - base) >> 20
    assert os.path.getsize(outputs[1]) > 8 * tensor_bytes
