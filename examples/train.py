"""Train ``ByteGPT`` on the standard library's sources with Hydra + Lightning, checkpointing through lightning_dcp.

Run from the repository root::

    python examples/train.py                                    # tiny model, 2 CPU processes, dcp_ddp
    python examples/train.py model=small trainer.max_steps=200  # another size from configs/model/
    python examples/train.py ckpt_path=last trainer.max_steps=120 model.max_steps=60  # resume, same LR schedule

With ``trainer.devices > 1`` Lightning re-launches this script once per extra rank (its subprocess launcher passes
the same Hydra overrides plus ``hydra.run.dir=<this run's dir>``), so every rank composes the same config, writes
into the same run directory and agrees on the checkpoint directory, which the config pins independently of the run
directory (``ckpt_dir``) so that ``ckpt_path=last`` finds the previous run's checkpoints.
"""

from __future__ import annotations

import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python examples/train.py` puts examples/, not the repo root, on sys.path
    sys.path.insert(0, str(REPO_ROOT))

import lightning_dcp  # noqa: E402,F401  (registers the dcp_* strategy names)

# Lightning 2.6 + torch >= 2.9 emit this deprecation on every step's output handling; it is not actionable here.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def _instantiate(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with ``_convert_="all"``: objects receive plain dicts/lists, never OmegaConf."""
    return hydra.utils.instantiate(node, _convert_="all", **kwargs)


def _shell(argv: list[str]) -> str:
    """``argv`` as one copy-pastable shell command line."""
    return " ".join(shlex.quote(a) for a in argv)


def resume_commands(resume: list[str], world_size: int) -> list[tuple[str, list[str]]]:
    """``(title, argv)`` to resume on this run's process count, and on one other (1; 2 after a 1-process run)."""
    other = 1 if world_size > 1 else 2
    elsewhere = [*(a for a in resume if not a.startswith("trainer.devices=")), f"trainer.devices={other}"]
    return [
        (f"# resume on {world_size} process(es):", resume),
        (f"# resume on {other} process{'es' if other > 1 else ''}:", elsewhere),
    ]


def _report(trainer: lightning.pytorch.Trainer, cfg: dict[str, Any]) -> None:
    """Print where the checkpoints are, the final step and loss, and follow-up commands (global rank 0 only)."""
    ckpt_cb = trainer.checkpoint_callback
    dirpath = Path(ckpt_cb.dirpath).resolve() if ckpt_cb and ckpt_cb.dirpath else None
    last = ckpt_cb.last_model_path if ckpt_cb else ""
    best = ckpt_cb.best_model_path if ckpt_cb else ""
    last = str(Path(last).resolve()) if last else ""
    best = str(Path(best).resolve()) if best else ""
    val_loss = trainer.callback_metrics.get("val_loss")
    io = trainer.strategy.checkpoint_io
    save_seconds = getattr(io, "last_save_seconds", None)
    size = sum(p.stat().st_size for p in Path(last).rglob("*") if p.is_file()) if last and Path(last).is_dir() else 0
    train_loss = trainer.callback_metrics.get("train_loss")

    # Resume = this run's overrides + the checkpoint + model.max_steps more steps. The LR schedule length
    # (model.max_steps, which defaults to trainer.max_steps) is pinned so resuming does not re-stretch the cosine.
    replaced = ("ckpt_path=", "trainer.max_steps=", "model.max_steps=")
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(replaced)]
    script = [sys.executable, str(Path(__file__).resolve())]
    resume = [
        *script,
        *overrides,
        f"ckpt_path={last or 'last'}",
        f"trainer.max_steps={trainer.global_step + cfg['model']['max_steps']}",
        f"model.max_steps={cfg['model']['max_steps']}",
    ]
    # The consolidated file goes to the run directory, not the checkpoint dirpath: Lightning's ModelCheckpoint takes
    # every "last*.ckpt" in dirpath as a ckpt_path="last" candidate, so "last.consolidated.ckpt" there (the newest
    # file) would become the "last" checkpoint of the next resume.
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    consolidate = [sys.executable, "-m", "lightning_dcp.consolidate", last, "--output"]
    consolidate.append(str(run_dir / "last.consolidated.ckpt"))

    lines = [
        "",
        "=" * 100,
        f"run directory      : {run_dir}",
        f"checkpoint dirpath : {dirpath}",
        f"last checkpoint    : {last or '(none)'}",
        f"best checkpoint    : {best or '(none)'}",
        f"checkpoint size    : {size / 2**20:.1f} MiB (all ranks' files)" if size else "checkpoint size    : n/a",
        f"last save took     : {save_seconds:.3f} s (rank 0, blocking)" if save_seconds else "last save took     : n/a",
        f"global_step        : {trainer.global_step}",
        f"train_loss (last)  : {float(train_loss):.4f}" if train_loss is not None else "train_loss (last)  : n/a",
        f"val_loss (last)    : {float(val_loss):.4f}" if val_loss is not None else "val_loss (last)    : n/a",
        "",
        *(line for title, argv in resume_commands(resume, trainer.world_size) for line in (title, _shell(argv))),
        "# consolidate the last checkpoint into one Lightning .ckpt file:",
        _shell(consolidate) if last else "(no checkpoint was saved)",
        "=" * 100,
    ]
    print("\n".join(lines), flush=True)


def _check_launch(trainer: lightning.pytorch.Trainer) -> None:
    """Refuse ``--multirun`` when Lightning itself would start the extra ranks.

    Lightning's subprocess launcher re-runs ``sys.argv`` (``-m`` included) for every extra rank, so each rank would
    start its own sweep in its own sweep directory. Single runs are fine; for sweeps use ``trainer.devices=1`` or
    launch the ranks externally (``torchrun``).

    Raises:
        ValueError: Multirun with more than one process started by Lightning.
    """
    env = getattr(trainer.strategy, "cluster_environment", None)
    spawns = trainer.world_size > 1 and env is not None and not env.creates_processes_externally
    if spawns and HydraConfig.get().mode == RunMode.MULTIRUN:
        raise ValueError(
            "Hydra --multirun with trainer.devices > 1 is not supported: Lightning re-launches the whole sweep in "
            "every extra rank. Use trainer.devices=1 for sweeps, or start the ranks with torchrun."
        )


_NOT_RESUMABLE = "dataloader is not resumable"
"""Lightning's warning on a resume from a checkpoint saved in the middle of an epoch (its loop state is exact, the
plain DataLoader's position is not saved)."""


def _explain_resume_warning() -> None:
    """Follow Lightning's mid-epoch resume warning with what it means for this run (printed once, after it)."""
    show = warnings.showwarning

    def showwarning(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        show(message, category, filename, lineno, file, line)
        if _NOT_RESUMABLE in str(message):
            print(
                "lightning_dcp demo: what this means here: model, optimizer, scheduler and step counters were"
                " restored exactly from the checkpoint; only the position inside the interrupted epoch was not (the"
                " DataLoader has no state). This run starts that epoch again from its first batch: it sees those"
                " batches a second time and the epoch's last ones not at all (at another process count the batches"
                " also split differently). Losses stay comparable; for an exact continuation, resume from an"
                " end-of-epoch checkpoint or add `lightning_dcp.ElasticResume()` to the callbacks (docs/resume.md).",
                file=sys.stderr,
                flush=True,
            )

    warnings.showwarning = showwarning


@hydra.main(config_path="../configs", config_name="train", version_base="1.3")
def main(hydra_cfg: DictConfig) -> None:
    """Compose the config, build data/model/callbacks/Trainer and fit."""
    cfg: dict[str, Any] = OmegaConf.to_container(hydra_cfg, resolve=True)  # plain types only from here on
    lightning.seed_everything(cfg["seed"], workers=True)

    datamodule = _instantiate(cfg["data"])
    model = _instantiate(cfg["model"])
    callbacks = [_instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    logger = _instantiate(cfg["logger"]) if cfg.get("logger") else None
    trainer = _instantiate(cfg["trainer"], callbacks=callbacks, logger=logger)
    _check_launch(trainer)

    if trainer.is_global_zero:
        print(f"ByteGPT: {model.count_parameters():,} parameters ({model.count_parameters() / 1e6:.2f}M)", flush=True)
    _explain_resume_warning()
    trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    if trainer.is_global_zero:
        _report(trainer, cfg)


if __name__ == "__main__":
    main()
