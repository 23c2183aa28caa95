"""Lightning Fabric strategies whose ``fabric.save`` / ``fabric.load`` go through lightning_dcp's engine.

``DCPStrategyMixin`` replaces a Fabric strategy's checkpoint methods: every rank writes its part of the state
(replicated DDP tensors once, with the bytes spread over ranks; DTensor shards by their owners), the save is
committed only once every rank finished (optionally in the background), every record is checksummed, any fsspec
storage works, and loads reshard to the current world size and across these strategies. Importing ``lightning_dcp``
registers ``"dcp_single_device"``, ``"dcp_ddp"``, ``"dcp_fsdp"`` and ``"dcp_model_parallel"`` in Fabric's strategy
registry, so ``Fabric(strategy="dcp_ddp")`` works. ``memory=MemoryTier(...)`` turns the memory tier on: every
``fabric.save`` goes to host shared memory (replicated to peer nodes, every Mth persisted), and ``fabric.load`` of
``last`` in the saves' directory takes the newest committed checkpoint across memory, replicas and the durable tiers.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.strategies import (
    STRATEGY_REGISTRY,
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dcp._compat.lightning_run import DeviceFromConnector
from lightning_dcp.engine import Checkpointer, CheckpointerConfig, init_strategy_attempt_group
from lightning_dcp.engine.tiers.memory import MemoryTier
from lightning_dcp.fabric.checkpoint import load_state, save_state
from lightning_dcp.fabric.preemption import Preemption

__all__ = [
    "DCPDDPStrategy",
    "DCPFSDPStrategy",
    "DCPModelParallelStrategy",
    "DCPSingleDeviceStrategy",
    "DCPStrategyMixin",
    "fully_shard_layers",
    "register_strategies",
]


class DCPStrategyMixin:
    """Make a Fabric strategy save and load sharded DCP checkpoints through lightning_dcp's engine.

    Put it first in the bases: ``class MyStrategy(DCPStrategyMixin, DDPStrategy)``. It consumes the keyword
    arguments below and passes every other argument to the strategy.

    Each option but ``memory`` is described once, in [`CheckpointerConfig`][lightning_dcp.engine.CheckpointerConfig]
    (the engine's options, which the strategy builds from these keywords); below, what each is for with Fabric.

    Args:
        storage_options: fsspec options (credentials, endpoint, region) of every read, write, list and delete.
        thread_count: Writer threads per rank.
        sync_files: ``fsync`` each local data file before the commit.
        async_save: ``fabric.save`` returns once the state is staged, and the write goes on in the background; the
            next save, a load and [`wait_for_save`][lightning_dcp.fabric.DCPStrategyMixin.wait_for_save] wait for it
            and raise its error. A script that ends with a save in flight (Fabric never tears its strategy down) gets
            it finished and committed at the interpreter's exit, with a log line saying how long the exit waited.
        defer_staging: With ``async_save``: what only optimizer steps change is copied after ``fabric.save``
            returned, and the next optimizer step waits for the copies.
        when_busy: With ``async_save``: ``"wait"`` or ``"skip"`` a ``fabric.save`` called while the previous save is
            still written.
        memory: A memory tier ([`MemoryTier`][lightning_dcp.MemoryTier]): every ``fabric.save(path, state)`` then saves
            into host shared memory (the node's area, replicated to ``replicas`` peer nodes; in the background; with the
            tier's ``async_save=False`` the call makes the copies first), and every ``persist_every``-th into ``path``
            itself. ``fabric.load(dir + "/last", state)`` (``dir`` the directory of the saves), or of the tier's
            ``memory_dir + "/last"``, loads the newest committed checkpoint across memory, peers' replicas and ``dir``.
            The tier leaves its process group at interpreter exit (or
            [`teardown`][lightning_dcp.fabric.DCPStrategyMixin.teardown]). From the first save on, SIGTERM is recorded
            instead of ending the process: the next ``fabric.save`` (on every rank) saves, persists the newest memory
            checkpoint to its directory, then raises SIGTERM again under the handler that was there before
            (``lightning_dcp.fabric.preemption``; a second SIGTERM, or
            [`teardown`][lightning_dcp.fabric.DCPStrategyMixin.teardown], gives SIGTERM back to that handler at once).

    Raises:
        ValueError: ``thread_count`` is not a positive integer, or ``when_busy`` is neither ``"wait"`` nor
            ``"skip"``.
        TypeError: A ``CheckpointIO`` plugin is given: these strategies write through the engine, not a plugin.
    """

    def __init__(
        self,
        *args: Any,
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 1,
        sync_files: bool = True,
        async_save: bool = False,
        defer_staging: bool = True,
        when_busy: str = "wait",
        memory: MemoryTier | None = None,
        **kwargs: Any,
    ) -> None:
        self._refuse_plugin(kwargs.pop("checkpoint_io", None))
        self.checkpointer = Checkpointer(CheckpointerConfig.of(locals()))  # every option of this signature, by name
        """The engine that does the work (``lightning_dcp.engine.checkpointer.Checkpointer``)."""
        self._preemption = Preemption()
        super().__init__(*args, **kwargs)

    def _refuse_plugin(self, io: CheckpointIO | None) -> None:
        if io is not None:
            raise TypeError(
                f"`{type(self).__name__}` writes DCP checkpoints through lightning_dcp's engine and takes no"
                f" CheckpointIO plugin (got `{type(io).__name__}`): remove it, and pass storage options to the"
                f" strategy, e.g. `{type(self).__name__}(storage_options={{...}})`."
            )

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Fabric's default plugin, unused: checkpoints go through ``checkpointer``."""
        return TorchCheckpointIO()

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._refuse_plugin(io)

    # ----------------------------------------------------------------------------------------------- save
    def save_checkpoint(
        self,
        path: str | os.PathLike,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        """Write ``state`` as a DCP checkpoint directory at ``path`` (``fabric.save`` calls this).

        Modules and optimizers become FQN-keyed state dicts (``get_model_state_dict`` /
        ``get_optimizer_state_dict``), tensors become DCP entries written by every rank, the other values go into
        one blob written by rank 0, and each rank adds its RNG states. The directory is committed once every rank
        finished; an existing checkpoint at ``path`` is replaced only then. With a memory tier (``memory=``) the
        checkpoint goes to host shared memory under ``path``'s name, and to ``path`` when it is persisted.

        Args:
            path: Target directory, a local path or fsspec URL; rank 0's value is used on every rank.
            state: ``{key: module | optimizer | object with state_dict() | tensor | value}``.
            storage_options: fsspec options for this call, merged over the strategy's.
            filter: ``{key: fn(name, value) -> bool}``: keep only these items of that key's state dict.

        Collective: call on all ranks.

        Raises:
            CheckpointError: Writing failed on some rank (nothing was committed). With a memory tier, a save's failure
                after its planning is raised by the next save (or
                [`wait_for_save`][lightning_dcp.fabric.DCPStrategyMixin.wait_for_save]).
        """
        memory = self.checkpointer.memory
        if memory is not None:
            self._preemption.install()
        with self.checkpointer.into_memory():  # a no-op without a memory tier
            save_state(
                self.checkpointer,
                self.broadcast(os.fspath(path)),
                state,
                filters=filter,
                info={"strategy": type(self).__name__},
                storage_options=storage_options,
                synced=getattr(self, "_dcp_synced", None),
            )
        if memory is not None:
            self._preemption.after_save(memory, anywhere=lambda flag: self.reduce_boolean_decision(flag, all=False))

    # ----------------------------------------------------------------------------------------------- load
    def load_checkpoint(
        self,
        path: str | os.PathLike,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` from the checkpoint at ``path`` (``fabric.load`` and ``fabric.load_raw`` call this).

        Reads lightning_dcp checkpoints (from Fabric or the Trainer, any world size and any of these strategies)
        and single ``torch.save`` files; see ``lightning_dcp.fabric.checkpoint`` for what each kind of ``state``
        receives. RNG states are restored exactly at the world size of the save, re-derived (with a warning) at
        another.

        Returns:
            The saved entries not restored into ``state``; the whole checkpoint when ``state`` is empty.

        Collective: call on all ranks.

        Raises:
            CheckpointNotFoundError: Nothing exists at ``path``.
            NotACheckpointError: Not a readable checkpoint (or an incomplete save).
            StateDictMismatchError: Keys (``strict``), shapes or dtypes differ; nothing was loaded.
            CheckpointError: Non-tensor state that ``weights_only`` (default True) refuses.
        """
        torch.cuda.empty_cache()
        path = self.broadcast(os.fspath(path))
        resume = isinstance(state, dict) and any(isinstance(value, Optimizer) for value in state.values())
        if resume and isinstance(self, (DDPStrategy, SingleDeviceStrategy)):  # every rank reads every file
            self.checkpointer.prefetch(path)
        return load_state(self.checkpointer, path, state, strict=strict, weights_only=weights_only)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path`` once (rank 0), after the background save it depends on commits.

        Collective: call on all ranks.
        """
        self.checkpointer.remove(self.broadcast(os.fspath(path)), collective=True)

    def wait_for_save(self) -> None:
        """Block until the background save in flight (if any) is committed.

        Collective: call on all ranks; every rank raises if any rank's part failed.

        Raises:
            CheckpointError: The background save failed; it was not committed (earlier checkpoints are intact).
        """
        self.checkpointer.wait(collective=True)

    @override
    def teardown(self) -> None:
        """Finish the background save in flight (if any) and release its buffers, then tear the strategy down.

        Raises:
            CheckpointError: The background save failed; it was not committed.
        """
        try:
            self._preemption.uninstall()
            self.checkpointer.close()
        finally:
            super().teardown()


class DCPSingleDeviceStrategy(DeviceFromConnector, DCPStrategyMixin, SingleDeviceStrategy):
    """``SingleDeviceStrategy`` writing DCP checkpoints.

    See [`DCPStrategyMixin`][lightning_dcp.fabric.DCPStrategyMixin]. ``device=None`` (the default) takes the device
    Fabric picks for its ``accelerator``.
    """

    strategy_name = "dcp_single_device"


class _ElasticAttempt:
    """Under torchrun's elastic agent, set up the process group in a store of this attempt; elsewhere nothing changes.

    Fabric's multi-process strategies; :mod:`lightning_dcp.engine.elastic` says why. Collective.
    """

    def _setup_distributed(self) -> None:
        strategy: Any = self
        if strategy.cluster_environment is not None:
            strategy._set_world_ranks()
        init_strategy_attempt_group(strategy)
        super()._setup_distributed()  # type: ignore[misc]


class DCPDDPStrategy(DCPStrategyMixin, _ElasticAttempt, DDPStrategy):
    """``DDPStrategy`` whose ranks each write a part of the replicated state.

    See [`DCPStrategyMixin`][lightning_dcp.fabric.DCPStrategyMixin]. Replicated values that may differ between ranks
    are written from rank 0, as stock Fabric's save writes rank 0's: buffers, tensors outside modules and optimizers,
    and parameters DDP does not all-reduce (frozen when ``setup_module`` wrapped the module) with their optimizer
    state.
    """

    strategy_name = "dcp_ddp"

    @override
    def setup_module(self, module: Module) -> Any:
        """Wrap as DDP does, noting the parameters it all-reduces (those requiring grad now)."""
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        alive = {k: r for k, r in getattr(self, "_dcp_synced_refs", {}).items() if r() is not None}
        for name, param in module.named_parameters():
            if param.requires_grad and name not in ignored:
                alive[id(param)] = weakref.ref(param)
        self._dcp_synced_refs = alive
        return super().setup_module(module)

    @property
    def _dcp_synced(self) -> set[int] | None:
        """The ids of the live parameters DDP all-reduces (of every module ``setup_module`` wrapped)."""
        refs = getattr(self, "_dcp_synced_refs", None)
        return None if refs is None else {k for k, r in refs.items() if r() is not None}


class DCPFSDPStrategy(DCPStrategyMixin, _ElasticAttempt, FSDPStrategy):
    """``FSDPStrategy`` (FSDP1, needs a GPU) writing sharded DCP checkpoints.

    See [`DCPStrategyMixin`][lightning_dcp.fabric.DCPStrategyMixin]. Fabric's own ``state_dict_type`` has no effect:
    checkpoints are always this strategy's sharded DCP directories.
    """

    strategy_name = "dcp_fsdp"


def fully_shard_layers(module: Module, device_mesh: Any) -> Module:
    """FSDP2: ``fully_shard`` every submodule that holds parameters itself, then the root, over data parallel.

    The default ``parallelize_fn`` of [`DCPModelParallelStrategy`][lightning_dcp.fabric.DCPModelParallelStrategy]. FQNs
    are unchanged, so checkpoints of the module load into the unsharded module and back.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    for submodule in module.modules():
        if submodule is not module and any(True for _ in submodule.parameters(recurse=False)):
            fully_shard(submodule, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


class DCPModelParallelStrategy(DCPStrategyMixin, _ElasticAttempt, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel, DTensor) with resharding DCP checkpoints.

    See [`DCPStrategyMixin`][lightning_dcp.fabric.DCPStrategyMixin]. Without a ``parallelize_fn`` (e.g.
    ``Fabric(strategy="dcp_model_parallel")``) the model is sharded with FSDP2 over every process
    ([`fully_shard_layers`][lightning_dcp.fabric.fully_shard_layers]; data parallel size = world size, tensor parallel
    size 1).
    """

    strategy_name = "dcp_model_parallel"

    def __init__(self, parallelize_fn: Any = None, **kwargs: Any) -> None:
        self._fsdp_everywhere = parallelize_fn is None
        if self._fsdp_everywhere:
            kwargs.setdefault("tensor_parallel_size", 1)
        super().__init__(parallelize_fn=parallelize_fn or fully_shard_layers, **kwargs)

    @override
    def setup_environment(self) -> None:
        """Without a ``parallelize_fn`` the data parallel dimension spans every process."""
        if self._fsdp_everywhere and self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def register_strategies(registry: Any = STRATEGY_REGISTRY) -> None:
    """Register the ``dcp_*`` names in Fabric's strategy registry (idempotent; runs on ``import lightning_dcp``)."""
    for cls, description in (
        (DCPSingleDeviceStrategy, "Single device, DCP checkpoints (lightning_dcp)"),
        (DCPDDPStrategy, "DDP, sharded DCP checkpoints (lightning_dcp)"),
        (DCPFSDPStrategy, "FSDP, sharded DCP checkpoints (lightning_dcp)"),
        (DCPModelParallelStrategy, "ModelParallel (FSDP2/TP), sharded DCP checkpoints (lightning_dcp)"),
    ):
        if cls.strategy_name not in registry:
            registry.register(cls.strategy_name, cls, description=description)
