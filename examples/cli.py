"""Train ``ByteGPT`` with ``LightningCLI`` instead of Hydra; same model, data and lightning_dcp checkpointing.

Run from the repository root::

    python examples/cli.py fit --config configs/cli.yaml
    python examples/cli.py fit --config configs/cli.yaml --ckpt_path last --trainer.max_steps 120
    python examples/cli.py fit --config configs/cli.yaml --print_config     # the fully resolved config

``data.block_size`` follows ``model.block_size`` and ``model.max_steps`` (the LR schedule length) follows
``trainer.max_steps``; both are linked below rather than set in the YAML.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python examples/cli.py` puts examples/, not the repo root, on sys.path
    sys.path.insert(0, str(REPO_ROOT))

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402

import lightning_dcp  # noqa: E402,F401  (registers the dcp_* strategy names)
from examples.data import StdlibTextDataModule  # noqa: E402
from examples.gpt import ByteGPT  # noqa: E402

# Lightning 2.6 + torch >= 2.9 emit this deprecation on every step's output handling; it is not actionable here.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


class ByteGPTCLI(LightningCLI):
    """``LightningCLI`` for ``ByteGPT`` + ``StdlibTextDataModule`` with the shared arguments linked."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Link ``model.block_size -> data.block_size`` and ``trainer.max_steps -> model.max_steps``."""
        parser.link_arguments("model.block_size", "data.block_size")
        parser.link_arguments("trainer.max_steps", "model.max_steps")

    def after_fit(self) -> None:
        """Print the checkpoint paths, final step and losses on global rank 0."""
        trainer = self.trainer
        ckpt = trainer.checkpoint_callback
        if not trainer.is_global_zero or ckpt is None:
            return
        metrics = {k: f"{float(v):.4f}" for k, v in trainer.callback_metrics.items() if k.endswith("loss")}
        last = str(Path(ckpt.last_model_path).resolve()) if ckpt.last_model_path else "(none)"
        print(f"checkpoint dirpath: {Path(ckpt.dirpath).resolve()}", flush=True)
        print(f"last checkpoint   : {last}", flush=True)
        print(f"global_step       : {trainer.global_step}  {metrics}", flush=True)


def main() -> None:
    """Entry point: ``python examples/cli.py {fit,validate,...} --config configs/cli.yaml``."""
    ByteGPTCLI(ByteGPT, StdlibTextDataModule, seed_everything_default=1234, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
