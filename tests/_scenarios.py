"""Test bodies shared by the CPU tiers and the GPU tier (tests/gpu): the same checks, on CPU in CI, on CUDA there.

Each scenario runs real Trainers in the calling process and either asserts itself or returns CPU snapshots for the
caller to compare (a spawned worker saves them with ``save_result``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dcp import DCPCheckpointIO, inspect_checkpoint, load_model_weights
from tests._models import CompiledBodyModel, MixedDtypeModel, RandomDataModule, TinyModel, TraceableModel
from tests._trainer import StateAtStart, assert_same, make_trainer, seed, snapshot, to_cpu

STEPS_PER_EPOCH = 8


def perturb_rngs() -> None:
    """Move every generator (torch CPU and CUDA, python, numpy) elsewhere, as a new process would: a resume must
    restore them from the checkpoint. ``PL_GLOBAL_SEED`` stays: Lightning seeds ``DistributedSampler`` from it."""
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def _data() -> RandomDataModule:
    """``STEPS_PER_EPOCH`` whole batches per epoch (not ``limit_train_batches``: a DDP resume then re-enters the
    cut epoch instead of starting the next one)."""
    return RandomDataModule(n=4 * STEPS_PER_EPOCH)


def _keys_and_names(obj: Any) -> list[str]:
    """Every dict key and string leaf of a nested checkpoint (where an FQN could hide)."""
    if isinstance(obj, dict):
        return [str(k) for k in obj] + [n for v in obj.values() for n in _keys_and_names(v)]
    if isinstance(obj, (list, tuple)):
        return [n for v in obj for n in _keys_and_names(v)]
    return [obj] if isinstance(obj, str) else []


def compiled_module_checkpoints(tmp: str, *, accelerator: str = "cpu", backend: str = "eager") -> None:
    """``torch.compile``d modules: checkpoint FQNs carry no ``_orig_mod.``; resumes and weight loads restore them.

    Two ways users compile: the whole LightningModule (``trainer.fit(torch.compile(model))``, which Lightning
    unwraps) and a submodule compiled in ``configure_model`` (whose own ``state_dict()`` keys carry ``_orig_mod.``).
    """
    plain = TinyModel()
    plain_keys, param_names = set(plain.state_dict()), {n for n, _ in plain.named_parameters()}
    makers: dict[str, Callable[[], Any]] = {
        "whole": lambda: torch.compile(TraceableModel(), backend=backend),
        "body": lambda: CompiledBodyModel(backend=backend),
    }

    def fit(make: Callable[[], Any], *, max_epochs: int, callback: Any, ckpt_path: str | None = None):
        trainer = make_trainer(
            1, strategy="dcp_single_device", accelerator=accelerator, max_epochs=max_epochs, callbacks=[callback]
        )
        trainer.fit(make(), datamodule=_data(), ckpt_path=ckpt_path)
        return trainer

    for name, make in makers.items():
        seed()
        dirpath = os.path.join(tmp, name)
        trainer = fit(make, max_epochs=1, callback=ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0))
        saved = to_cpu(snapshot(trainer))
        last = os.path.join(dirpath, "last.ckpt")
        if name == "body":  # the trap is set: the module's own keys carry the compiler's prefix
            assert "body._orig_mod.0.weight" in trainer.lightning_module.state_dict()

        loaded = DCPCheckpointIO().load_checkpoint(last)
        leaked = [k for k in _keys_and_names(loaded) if "_orig_mod" in k]
        assert not leaked, f"{name}: compiler prefixes in the checkpoint: {leaked[:5]}"
        assert set(loaded["state_dict"]) == plain_keys, name
        # On disk, optimizer state is keyed by FQN (loaded without a target it comes back in integer-id layout).
        prefix = "optimizer_states.0.state."
        saved_fqns = {
            t["key"][len(prefix) :].rsplit(".", 1)[0]
            for t in inspect_checkpoint(last)["tensors"]
            if t["key"].startswith(prefix)
        }
        assert saved_fqns == param_names, name
        assert not [t["key"] for t in inspect_checkpoint(last)["tensors"] if "_orig_mod" in t["key"]], name
        assert_same(saved["params"], loaded["state_dict"], f"{name}.state_dict")

        probe = StateAtStart()
        perturb_rngs()
        resumed = fit(make, max_epochs=2, callback=probe, ckpt_path=last)
        for key in ("params", "optimizers", "global_step"):
            assert_same(saved[key], probe.state[key], f"{name}.{key}")
        assert resumed.global_step == 2 * STEPS_PER_EPOCH

        fresh = TinyModel()
        report = load_model_weights(fresh, last)
        assert sorted(report.loaded_keys) == sorted(plain_keys) and not report.missing_keys
        assert_same(saved["params"], fresh.state_dict(), f"{name}.load_model_weights")


def mixed_state_runs(
    tmp: str,
    *,
    accelerator: str = "cpu",
    world_size: int = 1,
    strategy: Callable[[], Any] = lambda: "dcp_single_device",
    model: Callable[[], Any] = MixedDtypeModel,
    precision: str = "bf16-mixed",
    modes: tuple[str, ...] = ("sync", "async"),
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Two epochs straight, then per save mode one epoch + checkpoint and a resume for the second epoch.

    Returns CPU values: ``{"full": snapshot, mode: snapshot, f"{mode}-ckpt": the checkpoint's state_dict and
    optimizer_states as loaded on one process}`` for :func:`check_mixed_state`. Collective: call on all ranks.
    """

    def trainer(max_epochs: int, **kwargs: Any):
        return make_trainer(
            world_size,
            strategy=strategy(),
            accelerator=accelerator,
            precision=precision,
            max_epochs=max_epochs,
            **trainer_kwargs,
            **kwargs,
        )

    seed()
    full = trainer(2)
    full.fit(model(), datamodule=_data())
    results: dict[str, Any] = {"full": to_cpu(snapshot(full))}
    for mode in modes:
        dirpath = os.path.join(tmp, mode)
        seed()
        first = trainer(
            1,
            callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=0)],
            plugins=[DCPCheckpointIO(async_save=mode == "async")],
        )
        first.fit(model(), datamodule=_data())
        last = os.path.join(dirpath, "last.ckpt")
        perturb_rngs()
        resumed = trainer(2, plugins=[DCPCheckpointIO(async_save=mode == "async")])
        resumed.fit(model(), datamodule=_data(), ckpt_path=last)
        results[mode] = to_cpu(snapshot(resumed))
        loaded = DCPCheckpointIO().load_checkpoint(last) if resumed.global_rank == 0 else {}
        results[f"{mode}-ckpt"] = {k: loaded.get(k) for k in ("state_dict", "optimizer_states")}
    return results


def check_mixed_state(results: dict[str, Any], *, bf16_param: str | None = "gate") -> None:
    """Every resume equals the uninterrupted run exactly; bf16 entries stay bf16 in the checkpoint, fp32 stay fp32."""
    full = results["full"]
    modes = [k for k in results if k != "full" and not k.endswith("-ckpt")]
    assert modes
    for mode in modes:
        for key in ("params", "optimizers", "lrs", "schedulers", "global_step", "epoch"):
            assert_same(full[key], results[mode][key], f"{mode}.{key}")
        assert results[mode]["losses"] == full["losses"][STEPS_PER_EPOCH:], mode
        saved = results[f"{mode}-ckpt"]
        assert saved["state_dict"]["body.0.weight"].dtype == torch.float32
        if bf16_param is not None:
            assert saved["state_dict"][bf16_param].dtype == torch.bfloat16, mode
            assert saved["state_dict"]["ema"].dtype == torch.bfloat16, mode
            # Loaded without a target, optimizer state has optimizer.state_dict()'s layout: integer parameter ids
            # in the order the optimizer holds them (configure_optimizers passes self.parameters()).
            param_id = [name for name, _ in MixedDtypeModel().named_parameters()].index(bf16_param)
            moments = saved["optimizer_states"][0]["state"][param_id]
            assert moments["exp_avg"].dtype == moments["exp_avg_sq"].dtype == torch.bfloat16, mode
