"""Train ``ByteGPT`` on the standard library's sources with a hand-written Lightning Fabric loop and Hydra.

Checkpoints go through lightning_dcp's Fabric strategies (``configs/fabric_train.yaml``: ``DCPDDPStrategy`` with
async saves): every ``save_every`` steps each process writes its part of the state as one committed DCP directory
``ckpt_dir/step-NNNNNN``; a new run resumes from the newest committed one (at any number of processes); at the end
the last checkpoint is consolidated into one ``.pt`` in Fabric's own format. Run from the repository root::

    python examples/fabric_train.py                                   # 60 steps, 2 processes
    python examples/fabric_train.py max_steps=80 fabric.devices=1     # resume on 1 process, 20 more steps
    python examples/fabric_train.py fabric.strategy._target_=lightning_dcp.fabric.DCPModelParallelStrategy  # FSDP2

With ``fabric.devices > 1`` Fabric re-launches this script once per extra rank with the same Hydra overrides and
this run's directory, so every rank composes the same config and agrees on ``ckpt_dir``.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from lightning.fabric import Fabric
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python examples/fabric_train.py` puts examples/, not the repo root, on sys.path
    sys.path.insert(0, str(REPO_ROOT))

import lightning_dcp  # noqa: E402  (registers the dcp_* names in Fabric's strategy registry)
from examples.data import StdlibTextDataModule  # noqa: E402
from examples.gpt import VOCAB_SIZE  # noqa: E402
from lightning_dcp.fabric import latest_checkpoint  # noqa: E402


def _instantiate(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with ``_convert_="all"``: objects receive plain dicts/lists, never OmegaConf."""
    return hydra.utils.instantiate(node, _convert_="all", **kwargs)


def _batch(data: torch.Tensor, *, step: int, seed: int, size: int, fabric: Fabric, block: int):
    """This rank's share of the global batch of ``step``: random windows drawn from ``seed`` and ``step`` alone.

    The draw does not depend on the number of processes, so a run resumed at another world size trains on the same
    global batches (each rank takes every ``world_size``-th window).
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(len(data) - block - 1, (size,), generator=g)[fabric.global_rank :: fabric.world_size]
    windows = torch.stack([data[s : s + block + 1] for s in starts.tolist()]).long()
    return fabric.to_device(windows[:, :-1]), fabric.to_device(windows[:, 1:])


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).view(-1, VOCAB_SIZE), y.reshape(-1))


@torch.no_grad()
def _evaluate(fabric: Fabric, model: torch.nn.Module, data: torch.Tensor, cfg: dict[str, Any]) -> float:
    """Mean loss on the first ``eval_batches`` validation windows of each rank, averaged over ranks."""
    model.eval()
    block, size = cfg["model"]["block_size"], cfg["global_batch_size"]
    losses = []
    for i in range(cfg["eval_batches"]):
        x, y = _batch(data, step=-1 - i, seed=cfg["seed"], size=size, fabric=fabric, block=block)
        losses.append(_loss(model, x, y))
    model.train()
    return fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean").item()


def _size(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else 0


@hydra.main(config_path="../configs", config_name="fabric_train", version_base="1.3")
def main(hydra_cfg: DictConfig) -> None:
    """Compose the config, build Fabric, data and model, resume if possible, train, save, consolidate."""
    cfg: dict[str, Any] = OmegaConf.to_container(hydra_cfg, resolve=True)
    fabric: Fabric = _instantiate(cfg["fabric"])
    fabric.launch()
    fabric.seed_everything(cfg["seed"])
    if cfg["global_batch_size"] % fabric.world_size:
        raise ValueError(f"global_batch_size={cfg['global_batch_size']} must divide by {fabric.world_size} processes.")

    datamodule: StdlibTextDataModule = _instantiate(cfg["data"])
    if fabric.local_rank == 0:
        datamodule.prepare_data()
    fabric.barrier()
    datamodule.setup()
    train, val = datamodule.train_set.data, datamodule.val_set.data

    model = fabric.setup_module(_instantiate(cfg["model"]))
    configured = model.module.configure_optimizers()  # ByteGPT's AdamW groups + warmup/cosine schedule
    optimizer = fabric.setup_optimizers(configured["optimizer"])
    scheduler = configured["lr_scheduler"]["scheduler"]
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0, "config": cfg}

    ckpt_dir = cfg["ckpt_dir"].rstrip("/")
    options = cfg["fabric"]["strategy"].get("storage_options") if isinstance(cfg["fabric"]["strategy"], dict) else None
    resume = latest_checkpoint(ckpt_dir, storage_options=options) if cfg["resume"] and fabric.is_global_zero else None
    resume = fabric.broadcast(resume)
    if resume is not None:
        fabric.load(resume, state, strict=False)  # strict=False: the saved "config" may differ from this run's
        fabric.print(f"resumed from {resume} at step {state['step']} on {fabric.world_size} process(es)")
    fabric.print(f"ByteGPT: {model.module.count_parameters() / 1e6:.2f}M parameters, {fabric.world_size} process(es)")

    block, size = cfg["model"]["block_size"], cfg["global_batch_size"]
    saved: list[str] = [resume] if resume else []  # this run removes its predecessors beyond keep_last
    stalls: list[float] = []
    first_loss = last_loss = None
    started = time.perf_counter()
    while state["step"] < cfg["max_steps"]:
        x, y = _batch(train, step=state["step"], seed=cfg["seed"], size=size, fabric=fabric, block=block)
        loss = _loss(model, x, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        last_loss = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
        first_loss = last_loss if first_loss is None else first_loss
        if state["step"] % cfg["log_every"] == 0:
            fabric.print(f"step {state['step']:>5}  loss {last_loss:.4f}  lr {scheduler.get_last_lr()[0]:.2e}")
        if state["step"] % cfg["eval_every"] == 0:
            fabric.print(f"step {state['step']:>5}  val_loss {_evaluate(fabric, model, val, cfg):.4f}")
        if state["step"] % cfg["save_every"] == 0 or state["step"] == cfg["max_steps"]:
            path = f"{ckpt_dir}/step-{state['step']:06d}"
            fabric.save(path, state)
            stalls.append(fabric.strategy.checkpointer.last_save_seconds or 0.0)
            saved.append(path)
            if cfg["keep_last"] and len(saved) > cfg["keep_last"]:
                fabric.strategy.remove_checkpoint(saved.pop(0))  # deleted only after its successor is committed
    fabric.strategy.wait_for_save()  # Fabric never tears its strategy down: the last background save must land
    elapsed = time.perf_counter() - started

    last = saved[-1] if saved else resume
    if fabric.is_global_zero:
        run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
        consolidated = None
        if cfg["consolidate"] and last:
            consolidated = lightning_dcp.consolidate(
                last, dst=str(run_dir / "last.pt"), storage_options=options, overwrite=True, progress=False
            )
        script = [sys.executable, str(Path(__file__).resolve())]
        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("max_steps=", "fabric.devices="))]
        more = f"max_steps={cfg['max_steps'] + 20}"
        lines = [
            "",
            "=" * 100,
            f"steps              : {state['step']} ({elapsed:.1f} s for this run's steps)",
            f"loss               : {first_loss:.4f} -> {last_loss:.4f}" if last_loss is not None else "loss : n/a",
            f"last checkpoint    : {last}",
            f"checkpoint size    : {_size(last) / 2**20:.1f} MiB (all ranks' files)" if last else "",
            f"save stall (rank 0): {max(stalls):.3f} s at most over {len(stalls)} saves" if stalls else "",
            f"consolidated       : {consolidated}" if consolidated else "",
            "",
            f"# resume on {fabric.world_size} process(es), 20 more steps:",
            shlex.join([*script, *overrides, more]),
            "# resume on 1 process:",
            shlex.join([*script, *overrides, more, "fabric.devices=1"]),
            "# consolidate the last checkpoint into one .pt (Fabric's format; fabric.load reads it):",
            shlex.join([sys.executable, "-m", "lightning_dcp.consolidate", str(last), "-o", "last.pt"]),
            "=" * 100,
        ]
        print("\n".join(line for line in lines if line is not None), flush=True)


if __name__ == "__main__":
    main()
