"""The sample order that ``ElasticResume`` reproduces at any world size, and the accumulation keeping the batch.

``GlobalOrderSampler`` yields what ``DistributedSampler`` yields (a permutation seeded with ``seed + epoch``, padded
and dealt to the ranks in turn) and can start an epoch part-way; see ``docs/resume.md``.
"""

from __future__ import annotations

import math
import os

import torch
from torch.utils.data import DistributedSampler, RandomSampler, Sampler, SequentialSampler

__all__ = ["GlobalOrderSampler", "accumulation_for", "global_order_sampler", "is_distributed_sampler"]


class GlobalOrderSampler(Sampler[int]):
    """``DistributedSampler``'s order (same seed, epoch, padding and split), able to start an epoch part-way.

    Outside the epoch given to :meth:`skip`, it yields exactly what ``DistributedSampler(dataset_size, ...)`` yields.
    In that epoch it drops the first ``samples`` indices of the epoch's global order (the permutation before padding,
    which does not depend on the world size), then pads/trims and deals the rest as ``DistributedSampler`` would.
    ``len()`` is always the full epoch's per-rank length, which is what Lightning's batch counting expects.

    Args:
        dataset_size: Number of samples in the dataset.
        num_replicas: Data-parallel world size (ranks that draw different samples).
        rank: This rank's index among ``num_replicas``.
        shuffle: Permute with ``seed + epoch`` (else the natural order).
        seed: The shuffle seed (Lightning uses ``PL_GLOBAL_SEED``).
        drop_last: Trim to a multiple of ``num_replicas`` instead of padding with repeated samples.
        epoch: The epoch used until :meth:`set_epoch` is called.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool = False,
        epoch: int = 0,
    ) -> None:
        self.dataset_size = dataset_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = epoch
        self.skip_epoch: int | None = None
        self.skip_samples = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (Lightning calls this before each epoch)."""
        self.epoch = epoch

    def skip(self, *, epoch: int, samples: int) -> None:
        """Start ``epoch`` after its first ``samples`` samples (global count, all ranks together)."""
        self.skip_epoch, self.skip_samples = epoch, samples

    def global_order(self, epoch: int) -> list[int]:
        """The epoch's sample indices in the order all ranks together consume them (no padding)."""
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def _per_rank(self, n: int) -> int:
        if self.drop_last and n % self.num_replicas:
            return math.ceil((n - self.num_replicas) / self.num_replicas)
        return math.ceil(n / self.num_replicas)

    def __len__(self) -> int:
        return self._per_rank(self.dataset_size)

    def __iter__(self):
        order = self.global_order(self.epoch)
        if self.epoch == self.skip_epoch:
            order = order[self.skip_samples :]
        total = self._per_rank(len(order)) * self.num_replicas
        if total > len(order) and order:
            order = (order * math.ceil(total / len(order)))[:total]
        return iter(order[self.rank : total : self.num_replicas])


def accumulation_for(global_batch_size: int, *, world_size: int, batch_size: int) -> int:
    """The ``accumulate_grad_batches`` that keeps ``global_batch_size`` samples per optimizer step.

    Raises:
        ValueError: ``global_batch_size`` is not a multiple of ``world_size * batch_size``.
    """
    per_micro_step = world_size * batch_size
    if global_batch_size % per_micro_step:
        per_rank = global_batch_size // batch_size if global_batch_size % batch_size == 0 else 0
        fits = [w for w in range(1, min(per_rank, _LISTED_WORLD_SIZES) + 1) if per_rank % w == 0]
        where = f"Resume on {_or(fits)} rank(s) with this batch size, or change" if fits else "Change"
        raise ValueError(
            f"ElasticResume cannot keep the global batch size of {global_batch_size} samples on {world_size} ranks"
            f" with {batch_size} samples per device: {global_batch_size} is not a multiple of {per_micro_step}."
            f" {where} the per-device batch size so that world size x batch size divides {global_batch_size}, or"
            " remove ElasticResume to accept a different global batch size."
        )
    return global_batch_size // per_micro_step


_LISTED_WORLD_SIZES = 1 << 16
"""World sizes up to this many are named in the message (a crafted batch size must not make the search endless)."""


def _or(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


def is_distributed_sampler(sampler: Sampler) -> bool:
    """``DistributedSampler`` itself or torchdata's ``StatefulDistributedSampler`` (the same order).

    Not Lightning's ``DistributedSamplerWrapper``, which wraps a custom order.
    """
    stateful = isinstance(sampler, DistributedSampler) and type(sampler).__module__.startswith("torchdata.")
    return type(sampler) is DistributedSampler or stateful


def global_order_sampler(sampler: Sampler, *, world_size: int, epoch: int) -> GlobalOrderSampler | None:
    """The :class:`GlobalOrderSampler` drawing what ``sampler`` draws (``None`` when that cannot be reproduced)."""
    if is_distributed_sampler(sampler):
        return GlobalOrderSampler(
            len(sampler.dataset),
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
            epoch=epoch,
        )
    if world_size != 1:  # every rank draws the whole dataset (`use_distributed_sampler=False`): not ours to change
        return None
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # what Lightning's DistributedSampler would use
    if type(sampler) is SequentialSampler:
        return GlobalOrderSampler(len(sampler.data_source), num_replicas=1, rank=0, shuffle=False, seed=seed)
    # torchdata's StatefulDataLoader swaps in its own RandomSampler, which always has a generator of its own
    plain = type(sampler) is RandomSampler and sampler.generator is None
    stateful = type(sampler).__name__ == "RandomSampler" and type(sampler).__module__.startswith("torchdata.")
    if (plain or stateful) and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        return GlobalOrderSampler(
            len(sampler.data_source), num_replicas=1, rank=0, shuffle=True, seed=seed, epoch=epoch
        )
    return None
