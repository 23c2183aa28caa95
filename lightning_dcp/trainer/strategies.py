"""Strategies whose every rank writes its own shard: ``DCPStrategyMixin`` and four ready-made strategies.

``state_dict_type="sharded"`` (the default) routes every checkpoint through :class:`DCPCheckpointIO` with all ranks
taking part: the model state is ``get_model_state_dict``'s (FQN keys) and each optimizer's is its
``optimizer.state_dict()`` keyed by FQN (restored with its own ``load_state_dict``: torch.optim's semantics),
replicated tensors (DDP) are written once with the bytes spread over ranks (rank 0's copy of those that may differ
between ranks), sharded tensors (DTensor) by their owners, and loading reshards to the current world size. ``"full"``
keeps Lightning's own behaviour of the parent strategy (one consolidated file written by rank 0).

Importing ``lightning_dcp`` registers ``"dcp_single_device"``, ``"dcp_ddp"``, ``"dcp_fsdp"`` and
``"dcp_model_parallel"`` in Lightning's strategy registry, so ``Trainer(strategy="dcp_ddp")`` works.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.io.torch_plugin import TorchCheckpointIO
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    StrategyRegistry,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from typing_extensions import override

from lightning_dcp._compat import lightning_hooks
from lightning_dcp._compat.lightning_run import (
    DeviceFromConnector,
    restore_modules_and_callbacks,
    trainer_run_arguments,
    unwrap_checkpoint_io,
)
from lightning_dcp.engine import STEP_GATE, layout
from lightning_dcp.engine.state.module_state import (
    load_model_state_dict,
    model_state_dict,
    optimizer_state_dict,
    optimizer_target,
    parameters_by_fqn,
)
from lightning_dcp.engine.state.optimizer_restore import load_optimizer_state_dict, optimizer_kind
from lightning_dcp.errors import CheckpointError
from lightning_dcp.trainer.checkpoint_io import DCPCheckpointIO
from lightning_dcp.trainer.ddp_resume import SyncAfterRestore
from lightning_dcp.trainer.elastic import ElasticAttempt
from lightning_dcp.trainer.memory import is_memory_sentinel
from lightning_dcp.trainer.preemption import install_preemption
from lightning_dcp.trainer.rank_state import RankResume, collect_rank_state

__all__ = [
    "DCPDDPStrategy",
    "DCPFSDPStrategy",
    "DCPModelParallelStrategy",
    "DCPSingleDeviceStrategy",
    "DCPStrategyMixin",
]

StateDictType = Literal["sharded", "full"]


lightning_hooks.install_run_hook()  # the strategies restore in their setup, with the ckpt_path fit resolved


class DCPStrategyMixin:
    """Make a Lightning strategy save, load and remove sharded DCP checkpoints on every rank.

    Put it first in the bases: ``class MyStrategy(DCPStrategyMixin, DDPStrategy)``. The mixin consumes the
    keyword ``state_dict_type`` and passes every other argument to the strategy.

    Args:
        state_dict_type: ``"sharded"``: every rank writes its own shard through ``DCPCheckpointIO`` (the default
            plugin). ``"full"``: the parent strategy's own behaviour, one file written by rank 0.

    Raises:
        ValueError: ``state_dict_type`` is not ``"sharded"`` or ``"full"``.
        TypeError: ``"sharded"`` with a CheckpointIO other than ``DCPCheckpointIO`` (raised when the Trainer is
            created, naming the fix).
    """

    def __init__(self, *args: Any, state_dict_type: StateDictType = "sharded", **kwargs: Any) -> None:
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(f"`state_dict_type` must be 'sharded' or 'full', got {state_dict_type!r}.")
        self._dcp_sharded = state_dict_type == "sharded"
        super().__init__(*args, **kwargs)

    @property
    def state_dict_type(self) -> StateDictType:
        """``"sharded"`` or ``"full"``, as given at construction."""
        return "sharded" if self._dcp_sharded else "full"

    # --------------------------------------------------------------------------------------------- plugin
    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The CheckpointIO: ``DCPCheckpointIO()`` by default when sharded, Lightning's default when full."""
        if self._checkpoint_io is None:
            self._checkpoint_io = DCPCheckpointIO() if self._dcp_sharded else TorchCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if self._dcp_sharded and io is not None and not isinstance(unwrap_checkpoint_io(io), DCPCheckpointIO):
            raise TypeError(
                f"`{type(self).__name__}(state_dict_type='sharded')` writes through `lightning_dcp.DCPCheckpointIO`,"
                f" but got `{type(io).__name__}`. Remove that plugin (DCPCheckpointIO is the default), pass"
                f" `DCPCheckpointIO(...)`, or use `state_dict_type='full'` for a single-file checkpoint."
            )
        self._checkpoint_io = io

    @property
    def _dcp_io(self) -> DCPCheckpointIO:
        return unwrap_checkpoint_io(self.checkpoint_io)  # type: ignore[return-value]

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded loads fill the optimizers in place, so they must exist: restore after ``setup``.

        The restore then runs at the end of [`setup`][lightning_dcp.DCPStrategyMixin.setup] (before ``on_fit_start``);
        once done, this answers ``False`` so that Lightning does not restore a second time after ``on_fit_start``.
        """
        if not self._dcp_sharded:
            return super().restore_checkpoint_after_setup
        return not getattr(self, "_dcp_restored_at_setup", False)

    @override
    def setup(self, trainer: Any) -> None:
        """Set up as the parent strategy does; sharded, then restore the checkpoint given to ``fit``/``validate``/...

        Lightning restores model, datamodule and callback state before ``setup`` for strategies that load before
        their optimizers exist, and after ``on_fit_start`` for the others. Restoring here, with the optimizers and
        the sharded model in place (loads reshard as usual), keeps Lightning's stock order for hooks:
        ``on_fit_start`` sees the restored callback and model state, as under ``strategy="ddp"``. The user's
        ``weights_only`` reaches the loader (Lightning's late restore drops it). Without a checkpoint, or when the
        running ``Trainer._run`` cannot be found, Lightning's late restore applies unchanged.
        """
        self._dcp_restored_at_setup = False
        arguments = trainer_run_arguments(trainer) if self._dcp_sharded else None
        if arguments and arguments[0] and isinstance(self, (DDPStrategy, SingleDeviceStrategy)):
            self._dcp_io.checkpointer.prefetch(arguments[0])  # every rank reads all: while the strategy sets up
        super().setup(trainer)
        if not self._dcp_sharded:
            return
        if not any(isinstance(c, _WaitForStagingAtTrainEnd) for c in trainer.callbacks):
            trainer.callbacks.insert(0, _WaitForStagingAtTrainEnd(self))  # before every other callback's hook
        if arguments is not None and arguments[0]:
            if is_memory_sentinel(arguments[0]) and not self._dcp_io.checkpointer.resumable(collective=True):
                rank_zero_warn(  # what Lightning says when "last" finds nothing: a first run starts fresh
                    '`.fit(ckpt_path="last")`: nothing is committed in the memory tier or its directory yet;'
                    " starting from scratch."
                )
            else:
                restore_modules_and_callbacks(trainer, *arguments)
            self._dcp_restored_at_setup = True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """Lightning calls ``load_optimizer_state_dict`` for sharded loads."""
        return True if self._dcp_sharded else super().lightning_restore_optimizer

    @override
    def on_train_start(self) -> None:
        """Preemption: SIGTERM/SIGUSR1 only set a flag; at the next step's end every rank saves, then all stop.

        Lightning's own handlers run collectives inside the signal handler, which deadlock against a checkpoint's
        collectives (or any other); see ``lightning_dcp.trainer.preemption``. ``teardown`` finishes the save.
        """
        super().on_train_start()
        if self._dcp_sharded and self.lightning_module is not None:
            self._dcp_preemption = install_preemption(self.lightning_module.trainer)
        self._dcp_rank_resume.on_train_start()  # mid-epoch RNG states: after the epoch's iterator drew its seed

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Step as the parent strategy does, with an async save's staging wait after the closure, not before it.

        Lightning runs the forward and backward passes inside ``optimizer.step(closure)``, after the optimizer's
        pre-step hooks, where the deferred staging copies of an async save in flight are waited for; here the wait
        comes once the closure has run, so those copies overlap the forward and backward passes
        (``after_closure``).
        """
        with STEP_GATE.after_closure(optimizer, closure) as closure_then_wait:
            return super().optimizer_step(optimizer, closure_then_wait, model, **kwargs)

    @override
    def on_validation_start(self) -> None:
        """Wait for the staging copies of an async save in flight: validation may change weights in place.

        Weight-averaging callbacks (``EMAWeightAveraging``) swap the averaged weights in at the start of every
        validation epoch, outside any optimizer step.
        """
        super().on_validation_start()
        if self._dcp_sharded:
            self._dcp_io.checkpointer.wait_for_staging()

    @override
    def teardown(self) -> None:
        """Finish the background save in flight (if any) before the strategy lets the process group go.

        Not every Lightning strategy tears its CheckpointIO down (``ModelParallelStrategy`` does not); this one
        always does, first. The plugin's ``teardown`` is idempotent, so a second call from the parent is harmless.

        Raises:
            CheckpointError: The background save failed; it was not committed.
        """
        self._dcp_restored_at_setup = False
        try:
            if self._checkpoint_io is not None:
                self._checkpoint_io.teardown()
        finally:
            try:
                super().teardown()
            finally:
                preemption = getattr(self, "_dcp_preemption", None)
                if preemption is not None:  # its handlers and its stuck-rank watch end with the run
                    self._dcp_preemption = None
                    preemption.uninstall()

    def _dcp_module(self) -> torch.nn.Module:
        """The module whose FQNs name the checkpoint entries (the LightningModule; FSDP1 overrides)."""
        assert self.lightning_module is not None
        return self.lightning_module

    # ----------------------------------------------------------------------------------------------- save
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: ``get_model_state_dict`` (FQN keys; DTensor shards stay sharded, nothing is gathered)."""
        if not self._dcp_sharded:
            return super().lightning_module_state_dict()
        return model_state_dict(self._dcp_module())

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Sharded: ``optimizer.state_dict()`` keyed by parameter FQN (``get_optimizer_state_dict``'s layout).

        State only for the parameters that have it, every param group with all its options, in the optimizer's
        own layout: what stock Lightning saves, with names instead of ids so that a load can reshard it.
        """
        if not self._dcp_sharded:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return optimizer_state_dict(self._dcp_module(), optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str, storage_options: Any | None = None) -> None:
        """Sharded: every rank writes its shard; committed once all ranks finished.

        Replicated values that may differ between ranks are written from rank 0, as stock Lightning writes rank 0's
        checkpoint dict: the module's buffers (BatchNorm statistics differ between DDP's broadcasts at each forward),
        checkpoint entries other than the model's and the optimizers' (an EMA copy's state) and, under DDP, the
        parameters DDP does not synchronise (frozen when it wrapped the model and unfrozen since: progressive
        unfreezing, ``BackboneFinetuning``) with their optimizer state. Where the ranks' non-tensor values differ (a
        learning rate set from an unsynced metric), rank 0 writes everything
        (``Checkpointer.save``).

        Collective: call on all ranks (``Trainer.save_checkpoint`` does).
        """
        if not self._dcp_sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        module = self._dcp_module()
        self._dcp_io.save_checkpoint(
            checkpoint,
            filepath,
            storage_options=storage_options,
            collective=True,
            info={
                "strategy": type(self).__name__,
                "state_dict_type": "sharded",
                layout.OPTIMIZER_KINDS: {str(i): optimizer_kind(o) for i, o in enumerate(self.optimizers)},
            },
            rank_state=collect_rank_state(self.lightning_module.trainer, checkpoint),  # RNG, this rank's loaders
            volatile=list(module.buffers()),  # a forward pass changes buffers before the next step
            from_rank0=self._dcp_from_rank0(checkpoint),
        )

    def _dcp_from_rank0(self, checkpoint: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """The paths of ``checkpoint`` whose values rank 0 writes (see ``save_checkpoint``)."""
        module = self._dcp_module()
        model = checkpoint.get(layout.MODEL_KEY, {})
        params = parameters_by_fqn(module)
        paths: list[tuple[Any, ...]] = [(layout.MODEL_KEY, key) for key in model if key not in params]  # buffers
        paths += [(key,) for key in checkpoint if key not in (layout.MODEL_KEY, layout.OPTIMIZER_KEY)]
        synced = getattr(self, "_dcp_synced", None)
        if synced is None or all(id(p) in synced for p in params.values()):
            return paths
        unsynced = [fqn for fqn, p in params.items() if id(p) not in synced]
        paths += [(layout.MODEL_KEY, fqn) for fqn in unsynced if fqn in model]
        for i, state in enumerate(checkpoint.get(layout.OPTIMIZER_KEY, ())):
            held = state.get("state", {}) if isinstance(state, Mapping) else {}
            paths += [(layout.OPTIMIZER_KEY, i, "state", fqn) for fqn in unsynced if fqn in held]
        return paths

    @override
    def remove_checkpoint(self, filepath: str) -> None:
        """Sharded: removed once, by rank 0, on behalf of every rank. Collective: call on all ranks."""
        if not self._dcp_sharded:
            return super().remove_checkpoint(filepath)
        self._dcp_io.remove_checkpoint(filepath, collective=True)

    # ----------------------------------------------------------------------------------------------- load
    @override
    def load_checkpoint(self, checkpoint_path: str, weights_only: bool | None = None) -> dict[str, Any]:
        """Sharded: load into this rank's model and optimizer shards in place (resharding as needed).

        A single-file checkpoint (Lightning's ``.ckpt``, or the output of ``lightning_dcp.consolidate``) is read
        whole on every rank and distributed by ``load_model_state_dict`` / ``load_optimizer_state_dict``.

        Collective: call on all ranks.
        """
        if not self._dcp_sharded:
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if isinstance(self, (DDPStrategy, SingleDeviceStrategy)):  # every rank reads every file: from now on
            self._dcp_io.checkpointer.prefetch(checkpoint_path)
        module = self._dcp_module()
        target: dict[str, Any] = {layout.MODEL_KEY: model_state_dict(module)}
        trainer = self.lightning_module.trainer
        if self.optimizers and trainer.state.fn == TrainerFn.FITTING:  # made from what the checkpoint holds
            target[layout.OPTIMIZER_KEY] = [optimizer_target(module, optimizer) for optimizer in self.optimizers]
        self._dcp_loaded_from = str(checkpoint_path)
        checkpoint = self._dcp_io.load_checkpoint(
            checkpoint_path,
            weights_only=weights_only,
            state_dict=target,
            strict=self.lightning_module.strict_loading,
            collective=True,
        )
        self._dcp_rank_resume.restore(
            self.lightning_module.trainer,
            checkpoint,
            path=str(checkpoint_path),
            world_size=self.world_size,
            rank=self.global_rank,
        )
        return checkpoint

    @property
    def _dcp_rank_resume(self) -> RankResume:
        if getattr(self, "_dcp_rank_resume_state", None) is None:
            self._dcp_rank_resume_state = RankResume()
        return self._dcp_rank_resume_state

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Sharded, fitting: set the sampler's epoch before Lightning gives the loader its saved state.

        See ``RankResume``.
        """
        dataloader = super().process_dataloader(dataloader)
        if self._dcp_sharded and self.lightning_module is not None:
            self._dcp_rank_resume.process_dataloader(self.lightning_module.trainer, dataloader)
        return dataloader

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Sharded: apply the model state with ``set_model_state_dict`` (full state from a single file)."""
        if not self._dcp_sharded:
            return super().load_model_state_dict(checkpoint, strict=strict)
        # what this restore writes on every rank alike (strict: every entry of the module's state_dict, or it raised)
        self._dcp_restored_names = frozenset(checkpoint[layout.MODEL_KEY]) if strict else frozenset()
        if _is_single_file(checkpoint):
            options = StateDictOptions(full_state_dict=True, strict=strict)
            set_model_state_dict(self._dcp_module(), checkpoint[layout.MODEL_KEY], options=options)
        else:  # filled in place: DCP's set_model_state_dict unless it would only copy each tensor onto itself
            load_model_state_dict(self._dcp_module(), checkpoint[layout.MODEL_KEY], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Sharded: give each optimizer its saved state as stock Lightning does, with its own ``load_state_dict``.

        Lightning calls this after the callbacks' ``on_fit_start``, so param groups that a callback re-adds from
        its restored state (``BackboneFinetuning``) are there. The saved groups map onto the optimizer's by
        position; parameters without saved state stay without; state tensors are this rank's shards (read in
        place) or, from a single file, full tensors cut to them
        (``load_optimizer_state_dict`` of ``lightning_dcp.engine.state.optimizer_restore``).

        Raises:
            CheckpointError: The checkpoint holds another number of optimizers than ``configure_optimizers``
                returned.
            StateDictMismatchError: An optimizer's param groups differ in number or size from the saved ones, or it
                is another kind of optimizer than the saved one.
        """
        if not self._dcp_sharded:
            return super().load_optimizer_state_dict(checkpoint)
        module = self._dcp_module()
        states = checkpoint[layout.OPTIMIZER_KEY]
        if len(states) != len(self.optimizers):
            raise CheckpointError(
                f"The checkpoint holds the state of {len(states)} optimizer(s) but `configure_optimizers` returned"
                f" {len(self.optimizers)}. Resume with the same optimizers, or load weights only."
            )
        where = getattr(self, "_dcp_loaded_from", "the checkpoint")
        kinds = checkpoint.get(layout.INFO_KEY, {}).get(layout.OPTIMIZER_KINDS, {})
        for i, (optimizer, state) in enumerate(zip(self.optimizers, states, strict=True)):
            load_optimizer_state_dict(module, optimizer, state, where=where, kind=kinds.get(str(i)))


def _is_single_file(checkpoint: Mapping[str, Any]) -> bool:
    """Whether ``checkpoint`` holds full tensors (not this rank's shards filled in place by a sharded load)."""
    return not checkpoint.get(layout.INFO_KEY, {}).get("loaded_in_place", False)


class _WaitForStagingAtTrainEnd(Callback):
    """Wait for an async save's staging copies before any other callback's ``on_train_end``.

    No optimizer step follows the last save of a fit, and callbacks change weights in place at the end
    (``EMAWeightAveraging`` copies the averaged weights into the model through ``.data``, which no version counter
    sees): without this wait the last checkpoint could hold them.
    """

    def __init__(self, strategy: DCPStrategyMixin) -> None:
        self._strategy = strategy

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._strategy._dcp_io.checkpointer.wait_for_staging()


class DCPSingleDeviceStrategy(DeviceFromConnector, DCPStrategyMixin, SingleDeviceStrategy):
    """``SingleDeviceStrategy`` writing DCP checkpoints; see [`DCPStrategyMixin`][lightning_dcp.DCPStrategyMixin].

    ``device=None`` (the default, and ``"dcp_single_device"``) takes the first of the Trainer's ``devices`` as
    ``strategy="auto"`` does: ``cuda:k`` for ``accelerator="gpu", devices=[k]``, ``cpu`` on CPU.
    """

    strategy_name = "dcp_single_device"


class DCPDDPStrategy(SyncAfterRestore, DCPStrategyMixin, ElasticAttempt, DDPStrategy):
    """``DDPStrategy`` whose ranks each write a part of the replicated state.

    See [`DCPStrategyMixin`][lightning_dcp.DCPStrategyMixin]. A resume skips DDP's broadcast of the weights it restores
    (``SyncAfterRestore``).
    """

    strategy_name = "dcp_ddp"

    @override
    def _setup_model(self, model: torch.nn.Module) -> Any:
        """Wrap as DDP does, noting the parameters it synchronises (those requiring grad now, not ignored).

        A parameter frozen at this point and unfrozen later is never all-reduced: each rank trains its own copy, and
        a save writes rank 0's (``save_checkpoint``).
        """
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        self._dcp_synced = {id(p) for n, p in model.named_parameters() if p.requires_grad and n not in ignored}
        return super()._setup_model(model)


class DCPFSDPStrategy(DCPStrategyMixin, ElasticAttempt, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1, needs a GPU) writing sharded DCP checkpoints.

    See [`DCPStrategyMixin`][lightning_dcp.DCPStrategyMixin]. Lightning's own ``state_dict_type`` of ``FSDPStrategy`` is
    set to ``"full"`` underneath: with ``"sharded"`` this mixin handles checkpoints itself, and ``"full"`` gives
    Lightning's consolidated single file.
    """

    strategy_name = "dcp_fsdp"

    def __init__(self, *args: Any, state_dict_type: StateDictType = "sharded", **kwargs: Any) -> None:
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)
        self._state_dict_type = "full"

    @override
    def _dcp_module(self) -> torch.nn.Module:
        assert self.model is not None
        return self.model


class DCPModelParallelStrategy(DCPStrategyMixin, ElasticAttempt, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel, DTensor) with resharding DCP checkpoints.

    See [`DCPStrategyMixin`][lightning_dcp.DCPStrategyMixin]. ``state_dict_type="full"`` is Lightning's
    ``save_distributed_checkpoint=False``.
    """

    strategy_name = "dcp_model_parallel"

    def __init__(self, *args: Any, state_dict_type: StateDictType = "sharded", **kwargs: Any) -> None:
        kwargs.setdefault("save_distributed_checkpoint", state_dict_type == "sharded")
        super().__init__(*args, state_dict_type=state_dict_type, **kwargs)


def register_strategies(registry: Any = StrategyRegistry) -> None:
    """Register the ``dcp_*`` names in Lightning's strategy registry (idempotent; runs on import).

    Besides one name per strategy, ``"dcp_ddp_find_unused_parameters_false"`` / ``"_true"`` mirror Lightning's
    ``"ddp_find_unused_parameters_*"`` aliases.
    """
    for cls, description in (
        (DCPSingleDeviceStrategy, "Single device, DCP checkpoints"),
        (DCPDDPStrategy, "DDP, sharded DCP checkpoints"),
        (DCPFSDPStrategy, "FSDP, sharded DCP checkpoints"),
        (DCPModelParallelStrategy, "ModelParallel (FSDP2/TP), sharded DCP checkpoints"),
    ):
        if cls.strategy_name not in registry:
            registry.register(cls.strategy_name, cls, description=description)
    for find_unused in (False, True):  # Lightning's "ddp_find_unused_parameters_{false,true}" (a GAN needs true)
        name = f"{DCPDDPStrategy.strategy_name}_find_unused_parameters_{str(find_unused).lower()}"
        if name not in registry:
            description = f"DDP with `find_unused_parameters={find_unused}`, sharded DCP checkpoints"
            registry.register(name, DCPDDPStrategy, description=description, find_unused_parameters=find_unused)
