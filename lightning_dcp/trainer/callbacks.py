"""``ElasticResume``: resume on a different number of devices and keep what the run means.

Two things change when a run resumes at another data-parallel world size, and this callback puts both back:

- **The global batch size** (world size x per-device batch size x ``accumulate_grad_batches``): kept by setting
  ``trainer.accumulate_grad_batches`` (the attribute Lightning's own ``GradientAccumulationScheduler`` sets).
- **The position in the epoch**: Lightning restarts a plain ``DataLoader`` at the first batch of the epoch, so a
  mid-epoch resume sees the epoch's first samples again. The callback replaces the train sampler by one that draws
  the same world-size-independent order (what ``DistributedSampler`` draws: a permutation seeded with
  ``seed + epoch``, dealt to the ranks in turn) and skips exactly the samples already consumed, whatever world size
  consumed them.

See ``docs/resume.md`` ("Resuming at another world size") for what is and is not preserved.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler
from typing_extensions import override

from lightning_dcp._compat.lightning_run import restart_train_iterator, shift_epoch_batches
from lightning_dcp.engine import layout
from lightning_dcp.engine.state.loaders import refuse, reshards_itself
from lightning_dcp.errors import NotACheckpointError
from lightning_dcp.trainer.global_order import (
    GlobalOrderSampler,
    accumulation_for,
    global_order_sampler,
    is_distributed_sampler,
)

__all__ = ["ElasticResume", "GlobalOrderSampler", "accumulation_for"]

STATE_VERSION = 1
INT64_MAX = 2**63 - 1
"""The largest count a saved state may hold: every count is an ``int64`` where torch and the samplers use it."""


class ElasticResume(Callback):
    """Resume a run at another data-parallel world size with the same global batch size and sample order.

    At every save it records (``state_dict``, stored in the checkpoint's ``callbacks`` entry) the data-parallel
    world size, the per-device batch size, ``accumulate_grad_batches``, the epoch, and the samples consumed in the
    epoch and in total (counts of samples drawn from the sampler by all ranks together, padding included). When a
    fit resumes from such a checkpoint it, in ``on_train_start``:

    1. sets ``trainer.accumulate_grad_batches`` so that world size x batch size x accumulation equals the saved
       global batch size (or raises if no integer accumulation does);
    2. for a mid-epoch checkpoint, makes the train sampler skip the epoch's samples already consumed (globally) and
       moves Lightning's batch counters of the epoch to the same position at the new world size.

    Every optimizer step then sees the same set of samples as in the uninterrupted run (the epoch's global order is
    consumed in global-batch-size chunks at any world size), as long as no padding is involved; see
    ``docs/resume.md``.

    The train sampler is replaced by ``GlobalOrderSampler`` in every fit (not only when resuming), when it is
    Lightning's ``DistributedSampler``, or a ``RandomSampler``/``SequentialSampler`` on one device; a
    ``DistributedSampler`` run is unchanged by this, a one-device shuffled run draws the ``seed + epoch``
    permutation instead of the global random generator's. Other samplers are left alone, and a mid-epoch resume
    with one of them at another world size raises.

    Stateful loaders (``state_dict``/``load_state_dict``: torchdata's ``StatefulDataLoader``, LitData's
    ``StreamingDataLoader``) keep their sampler and, at the same world size, continue from their own saved state (each
    rank's own under a ``dcp_*`` strategy). At another world size, mid-epoch, a ``StatefulDataLoader`` with a
    ``DistributedSampler`` is repositioned as above (its saved state is not used), LitData's loader gets rank 0's
    state and restripes the rest of the epoch itself, and any other stateful loader raises ``CheckpointError``.

    Every rank computes the same from the same checkpoint; no hook is collective.

    Args:
        verbose: Log (rank 0) the accumulation change and the resume position.

    Raises:
        CheckpointError: At resume at another world size, mid-epoch: a stateful train loader it cannot reshard.
        ValueError: At resume: the global batch size cannot be kept (the message names world sizes that work), it
            would need gradient accumulation under manual optimization or under a ``GradientAccumulationScheduler``,
            or a mid-epoch position cannot be reproduced (other sampler, other shuffle seed or dataset size, a
            checkpoint saved within a gradient-accumulation window at another world size).
    """

    def __init__(self, *, verbose: bool = True) -> None:
        self.verbose = verbose
        self._trainer: Trainer | None = None
        self._sampler: GlobalOrderSampler | None = None
        self._order: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None
        self._loader_resume: dict[str, Any] | None = None
        self._stateful = False
        self._world_size = 1
        self._batch_size: int | None = None
        self._per_rank_samples = 0
        self._epoch_samples = 0
        self._epoch = 0
        self._in_epoch = 0
        self._before_epoch = 0

    # ---------------------------------------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs (samples are global counts; all values plain Python, ``weights_only``-safe)."""
        trainer = self._trainer
        accumulation = trainer.accumulate_grad_batches if trainer is not None else 1
        return {
            "version": STATE_VERSION,
            "world_size": self._world_size,
            "batch_size": self._batch_size,
            "accumulate_grad_batches": accumulation,
            "global_batch_size": None
            if self._batch_size is None
            else self._world_size * self._batch_size * accumulation,
            "epoch": self._epoch,
            "epoch_samples": self._epoch_samples,
            "samples_in_epoch": self._in_epoch,
            "samples_total": self._before_epoch + self._in_epoch,
            "order": self._order,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the saved state until ``on_train_start`` applies it (the loops are restored by then).

        Raises:
            NotACheckpointError: The saved state is not what [`state_dict`][lightning_dcp.ElasticResume.state_dict]
                writes (a field missing, of another type, or out of range: e.g. more samples consumed than its epoch
                has); the message names the checkpoint, the field and the fix.
        """
        self._check_saved(state_dict)
        self._restored = dict(state_dict)
        self._epoch = state_dict["epoch"]
        self._in_epoch = state_dict["samples_in_epoch"]
        self._before_epoch = state_dict["samples_total"] - state_dict["samples_in_epoch"]

    def _check_saved(self, state: Any) -> None:
        """``state`` is a state this callback wrote: every field of its type and in range, the counts consistent."""
        where = getattr(self._trainer, "ckpt_path", None) or "the checkpoint"
        problem = self._problem(state)
        if problem is not None:
            raise NotACheckpointError(
                f"{where!s}: ElasticResume's saved state is invalid: {problem}. The checkpoint was edited or written"
                " by another tool: resume from another checkpoint, or drop the 'ElasticResume' entry of its"
                " 'callbacks' to resume without restoring the position in the epoch."
            )

    @staticmethod
    def _problem(state: Any) -> str | None:
        """What is wrong with a saved state, in words; ``None`` when it is one ``state_dict`` could write."""
        if not isinstance(state, dict):
            return f"it is a {type(state).__name__}, not a dict"
        positive, optional = ("world_size", "accumulate_grad_batches"), ("batch_size", "global_batch_size")
        for name in (*positive, *optional, "epoch", "epoch_samples", "samples_in_epoch", "samples_total"):
            if name not in state:
                return f"{name!r} is missing"
            value = state[name]
            least = 1 if name in positive or name in optional else 0
            if not ((name in optional and value is None) or (type(value) is int and least <= value <= INT64_MAX)):
                kind = "a positive integer" if least else "a non-negative integer"
                return f"{name!r} is {value!r}, not {kind} of at most 2**63 - 1{' or None' if name in optional else ''}"
        if "version" not in state:
            return "'version' is missing"
        if type(state["version"]) is not int or state["version"] != STATE_VERSION:
            return f"'version' is {state.get('version')!r}, not {STATE_VERSION}"
        if state["samples_in_epoch"] > state["epoch_samples"]:
            return f"'samples_in_epoch' is {state['samples_in_epoch']}, more than its epoch's {state['epoch_samples']}"
        if state["samples_total"] < state["samples_in_epoch"]:
            return f"'samples_total' ({state['samples_total']}) is less than 'samples_in_epoch'"
        batch, size = state["batch_size"], state["global_batch_size"]
        if size is not None and size != state["world_size"] * (batch or 0) * state["accumulate_grad_batches"]:
            return f"'global_batch_size' {size} is not world_size x batch_size x accumulate_grad_batches"
        if "order" not in state:
            return "'order' is missing"
        order = state["order"]
        if order is not None and not (
            isinstance(order, dict)
            and type(order.get("dataset_size")) is int
            and 0 <= order["dataset_size"] <= INT64_MAX
            and type(order.get("shuffle")) is bool
            and type(order.get("seed")) is int
            and -(2**63) <= order["seed"] < 2**64
        ):
            return (
                f"'order' is {order!r}, not None or {{'dataset_size': int, 'shuffle': bool, 'seed': int}} with the"
                " dataset size in [0, 2**63 - 1] and the seed in [-2**63, 2**64 - 1] (what torch.Generator takes)"
            )
        return None

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Note how the ``dcp_*`` strategy gave the stateful train loaders their saved states (``loader_resume``)."""
        self._loader_resume = checkpoint.get(layout.INFO_KEY, {}).get("loader_resume")

    # ---------------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        pending, self._loader_resume = self._loader_resume, None
        reshard = pending is not None and not pending["exact"]
        replaced = self._install(trainer, reshard=reshard)
        if reshard and self._stateful and self._sampler is None and not reshards_itself(trainer.train_dataloader):
            raise self._refuse(trainer, pending["saved_world_size"])
        saved, self._restored = self._restored, None
        if saved is not None:
            replaced = self._resume(trainer, pl_module, saved, pending) or replaced
        if replaced:
            restart_train_iterator(trainer)  # FitLoop.setup_data iterated the loader before this hook

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install(trainer)  # the loader is new if `reload_dataloaders_every_n_epochs` reloaded it
        self._before_epoch += self._in_epoch
        self._in_epoch = 0
        self._epoch = trainer.current_epoch

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_size is not None:
            per_rank = min((batch_idx + 1) * self._batch_size, self._per_rank_samples)
            self._in_epoch = self._world_size * per_rank
        self._epoch = trainer.current_epoch

    # -------------------------------------------------------------------------------------------- helpers
    def _install(self, trainer: Trainer, *, reshard: bool = False) -> bool:
        """Find the train loader's batch size and sampler; put a ``GlobalOrderSampler`` in where supported.

        A stateful loader keeps its sampler (its own saved state replays it) unless its position is resharded now;
        its order is still recorded when its sampler draws exactly what a ``GlobalOrderSampler`` would. Returns
        whether a sampler was replaced (the epoch's iterator must then be created again).
        """
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
        self._world_size = kwargs.get("num_replicas", 1)
        loader = trainer.train_dataloader
        batch_sampler = getattr(loader, "batch_sampler", None)
        self._stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        )
        if not isinstance(loader, DataLoader) or not isinstance(batch_sampler, BatchSampler):
            self._batch_size = self._sampler = self._order = None
            return False
        self._batch_size = batch_sampler.batch_size
        sampler, replaced = batch_sampler.sampler, False
        if not isinstance(sampler, GlobalOrderSampler):
            same = is_distributed_sampler(sampler) or type(sampler) is SequentialSampler  # as GlobalOrderSampler
            sampler = global_order_sampler(sampler, world_size=self._world_size, epoch=trainer.current_epoch)
            if sampler is not None and (reshard or not self._stateful):
                batch_sampler.sampler, replaced = sampler, True
            elif not same:
                sampler = None
        self._order = None
        if sampler is not None:
            self._order = {"dataset_size": sampler.dataset_size, "shuffle": sampler.shuffle, "seed": sampler.seed}
        self._sampler = sampler if batch_sampler.sampler is sampler else None
        self._per_rank_samples, batches = _lengths(loader, batch_sampler)
        batches = min(batches, trainer.num_training_batches)
        self._epoch_samples = self._world_size * min(batches * self._batch_size, self._per_rank_samples)
        return replaced

    def _resume(
        self, trainer: Trainer, pl_module: LightningModule, saved: dict[str, Any], loaders: dict[str, Any] | None
    ) -> bool:
        """Keep the global batch size; continue a mid-epoch checkpoint's epoch (True: re-create the iterator)."""
        world, batch = self._world_size, self._batch_size
        old = f"{saved['world_size']} rank(s) x {saved['batch_size']} x {saved['accumulate_grad_batches']}"
        target = saved["global_batch_size"]
        if target is not None and (batch is None or world * batch * trainer.accumulate_grad_batches != target):
            if batch is None:
                raise ValueError(
                    "ElasticResume cannot keep the global batch size: the train loader's batch size is unknown."
                )
            accumulation = accumulation_for(target, world_size=world, batch_size=batch)
            if accumulation != 1 and not pl_module.automatic_optimization:
                raise ValueError(
                    f"ElasticResume would need accumulate_grad_batches={accumulation} to keep the global batch size"
                    f" of {target} ({old}), but manual optimization ignores it. Resume on {saved['world_size']} ranks."
                )
            if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
                raise ValueError(
                    "ElasticResume cannot change accumulate_grad_batches while a GradientAccumulationScheduler sets"
                    f" it each epoch; resume on {saved['world_size']} ranks or drop one of the two callbacks."
                )
            trainer.accumulate_grad_batches = accumulation
            if self.verbose:
                rank_zero_info(
                    f"ElasticResume: global batch size {target} kept ({old} saved, now {world} rank(s) x {batch} x"
                    f" accumulate_grad_batches={accumulation})."
                )
        consumed = saved["samples_in_epoch"]
        if not 0 < consumed < saved["epoch_samples"]:
            return False  # saved at an epoch boundary: Lightning starts the next epoch at its first sample
        return self._position(trainer, saved, consumed, loaders)

    def _position(self, trainer: Trainer, saved: dict[str, Any], consumed: int, loaders: dict[str, Any] | None) -> bool:
        """Skip the ``consumed`` samples of the saved epoch and move the batch counters to match."""
        world, batch = self._world_size, self._batch_size
        same_layout = (world, batch) == (saved["world_size"], saved["batch_size"])
        if self._stateful and (loaders is None or loaders["exact"]) and same_layout:
            return False  # the loader continues from its own saved state (each rank's own under a dcp_* strategy)
        if self._stateful and self._sampler is None:
            return self._reshard_loader(trainer, saved, consumed, loaders)
        if self._sampler is None or saved["order"] is None:
            if not same_layout and self._stateful:
                raise self._refuse(trainer, saved["world_size"])
            if not same_layout:
                raise ValueError(
                    "ElasticResume cannot continue this mid-epoch checkpoint at another world size or batch size:"
                    " the train sampler is not a DistributedSampler/RandomSampler/SequentialSampler, so which samples"
                    " were consumed is unknown. Resume from an end-of-epoch checkpoint, or with the saved world size"
                    f" ({saved['world_size']}) and batch size ({saved['batch_size']})."
                )
            rank_zero_warn("ElasticResume: this sampler cannot skip the consumed samples; the epoch restarts.")
            return
        if saved["order"] != self._order:
            raise ValueError(
                f"ElasticResume cannot continue this mid-epoch checkpoint: its epoch order came from {saved['order']},"
                f" this run's from {self._order}. Use the same dataset and seed (`seed_everything(...)` sets"
                " `PL_GLOBAL_SEED`, which the sampler shuffles with), or resume from an end-of-epoch checkpoint."
            )
        if trainer.current_epoch != saved["epoch"]:
            raise ValueError(
                f"ElasticResume: the checkpoint was saved in epoch {saved['epoch']} but the loops resume epoch"
                f" {trainer.current_epoch}; the checkpoint's callback and loop states disagree."
            )
        if consumed % (world * batch):
            raise ValueError(
                f"ElasticResume cannot continue at {world} rank(s) x {batch} samples: the checkpoint was saved after"
                f" {consumed} samples of the epoch, which is not a whole number of batches here (it was saved inside"
                " a gradient-accumulation window). Resume with the saved world size, or from a checkpoint saved"
                " after an optimizer step."
            )
        self._shift(trainer, saved, consumed)
        self._sampler.skip(epoch=saved["epoch"], samples=consumed)
        return True

    def _reshard_loader(
        self, trainer: Trainer, saved: dict[str, Any], consumed: int, loaders: dict[str, Any] | None
    ) -> bool:
        """A stateful loader that reshards its own position (LitData) gets rank 0's state; any other one raises."""
        loader = trainer.train_dataloader
        states = (loaders or {}).get("states") or []
        if not reshards_itself(loader) or len(states) != 1:
            raise self._refuse(trainer, saved["world_size"])
        world, batch = self._world_size, self._batch_size
        if batch is None or consumed % (world * batch):
            raise ValueError(
                f"ElasticResume cannot continue at {world} rank(s) x {batch} samples: the checkpoint was saved after"
                f" {consumed} samples of the epoch, which is not a whole number of global batches here (LitData"
                " would round it down and repeat samples). Resume with a world size x batch size that divides it."
            )
        loader.load_state_dict(states[0])  # LitData restripes the epoch's rest over the new ranks and workers
        self._shift(trainer, saved, consumed)
        return True

    def _refuse(self, trainer: Trainer, saved_world_size: int | None) -> Exception:
        return refuse(
            [type(trainer.train_dataloader).__name__],
            saved_world_size=saved_world_size,
            world_size=self._world_size,
            path=str(trainer.ckpt_path),
            hint="A sampler of Lightning's (`use_distributed_sampler=True`), your own `DistributedSampler` or"
            " torchdata's `StatefulDistributedSampler` lets ElasticResume skip the consumed samples; a shuffled"
            " StatefulDataLoader without one draws from its own generator, which cannot be reproduced.",
        )

    def _shift(self, trainer: Trainer, saved: dict[str, Any], consumed: int) -> None:
        """Move Lightning's batch counters of the epoch to ``consumed`` samples at this world and batch size."""
        world, batch = self._world_size, self._batch_size
        new_batches = consumed // (world * batch)
        shift_epoch_batches(trainer, new_batches - consumed // (saved["world_size"] * saved["batch_size"]))
        if self.verbose:
            rank_zero_info(
                f"ElasticResume: epoch {saved['epoch']} continues after {consumed} of its samples (batch"
                f" {new_batches} per rank at {world} rank(s))."
            )


def _lengths(loader: DataLoader, batch_sampler: BatchSampler) -> tuple[int, int]:
    """``(samples, batches)`` per rank and epoch; an iterable dataset (LitData) gives them through ``len()``."""
    try:
        return len(batch_sampler.sampler), len(batch_sampler)
    except TypeError:  # `_InfiniteConstantSampler` of an IterableDataset
        return len(loader.dataset), len(loader)
