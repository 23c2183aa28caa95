"""Stateful data loaders for the resume tests: torchdata's StatefulDataLoader, LitData on an optimized local dataset,
and a user's own stateful iterable. Every item is ``(x, y, index)``, so a test can follow each sample."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DistributedSampler

from tests._models import IndexedDataset

SAMPLES = 48


class AugmentedDataset(IndexedDataset):
    """``IndexedDataset`` whose ``x`` gets random noise from a generator of its own, seeded by rank and kept in its
    ``state_dict`` (which StatefulDataLoader snapshots per worker): the loader states of the ranks differ.

    (Noise from torch's global generator inside a worker would not continue exactly: torchdata 0.11 restarts the
    workers of a map-style dataset from their seed, without replaying the batches they had produced.)"""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.generator = torch.Generator().manual_seed(100 + rank)

    def __getitem__(self, i: int):
        x, y, index = super().__getitem__(i)
        return x + 0.1 * torch.randn(x.shape, generator=self.generator), y, index

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


def _item(index: int) -> dict[str, Any]:
    dataset = IndexedDataset(SAMPLES)
    x, y, i = dataset[index]
    return {"x": x, "y": y, "index": i}


def make_litdata(directory: str) -> str:
    """``litdata.optimize`` the ``SAMPLES`` items of ``IndexedDataset`` into ``directory`` (4 items a chunk)."""
    import litdata

    output = os.path.join(directory, "optimized")
    litdata.optimize(fn=_item, inputs=list(range(SAMPLES)), output_dir=output, chunk_size=4, num_workers=1)
    return output


def _as_tuple(item: dict[str, Any]) -> tuple:
    return item["x"] + 0.1 * torch.randn(item["x"].shape), item["y"], item["index"]


def make_loader(kind: str, *, batch_size: int, data: str | None = None, **kwargs: Any) -> Any:
    """A loader of ``kind`` (``kwargs`` go to the DataLoader).

    ``"sdl0"``/``"sdl2"``: StatefulDataLoader (0 / 2 workers) with a shuffling DistributedSampler of its own (call it
    with a process group; Lightning would wrap torchdata's RandomSampler); ``"litdata"``: StreamingDataLoader over
    ``data`` (from :func:`make_litdata`), shuffled; ``"own"``: :class:`OwnStatefulLoader`.
    """
    if kind.startswith("sdl"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        dataset = AugmentedDataset(SAMPLES)
        sampler = DistributedSampler(dataset, shuffle=True, seed=7)
        workers = int(kind[3:])
        # fork, as under torchrun: the test ranks are spawned, and their children would otherwise be spawned too (slow)
        context = "fork" if workers else None
        return StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=workers,
            multiprocessing_context=context,
            **kwargs,
        )
    if kind == "litdata":
        import litdata

        # drop_last explicit: LitData drops the tail only when distributed by default, and refuses a change at resume
        dataset = litdata.StreamingDataset(data, shuffle=True, drop_last=True, seed=3, transform=_as_tuple)
        return litdata.StreamingDataLoader(dataset, batch_size=batch_size, **kwargs)
    if kind == "own":
        return OwnStatefulLoader(batch_size)
    raise ValueError(kind)


class LoaderDataModule(LightningDataModule):
    def __init__(self, kind: str, *, batch_size: int, data: str | None = None) -> None:
        super().__init__()
        self.kind, self.batch_size, self.data = kind, batch_size, data

    def train_dataloader(self) -> Any:
        return make_loader(self.kind, batch_size=self.batch_size, data=self.data)


class OwnStatefulLoader:
    """A user's own stateful loader: every rank walks its own shuffled half of the data and adds noise from its own
    generator (seeded by rank, part of its state); no sampler, no resharding."""

    def __init__(self, batch_size: int) -> None:
        self.dataset, self.batch_size, self.position, self.epoch = IndexedDataset(SAMPLES), batch_size, 0, 0
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.generator = torch.Generator().manual_seed(100 + rank)

    def _order(self) -> list[int]:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(11 + self.epoch)).tolist()
        return order[rank::world]

    def __len__(self) -> int:
        return len(self._order()) // self.batch_size

    def __iter__(self):
        if self.position >= len(self):  # the previous epoch was read to its end
            self.position, self.epoch = 0, self.epoch + 1
        order = self._order()
        while self.position < len(self):
            ids = order[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            self.position += 1
            x, y, _ = zip(*(self.dataset[i] for i in ids), strict=True)
            x = torch.stack(x)
            yield x + 0.1 * torch.randn(x.shape, generator=self.generator), torch.stack(y), torch.tensor(ids)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "epoch": self.epoch, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position, self.epoch = state["position"], state["epoch"]
        self.generator.set_state(state["generator"])


def samples_by(results: list[dict], key: int) -> dict[int, Counter]:
    """Sample ids of all ranks grouped by epoch (``key=0``) or by optimizer step (``key=1``).

    ``results``: one per rank, each with ``ids``, a list of ``(epoch, step, sample ids)``.
    """
    groups: dict[int, Counter] = {}
    for result in results:
        for entry in result["ids"]:
            groups.setdefault(entry[key], Counter()).update(entry[2])
    return groups
