"""A DDP resume without DDP's broadcast of weights that the checkpoint is about to overwrite.

``DistributedDataParallel`` broadcasts every parameter and buffer from rank 0 when it wraps the model
(``init_sync=True``), so that all ranks start alike. A sharded resume of ``dcp_ddp`` restores the checkpoint right
after the wrapping (at the end of the strategy's ``setup``), every rank reading the same bytes: with strict loading
(Lightning's ``LightningModule.strict_loading``, the default) every entry of the module's ``state_dict`` is then
overwritten alike on every rank, and the broadcast was spent on weights about to be replaced (0.45 s of a 1.3 GB
BERT-shaped resume on 2 CPU ranks). :class:`SyncAfterRestore` wraps without it and, once the restore is done,
broadcasts what the checkpoint did not write: non-persistent buffers, and everything when nothing was restored
(``fit(ckpt_path="last")`` with nothing committed yet), after the same shape check DDP makes.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_dcp._compat.lightning_run import trainer_run_arguments
from lightning_dcp._compat.torch_dcp import sync_module_states

__all__ = ["SyncAfterRestore"]


class SyncAfterRestore:
    """Mixin for a ``DDPStrategy`` whose sharded restore runs at the end of ``setup``: DDP's init sync after it.

    Only when fitting from a ``ckpt_path`` with strict loading and the user set no ``init_sync`` of their own;
    anything else wraps as Lightning does. The strategy records the names its restore wrote in
    ``_dcp_restored_names`` (``load_model_state_dict``).
    """

    _dcp_restored_names: frozenset[str] = frozenset()
    _dcp_sync_after_restore: bool = False

    def _resume_writes_every_weight(self, trainer: Any) -> bool:
        arguments = trainer_run_arguments(trainer) if self._dcp_sharded else None  # type: ignore[attr-defined]
        return bool(
            arguments
            and arguments[0]
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.lightning_module.strict_loading
            and "init_sync" not in self._ddp_kwargs  # type: ignore[attr-defined]
        )

    @override
    def setup(self, trainer: Any) -> None:
        """Set up (wrap, restore) as the parent does; when resuming, broadcast afterwards only what was not restored.

        Collective: call on all ranks.
        """
        self._dcp_restored_names = frozenset()
        self._dcp_sync_after_restore = self._resume_writes_every_weight(trainer)
        try:
            super().setup(trainer)  # type: ignore[misc]
        finally:
            deferred, self._dcp_sync_after_restore = self._dcp_sync_after_restore, False
        if deferred:
            ddp = self.model  # type: ignore[attr-defined]
            sync_module_states(
                ddp.module,
                process_group=ddp.process_group,
                skip=self._dcp_restored_names | frozenset(ddp.parameters_to_ignore),
            )

    @override
    def configure_ddp(self) -> None:
        """Wrap as Lightning does, with ``init_sync=False`` while a resume will write every weight afterwards."""
        if not self._dcp_sync_after_restore:
            return super().configure_ddp()  # type: ignore[misc]
        self._ddp_kwargs["init_sync"] = False  # type: ignore[attr-defined]
        try:
            super().configure_ddp()  # type: ignore[misc]
        finally:
            del self._ddp_kwargs["init_sync"]  # type: ignore[attr-defined]
