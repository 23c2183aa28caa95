"""``dcp_single_device`` on CUDA: exact resume (weights, optimizer, CUDA RNG, step), consolidation, GPU loads."""

from __future__ import annotations

import os

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dcp import DCPCheckpointIO, consolidate, load_model_weights
from tests._models import DropoutModel, RandomDataModule, TinyModel
from tests._scenarios import perturb_rngs
from tests._trainer import assert_same, make_trainer, seed, snapshot, to_cpu
from tests.gpu._cuda import GPU, scenarios_fixture

pytestmark = GPU

STEPS = 8  # per epoch (whole batches of 4)


def _trainer(max_epochs: int, **kwargs):
    return make_trainer(
        1,
        strategy="dcp_single_device",
        accelerator="cuda",
        deterministic=True,
        max_epochs=max_epochs,
        **kwargs,
    )


def _resume_worker(rank: int, world_size: int, tmp: str) -> dict:
    seed()
    full = _trainer(2)
    full.fit(DropoutModel(), datamodule=RandomDataModule(n=4 * STEPS))  # dropout on CUDA draws from the CUDA generator
    assert full.strategy.root_device == torch.device("cuda", 0)  # strategy="dcp_single_device" takes the GPU
    result = {"full": {**to_cpu(snapshot(full)), "cuda_rng": torch.cuda.get_rng_state()}}

    seed()
    ckpt = ModelCheckpoint(dirpath=os.path.join(tmp, "ckpts"), every_n_epochs=1, save_top_k=-1)
    first = _trainer(1, callbacks=[ckpt])
    first.fit(DropoutModel(), datamodule=RandomDataModule(n=4 * STEPS))
    result["first"] = to_cpu(snapshot(first))

    perturb_rngs()  # other CPU and CUDA streams: the checkpoint's states must win
    resumed = _trainer(2)
    ckpt_path = os.path.join(tmp, "ckpts", f"epoch=0-step={STEPS}.ckpt")
    resumed.fit(DropoutModel(), datamodule=RandomDataModule(n=4 * STEPS), ckpt_path=ckpt_path)
    result["resumed"] = {**to_cpu(snapshot(resumed)), "cuda_rng": torch.cuda.get_rng_state()}
    return result


outcomes = scenarios_fixture([("resume", _resume_worker, ())], timeout=120)


def test_cuda_resume_is_exact_and_consolidates(outcomes):
    result = outcomes("resume")
    tmp = outcomes.directory("resume")
    full, first, resumed = (result[name] for name in ("full", "first", "resumed"))
    assert first["global_step"] == STEPS and resumed["global_step"] == 2 * STEPS
    for key in ("params", "optimizers", "lrs", "schedulers", "global_step", "epoch"):
        assert_same(full[key], resumed[key], key)
    assert resumed["losses"] == full["losses"][STEPS:]
    assert torch.equal(full["cuda_rng"], resumed["cuda_rng"])  # the CUDA generator continued where it stopped

    ckpt = os.path.join(tmp, "ckpts", f"epoch=0-step={STEPS}.ckpt")
    out = torch.load(consolidate(ckpt, dst=os.path.join(tmp, "one.ckpt")), weights_only=True)
    assert_same(first["params"], out["state_dict"], "consolidated.state_dict")
    assert out["global_step"] == STEPS and len(out["optimizer_states"]) == 1


def test_loads_fill_gpu_tensors_in_place(tmp_path):
    torch.manual_seed(0)
    model = TinyModel().cuda()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = str(tmp_path / "weights.ckpt")
    DCPCheckpointIO().save_checkpoint({"state_dict": model.state_dict(), "epoch": 0, "global_step": 0}, path)

    target = {"state_dict": {k: torch.zeros_like(v) for k, v in expected.items()}}
    pointers = {k: v.data_ptr() for k, v in target["state_dict"].items()}
    loaded = DCPCheckpointIO().load_checkpoint(path, state_dict=target)["state_dict"]
    for key, value in loaded.items():
        assert value.is_cuda and value.data_ptr() == pointers[key], key  # filled in place, on the GPU
        assert torch.equal(value, expected[key]), key

    fresh = TinyModel().cuda()
    report = load_model_weights(fresh, path)
    assert sorted(report.loaded_keys) == sorted(expected)
    for key, value in fresh.state_dict().items():
        assert value.is_cuda and torch.equal(value, expected[key]), key
