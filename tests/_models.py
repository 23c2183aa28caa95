"""Small real models and data for the tests: deterministic, fast on CPU, with every kind of Trainer state."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class RandomDataModule(LightningDataModule):
    """Fixed random regression data (seeded), with a stateful counter to check datamodule state round trips."""

    def __init__(self, n: int = 64, dim: int = 8, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 2, generator=g)
        self.fit_calls = 0

    def setup(self, stage: str) -> None:
        self.fit_calls += 1

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x[:16], self.y[:16]), batch_size=self.hparams.batch_size)

    def state_dict(self) -> dict:
        return {"fit_calls": self.fit_calls}

    def load_state_dict(self, state_dict: dict) -> None:
        self.fit_calls = state_dict["fit_calls"]


class TinyModel(LightningModule):
    """Two optimizers (AdamW + SGD with momentum), two lr schedulers, manual bookkeeping of losses."""

    def __init__(self, dim: int = 8, hidden: int = 16, lr: float = 0.01, two_optimizers: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, 2)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.losses: list[float] = []
        self.extra_saved: dict | None = None
        if two_optimizers:
            self.automatic_optimization = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.seen += x.shape[0]
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        if self.hparams.two_optimizers:
            opt_a, opt_b = self.optimizers()
            opt_a.zero_grad()
            opt_b.zero_grad()
            self.manual_backward(loss)
            opt_a.step()
            opt_b.step()
            for sched in self.lr_schedulers():
                sched.step()
            return None
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.two_optimizers:
            opt_a = torch.optim.AdamW(self.body.parameters(), lr=self.hparams.lr)
            opt_b = torch.optim.SGD(self.head.parameters(), lr=self.hparams.lr, momentum=0.9)
            return [opt_a, opt_b], [
                torch.optim.lr_scheduler.StepLR(opt_a, step_size=3, gamma=0.5),
                torch.optim.lr_scheduler.ExponentialLR(opt_b, gamma=0.9),
            ]
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
                "interval": "step",
            },
        }

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["my_extra"] = {"note": "kept", "values": [1, 2, 3]}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.extra_saved = checkpoint.get("my_extra")


class OtherModel(LightningModule):
    """A different architecture, to load a TinyModel checkpoint into (missing / unexpected / mismatched keys)."""

    def __init__(self, dim: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden))
        self.other = nn.Linear(hidden, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.other(self.body(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FSDP2Model(TinyModel):
    """TinyModel sharded with FSDP2 ``fully_shard`` per Linear layer (for ModelParallelStrategy on CPU).

    ``hidden=50`` gives uneven shards at 3 ranks (50 rows over 3).
    """

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in [*self.body, self.head]:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


class DropoutModel(TinyModel):
    """TinyModel with dropout: its training consumes the global torch RNG every step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.body(x)))


class MixedDtypeModel(TinyModel):
    """TinyModel with bf16 state beside the fp32 weights: a bf16 parameter ``gate`` (so AdamW keeps bf16 moments
    for it) and a bf16 buffer ``ema`` (of the loss) updated every step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        hidden = self.hparams.hidden
        self.gate = nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16))
        self.register_buffer("ema", torch.zeros(hidden, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x) * self.gate.float())

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        with torch.no_grad():  # from the loss, not from ``gate``: under FSDP2 that is a DTensor shard here
            self.ema.mul_(0.9).add_(loss.detach().to(torch.bfloat16), alpha=0.1)
        return loss


class MixedDtypeFSDP2Model(FSDP2Model, MixedDtypeModel):
    """MixedDtypeModel sharded like FSDP2Model: each Linear is its own fp32 group, the root holds the bf16 ``gate``
    (FSDP2 needs one dtype per group)."""


class TraceableModel(TinyModel):
    """TinyModel whose ``training_step`` dynamo can trace: no ``self.log``, no ``.item()``. ``trainer.fit(
    torch.compile(model))`` compiles ``training_step`` too, and dynamo fails on ``self.log`` (torch 2.13)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += x.shape[0]
        return nn.functional.mse_loss(self(x), y)


class CompiledBodyModel(TinyModel):
    """TinyModel whose ``body`` is replaced by ``torch.compile(body)`` in ``configure_model``: its own
    ``state_dict()`` keys read ``body._orig_mod.0.weight``, which must not reach a checkpoint."""

    def __init__(self, backend: str = "eager", **kwargs) -> None:
        super().__init__(**kwargs)
        self.compile_backend = backend

    def configure_model(self) -> None:
        if not hasattr(self.body, "_orig_mod"):  # configure_model runs again on a second fit
            self.body = torch.compile(self.body, backend=self.compile_backend)


class IndexedDataset(torch.utils.data.Dataset):
    """Fixed random regression data whose items carry their own index: ``(x, y, index)``."""

    def __init__(self, n: int = 64, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


class IndexedDataModule(LightningDataModule):
    """``IndexedDataset`` shuffled, ``batch_size`` samples per device."""

    def __init__(self, n: int = 64, batch_size: int = 4) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IndexedDataset(self.n), batch_size=self.batch_size, shuffle=True)


class IdLoggingModel(TinyModel):
    """TinyModel that records, per training batch, ``(epoch, global_step, sample ids)`` in ``self.seen_ids``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen_ids: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        self.seen_ids.append((self.current_epoch, self.trainer.global_step, ids.tolist()))
        return super().training_step((x, y), batch_idx)


class Payload:
    """An object whose unpickling would create the file ``marker``: loading a checkpoint must never run it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))
