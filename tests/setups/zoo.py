"""The zoo of ordinary training setups, one small class each (see :mod:`tests.setups._base` for the defaults)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging
from torch import nn
from torch.optim.swa_utils import AveragedModel

from tests.setups._base import Setup, ZooModel, register


@register
class PlainAdamW(Setup):
    """The default: an MLP with AdamW."""

    name = "plain_adamw"
    fabric = True
    fsdp2 = True


# ------------------------------------------------------------------------------------ parameters without state
class _UnusedHead(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(16, 3)  # in the optimizer, never in the forward: no gradient, no state


@register
class UnusedHead(Setup):
    """A parameter that never gets a gradient (an unused head) in the optimizer."""

    name = "unused_head"
    ci = True
    find_unused = True
    fabric = True
    fsdp2 = True

    def model(self, resumed: bool) -> ZooModel:
        return _UnusedHead()


class _Frozen(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.body[0].requires_grad_(False)  # frozen from the start, still in the optimizer


@register
class FrozenParameter(Setup):
    """Parameters frozen from the start (``requires_grad=False``) in the optimizer: no state."""

    name = "frozen_parameter"
    find_unused = True
    fabric = True
    fsdp2 = True

    def model(self, resumed: bool) -> ZooModel:
        return _Frozen()


class _FrozenAtResume(ZooModel):
    def __init__(self, resumed: bool) -> None:
        super().__init__()
        if resumed:
            self.body[2].requires_grad_(False)  # trained before the save, frozen at the resume: keeps its state


@register
class FrozenAtResume(Setup):
    """Parameters trained before the save and frozen when the run resumes keep their saved optimizer state."""

    name = "frozen_at_resume"
    ci = True
    find_unused = True
    continues = False  # the resumed run trains fewer parameters than the uninterrupted one, by design
    fabric = True
    fsdp2 = True

    def model(self, resumed: bool) -> ZooModel:
        return _FrozenAtResume(resumed)


class _Unfreeze(Callback):
    """Progressive unfreezing: ``body.0`` trains from epoch 1 on (its parameters are in the optimizer all along)."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        pl_module.body[0].requires_grad_(trainer.current_epoch >= 1)


@register
class ProgressiveUnfreezing(Setup):
    """A callback unfreezes the first layer at epoch 1; the resume continues with it trained."""

    name = "progressive_unfreezing"
    ci = True
    find_unused = True

    def continues_at(self, world_size: int) -> bool:
        # DDP all-reduces only the parameters that required grad when it wrapped the model: the layer unfrozen later
        # trains apart on each rank, and a resume (stock's, and ours) starts every rank from rank 0's copy
        return world_size == 1

    def model(self, resumed: bool) -> ZooModel:
        return _Frozen()

    def callbacks(self, resumed: bool) -> list[Any]:
        return [_Unfreeze()]


# ----------------------------------------------------------------------------------- finetuning, SWA, averaging
class _Backbone(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = self.body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)


@register
class BackboneFinetuningAfterUnfreeze(Setup):
    """Lightning's ``BackboneFinetuning`` saved after it unfroze the backbone (a param group added mid-run)."""

    name = "backbone_finetuning"
    ci = True
    epochs = 2
    find_unused = True
    continues = False  # stock's resume: the backbone is frozen again at setup and never unfrozen (Lightning's own)

    def model(self, resumed: bool) -> ZooModel:
        return _Backbone()

    def callbacks(self, resumed: bool) -> list[Any]:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)]


@register
class BackboneFinetuningBeforeUnfreeze(Setup):
    """``BackboneFinetuning`` saved before it unfreezes; it unfreezes in the resumed run."""

    name = "backbone_finetuning_before_unfreeze"
    epochs = 1
    more = 2
    find_unused = True

    def model(self, resumed: bool) -> ZooModel:
        return _Backbone()

    def callbacks(self, resumed: bool) -> list[Any]:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]


@register
class SWA(Setup):
    """Lightning's ``StochasticWeightAveraging`` callback, saved after averaging started."""

    name = "swa_callback"
    ci = True
    epochs = 2

    def callbacks(self, resumed: bool) -> list[Any]:
        return [StochasticWeightAveraging(swa_lrs=0.005, swa_epoch_start=1, annealing_epochs=1)]


class _EMA(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.ema = AveragedModel(self.body)  # its parameters are in the optimizer, never get a gradient

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.ema.update_parameters(self.body)


@register
class EMAInModule(Setup):
    """An EMA copy (``torch.optim.swa_utils.AveragedModel``) inside the module, its parameters in the optimizer."""

    name = "ema_averaged_model"
    ci = True
    find_unused = True
    fabric = True

    def model(self, resumed: bool) -> ZooModel:
        return _EMA()


# ------------------------------------------------------------------------------------------- optimizer layouts
class _LBFGS(ZooModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3, history_size=4)


@register
class LBFGSClosure(Setup):
    """``torch.optim.LBFGS`` (a closure; its whole state under the first parameter, partly in lists)."""

    name = "lbfgs"
    ci = True
    fabric = True

    def model(self, resumed: bool) -> ZooModel:
        return _LBFGS()


class _BatchNorm(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh()
        )
        self.norm = nn.BatchNorm1d(2, momentum=None)  # a cumulative average

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.head(self.body(x)))


@register
class BatchNorm(Setup):
    """BatchNorm: running statistics differ between DDP ranks between forwards; stock keeps rank 0's."""

    name = "batchnorm"
    ci = True
    fabric = True
    fsdp2 = True

    def model(self, resumed: bool) -> ZooModel:
        return _BatchNorm()

    def trainer_args(self) -> dict[str, Any]:
        # no validation: the save follows a training forward, after which each rank holds its own statistics (a
        # validation forward would first broadcast rank 0's, as DDP does at every forward)
        return {"limit_val_batches": 0}


class _Plateau(ZooModel):
    def __init__(self, synced: bool) -> None:
        super().__init__()
        self.synced = synced

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # unsynced, each rank's scheduler sees its own value; scaled by rank so that their decisions differ here
        scale = 1.0 if self.synced else 1.0 + 99.0 * self.global_rank
        self.log("val_loss", self.loss(batch) * scale, sync_dist=self.synced)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, factor=0.5, patience=0, threshold=0.05, threshold_mode="abs"
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


@register
class PlateauSynced(Setup):
    """``ReduceLROnPlateau`` monitoring a validation loss synced across ranks."""

    name = "plateau_synced"
    epochs = 3
    continues = False  # Lightning does not step plateau schedulers at the first epoch end after a restart (stock's)

    def model(self, resumed: bool) -> ZooModel:
        return _Plateau(synced=True)


@register
class PlateauUnsynced(Setup):
    """``ReduceLROnPlateau`` on a metric not synced across ranks: per-rank scheduler and learning rates."""

    name = "plateau_unsynced"
    ci = True
    epochs = 4  # rank 0 has reduced its learning rate twice by then, rank 1 once: the ranks' weights differ
    continues = False  # at 2 ranks the ranks' weights differ; stock (and we) resume every rank from rank 0's

    def model(self, resumed: bool) -> ZooModel:
        return _Plateau(synced=False)


# ------------------------------------------------------------------------------------------------ param groups
class _Groups(ZooModel):
    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if n.endswith("bias")]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}], lr=0.01
        )


@register
class ParamGroups(Setup):
    """Two param groups with their own learning rate and weight decay."""

    name = "param_groups"
    fabric = True
    fsdp2 = True

    def model(self, resumed: bool) -> ZooModel:
        return _Groups()


class _HeadLater(ZooModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.body.parameters(), lr=0.01)


class _AddHeadGroup(Callback):
    """Adds the head's parameters as a param group at epoch 1, and again on a resume after that (from its state)."""

    def __init__(self) -> None:
        self.added = False

    def _add(self, trainer: Any, pl_module: Any) -> None:
        trainer.optimizers[0].add_param_group({"params": list(pl_module.head.parameters()), "lr": 0.03})

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.added:  # restored: the group exists in the saved optimizer state
            self._add(trainer, pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1 and not self.added:
            self._add(trainer, pl_module)
            self.added = True

    def state_dict(self) -> dict[str, Any]:
        return {"added": self.added}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.added = state_dict["added"]


@register
class AddParamGroup(Setup):
    """``optimizer.add_param_group`` at epoch 1 from a callback that re-adds the group on a resume."""

    name = "add_param_group"

    def model(self, resumed: bool) -> ZooModel:
        return _HeadLater()

    def callbacks(self, resumed: bool) -> list[Any]:
        return [_AddHeadGroup()]


class _NamedParams(ZooModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.named_parameters(), lr=0.01)  # groups carry ``param_names`` (torch >= 2.6)


@register
class NamedParameters(Setup):
    """An optimizer built from ``named_parameters()``: its param groups hold the names."""

    name = "named_parameters_optimizer"

    def model(self, resumed: bool) -> ZooModel:
        return _NamedParams()


class _TensorLR(ZooModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=torch.tensor(0.01), betas=(0.8, 0.95))


@register
class TensorLearningRate(Setup):
    """A tensor learning rate in the param group (an option that is a tensor)."""

    name = "tensor_lr"

    def model(self, resumed: bool) -> ZooModel:
        return _TensorLR()


class _Fused(ZooModel):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)


@register
class FusedAdamW(Setup):
    """``AdamW(fused=True)``: its ``step`` is cast to float32 on the parameter's device by ``load_state_dict``."""

    name = "fused_adamw"

    def model(self, resumed: bool) -> ZooModel:
        return _Fused()


# --------------------------------------------------------------------------- every torch.optim optimizer, manual
class _Manual(ZooModel):
    """Manual optimization over ``body.0``, ``body.2``, ``mid``, ``head`` with one optimizer each (``make``)."""

    def __init__(self, make: Any, schedulers: Any = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.mid = nn.Linear(16, 16)
        self.make, self.make_schedulers = make, schedulers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.body(x))))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = self.loss(batch)
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        schedulers = self.lr_schedulers()
        for scheduler in schedulers if isinstance(schedulers, list) else [schedulers] if schedulers else []:
            scheduler.step()
        self.log("train_loss", loss)

    def configure_optimizers(self) -> Any:
        layers = (self.body[0], self.body[2], self.mid, self.head)
        optimizers = [make(layer.parameters()) for make, layer in zip(self.make, layers, strict=True)]
        if self.make_schedulers is None:
            return optimizers
        return optimizers, [make(optimizers[i]) for i, make in self.make_schedulers]


@register
class OptimizersA(Setup):
    """Manual optimization, four optimizers: Adam (amsgrad), Adamax, Adagrad, Adadelta."""

    name = "optimizers_adam_family"
    ci = True
    fabric = True
    fsdp2 = True

    def model(self, resumed: bool) -> ZooModel:
        return _Manual(
            (
                lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
                lambda p: torch.optim.Adamax(p, lr=0.01),
                lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01),
                lambda p: torch.optim.Adadelta(p, lr=0.5),
            )
        )


@register
class OptimizersB(Setup):
    """Manual optimization, four optimizers: RMSprop (centered, momentum), Rprop, NAdam, RAdam (decoupled)."""

    name = "optimizers_rms_family"

    def model(self, resumed: bool) -> ZooModel:
        return _Manual(
            (
                lambda p: torch.optim.RMSprop(p, lr=0.01, centered=True, momentum=0.5),
                lambda p: torch.optim.Rprop(p, lr=0.01),
                lambda p: torch.optim.NAdam(p, lr=0.01, decoupled_weight_decay=True, weight_decay=0.01),
                lambda p: torch.optim.RAdam(p, lr=0.01, decoupled_weight_decay=True, weight_decay=0.01),
            )
        )


@register
class OptimizersC(Setup):
    """Manual optimization, four optimizers: ASGD, SGD (nesterov), plain SGD (no state at all), Adafactor."""

    name = "optimizers_sgd_family"

    def model(self, resumed: bool) -> ZooModel:
        return _Manual(
            (
                lambda p: torch.optim.ASGD(p, lr=0.01, t0=2),
                lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True),
                lambda p: torch.optim.SGD(p, lr=0.01),
                lambda p: torch.optim.Adafactor(p, lr=0.01),
            )
        )


class _Muon(ZooModel):
    def configure_optimizers(self) -> Any:
        matrices = [p for p in self.parameters() if p.ndim == 2]
        rest = [p for p in self.parameters() if p.ndim != 2]
        return [torch.optim.Muon(matrices, lr=0.01), torch.optim.AdamW(rest, lr=0.01)]

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        muon, adamw = self.optimizers()
        muon.zero_grad(), adamw.zero_grad()
        self.manual_backward(self.loss(batch))
        muon.step(), adamw.step()


@register
class Muon(Setup):
    """``torch.optim.Muon`` for the weight matrices beside AdamW for the rest (manual optimization)."""

    name = "muon"

    def model(self, resumed: bool) -> ZooModel:
        return _Muon()


class _Sparse(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embedding = nn.Embedding(20, 8, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = (x.abs() * 4).long().clamp(max=19)
        return self.head(self.body(self.embedding(index).mean(dim=1) + x))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        sparse, dense = self.optimizers()
        sparse.zero_grad(), dense.zero_grad()
        self.manual_backward(self.loss(batch))
        sparse.step(), dense.step()

    def configure_optimizers(self) -> Any:
        dense = [p for n, p in self.named_parameters() if not n.startswith("embedding")]
        return [torch.optim.SparseAdam(self.embedding.parameters(), lr=0.01), torch.optim.Adam(dense, lr=0.01)]


@register
class SparseEmbedding(Setup):
    """A sparse embedding with ``SparseAdam`` (its ``step`` is a Python int) beside Adam."""

    name = "sparse_embedding"
    ranks = (1,)  # DDP over gloo all-reduces sparse gradients only with static graphs; one rank here

    def model(self, resumed: bool) -> ZooModel:
        return _Sparse()


# ------------------------------------------------------------------------------------------------- schedulers
class _Scheduled(ZooModel):
    def __init__(self, make: Any, interval: str = "epoch", momentum: bool = False) -> None:
        super().__init__()
        self.make, self.interval, self.momentum = make, interval, momentum

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        schedulers = self.make(optimizer)
        return [optimizer], [{"scheduler": s, "interval": self.interval} for s in schedulers]


@register
class EpochSchedulers(Setup):
    """Two epoch-wise schedulers on one optimizer: ``StepLR`` and ``ExponentialLR``."""

    name = "schedulers_epoch"

    def model(self, resumed: bool) -> ZooModel:
        return _Scheduled(
            lambda o: [
                torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7),
                torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
            ]
        )


@register
class OneCycle(Setup):
    """``OneCycleLR`` stepped every batch (its momentum cycles too)."""

    name = "scheduler_onecycle"
    fabric = True

    def model(self, resumed: bool) -> ZooModel:
        return _Scheduled(
            lambda o: [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=40)], interval="step"
        )


@register
class Chained(Setup):
    """``ChainedScheduler`` (``ConstantLR`` + ``ExponentialLR``) per epoch."""

    name = "scheduler_chained"

    def model(self, resumed: bool) -> ZooModel:
        return _Scheduled(
            lambda o: [
                torch.optim.lr_scheduler.ChainedScheduler(
                    [
                        torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
                        torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
                    ]
                )
            ]
        )


@register
class Sequential(Setup):
    """``SequentialLR`` (``LinearLR`` warm-up, then ``CosineAnnealingWarmRestarts``) per step."""

    name = "scheduler_sequential"

    def model(self, resumed: bool) -> ZooModel:
        return _Scheduled(
            lambda o: [
                torch.optim.lr_scheduler.SequentialLR(
                    o,
                    [
                        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5),
                        torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=4),
                    ],
                    milestones=[5],
                )
            ],
            interval="step",
        )


class _Decay:
    """A picklable learning-rate lambda (``LambdaLR`` saves the state of callable objects)."""

    def __init__(self) -> None:
        self.rate = 0.95

    def __call__(self, epoch: int) -> float:
        return self.rate**epoch


@register
class CyclicAndLambda(Setup):
    """``CyclicLR`` (cycling momentum) and a ``LambdaLR`` of a callable object, both per step; ``PolynomialLR``."""

    name = "schedulers_cyclic_lambda"

    def model(self, resumed: bool) -> ZooModel:
        return _Scheduled(
            lambda o: [
                torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3),
                torch.optim.lr_scheduler.LambdaLR(o, _Decay()),
                torch.optim.lr_scheduler.PolynomialLR(o, total_iters=30, power=2.0),
            ],
            interval="step",
        )


@register
class ManualSchedulers(Setup):
    """Manual optimization with two optimizers and a ``MultiStepLR`` and ``CosineAnnealingLR`` stepped by hand."""

    name = "manual_schedulers"

    def model(self, resumed: bool) -> ZooModel:
        return _Manual(
            (
                lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                lambda p: torch.optim.Adam(p, lr=0.01),
                lambda p: torch.optim.AdamW(p, lr=0.01),
                lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, dampening=0.1),
            ),
            schedulers=(
                (0, lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[3, 9], gamma=0.5)),
                (1, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)),
            ),
        )


class _GAN(ZooModel):
    """Two optimizers stepped alternately (a GAN's pattern), with ``toggle_optimizer``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, second = self.optimizers()
        for optimizer in (first, second) if batch_idx % 2 == 0 else (second,):
            self.toggle_optimizer(optimizer)
            optimizer.zero_grad()
            self.manual_backward(self.loss(batch))
            optimizer.step()
            self.untoggle_optimizer(optimizer)

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.body.parameters(), lr=0.01), torch.optim.Adam(self.head.parameters(), lr=0.02)]


@register
class ManualAlternating(Setup):
    """Manual optimization, two optimizers stepped alternately with ``toggle_optimizer``."""

    name = "manual_alternating"
    find_unused = True

    def model(self, resumed: bool) -> ZooModel:
        return _GAN()


# ----------------------------------------------------------------------------------------- module structures
class _Tied(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.tied = nn.Linear(16, 16)
        self.tied.weight = self.body[2].weight  # one parameter under two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tied(self.body(x))))


@register
class TiedWeights(Setup):
    """A weight shared by two layers (one parameter, two names)."""

    name = "tied_weights"
    fabric = True  # not under FSDP2: fully_shard does not take a parameter shared by two sharded modules

    def model(self, resumed: bool) -> ZooModel:
        return _Tied()


class _Parametrized(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        torch.nn.utils.parametrizations.weight_norm(self.body[0])
        torch.nn.utils.parametrizations.orthogonal(self.body[2])


@register
class Parametrizations(Setup):
    """``weight_norm`` and ``orthogonal`` parametrizations (``parametrizations.weight.original*`` FQNs)."""

    name = "parametrizations"

    def model(self, resumed: bool) -> ZooModel:
        return _Parametrized()


class _Containers(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.scales = nn.ParameterList([nn.Parameter(torch.ones(16)), nn.Parameter(torch.zeros(16))])
        self.gates = nn.ParameterDict({"in": nn.Parameter(torch.ones(8)), "out": nn.Parameter(torch.ones(2))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x * self.gates["in"]) * self.scales[0] + self.scales[1]
        return self.head(hidden) * self.gates["out"]


@register
class ParameterContainers(Setup):
    """``nn.ParameterList`` and ``nn.ParameterDict``."""

    name = "parameter_list_dict"
    fabric = True  # not under FSDP2: its parameters are used outside the containers' forward (never unsharded)

    def model(self, resumed: bool) -> ZooModel:
        return _Containers()


class _Buffers(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))
        self.register_buffer("small", torch.zeros(3, dtype=torch.int32))
        self.register_buffer("flags", torch.zeros(4, dtype=torch.bool))
        self.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
        self.register_buffer("brain", torch.zeros(5, dtype=torch.bfloat16))
        self.register_buffer("fp16", torch.zeros(5, dtype=torch.float16))
        self.register_buffer("wide", torch.zeros(2, dtype=torch.float64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.update(x.detach().mean())
        return super().forward(x)

    @torch.no_grad()
    def update(self, value: torch.Tensor) -> None:
        self.count += 1
        self.small[self.count % 3] += 2
        self.flags[self.count % 4] = ~self.flags[self.count % 4]
        self.phase += torch.complex(value, -value).to(torch.complex64)
        self.brain += value.to(torch.bfloat16)
        self.fp16 += value.to(torch.float16)
        self.wide += value.double()
        self.scratch += value


@register
class Buffers(Setup):
    """Buffers of every dtype (int64, int32, bool, complex64, bfloat16, float16, float64) and a non-persistent one."""

    name = "buffers_all_dtypes"
    fabric = True
    fsdp2 = True

    def model(self, resumed: bool) -> ZooModel:
        return _Buffers()


class _Dropout(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh())


@register
class Dropout(Setup):
    """Dropout: the resumed run goes on exactly only with the RNG states restored (compared with the uninterrupted
    run; stock's resume restores none)."""

    name = "dropout"

    def model(self, resumed: bool) -> ZooModel:
        return _Dropout()


class _Compiled(ZooModel):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(self.body, backend="eager")  # an OptimizedModule: ``body._orig_mod.*`` names


@register
class CompiledSubmodule(Setup):
    """A ``torch.compile``d submodule (state-dict keys ``body._orig_mod.*``; DCP's FQNs drop ``_orig_mod``)."""

    name = "compiled_submodule"

    def model(self, resumed: bool) -> ZooModel:
        return _Compiled()


# ------------------------------------------------------------------------------------- training loop variants
class _SaveMidAccumulation(Callback):
    """Saves ``mid.ckpt`` after the 5th batch of epoch 1: two batches into an accumulation of three."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 1 and batch_idx == 4:
            trainer.save_checkpoint(f"{trainer.checkpoint_callback.dirpath}/mid.ckpt")


@register
class AccumulationMidSave(Setup):
    """Gradient accumulation (3 batches) with a save in the middle of an accumulation, resumed from there."""

    name = "accumulation_mid_save"
    ranks = (1,)
    continues = False  # a mid-epoch resume (stock re-iterates the epoch's loader)
    resume_from = "mid.ckpt"

    def callbacks(self, resumed: bool) -> list[Any]:
        return [] if resumed else [_SaveMidAccumulation()]

    def trainer_args(self) -> dict[str, Any]:
        return {"accumulate_grad_batches": 3}


class _Counter(Callback):
    """A callback with state (batches seen), saved under its ``state_key``."""

    def __init__(self) -> None:
        self.batches = 0

    @property
    def state_key(self) -> str:
        return "counter[zoo]"

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


@register
class CallbacksWithState(Setup):
    """Callbacks with state: a counter of its own, ``EarlyStopping``, ``GradientAccumulationScheduler``."""

    name = "callbacks_with_state"

    def callbacks(self, resumed: bool) -> list[Any]:
        from lightning.pytorch.callbacks import EarlyStopping, GradientAccumulationScheduler

        return [_Counter(), EarlyStopping(monitor="val_loss", patience=5), GradientAccumulationScheduler({1: 2})]


class _Hparams(ZooModel):
    def __init__(self, width: int = 16, rates: tuple = (0.1, 0.2), names: list | None = None, extra=None) -> None:
        super().__init__(hidden=width)
        self.save_hyperparameters()
        self.seen = torch.zeros(2)
        self.notes: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen += 1
        return super().training_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["zoo_tensor"] = self.seen.clone()
        checkpoint["zoo_notes"] = {"epoch": self.current_epoch, "words": ["a", "b"]}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen = checkpoint["zoo_tensor"]
        self.notes = checkpoint["zoo_notes"]


@register
class HparamsAndExtraState(Setup):
    """``save_hyperparameters`` and entries of the model's own in the checkpoint (``on_save/load_checkpoint``)."""

    name = "hparams_and_extra"

    def model(self, resumed: bool) -> ZooModel:
        return _Hparams(width=16, rates=(0.1, 0.3), names=["x", "y"], extra={"k": 1, "v": None})

    def extra(self, model: Any) -> Any:
        return {"seen": model.seen, "hparams": dict(model.hparams)}  # the notes: in the loaded dict's comparison


@register
class EMACallback(Setup):
    """Lightning's ``EMAWeightAveraging`` callback (an averaged copy of the model in the callback)."""

    name = "ema_weight_averaging"

    def callbacks(self, resumed: bool) -> list[Any]:
        from lightning.pytorch.callbacks import EMAWeightAveraging

        return [EMAWeightAveraging(decay=0.9)]


@register
class BF16Mixed(Setup):
    """``precision="bf16-mixed"`` (autocast on CPU)."""

    name = "bf16_mixed"

    def trainer_args(self) -> dict[str, Any]:
        return {"precision": "bf16-mixed"}


@register
class ClippingNoValidation(Setup):
    """Gradient clipping, no validation loop (``ModelCheckpoint`` saves at the training epoch's end)."""

    name = "clipping_no_validation"

    def trainer_args(self) -> dict[str, Any]:
        return {"gradient_clip_val": 0.05, "limit_val_batches": 0}
