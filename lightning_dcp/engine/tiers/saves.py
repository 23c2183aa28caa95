"""A memory-tier save as the tier tracks it: the checkpoint committed (:class:`Saved`), the save in flight, its capture.

:class:`~lightning_dcp.engine.tiers.memory.MemoryTier` keeps one :class:`Saved` per checkpoint committed in memory by
this run (what replication, eviction and persistence need), and one :class:`InFlight` for the save whose background
part is running; an async save's planner data is a :class:`Captured` copy of what the call saw.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItemType

from lightning_dcp._compat.torch_dcp import tensor_version
from lightning_dcp.engine.format.marker import parse_commit
from lightning_dcp.engine.save.staging import StagingRaceError
from lightning_dcp.engine.save.step_gate import STEP_GATE
from lightning_dcp.engine.tiers.nodes import Topology
from lightning_dcp.engine.tiers.parts import identity

__all__ = ["DEFER_FROM", "Captured", "InFlight", "Saved"]


DEFER_FROM = 1 << 20
"""CPU tensors from this size on are copied behind an async save's call (parameters and optimizer state, in practice;
optimizer steps wait for the copies); smaller ones are copied at the call."""


class Saved:
    """A checkpoint committed in memory by this run: what replication and persistence need to know of it."""

    def __init__(self, name: str, metadata: bytes, marker: bytes, topology: Topology) -> None:
        self.name, self.metadata, self.marker = name, metadata, marker
        self.parsed = parse_commit(marker)
        self.identity = identity(self.parsed)
        self.files = {f: e["size"] for f, e in self.parsed["files"].items()}
        self.node_files = {
            j: sorted(f for f in self.files if any(f.startswith(f"__{r}_") for r in ranks))
            for j, ranks in enumerate(topology.ranks)
        }
        self.persisted = False


class InFlight:
    """The save whose background part is running: its events (copied, finished), error and thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.copied = threading.Event()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self.versions: list[tuple[str, torch.Tensor, int]] = []
        self.thread: threading.Thread | None = None

    def on_copied(self) -> None:
        """Called once this rank's tensors are copied: check that none changed meanwhile, then let steps go on."""
        try:
            for fqn, source, version in self.versions:
                if tensor_version(source) != version:
                    raise StagingRaceError(
                        f"{fqn!r} was modified in place while a memory-tier save was copying it, outside an"
                        " optimizer step (which waits for the copies); the save was dropped rather than written torn."
                    )
        finally:
            self.copied.set()
            STEP_GATE.release(self.copied)


class Captured:
    """The planner's data as the save call saw it: objects and small tensors copied, large tensors referenced."""

    def __init__(self, planner: Any, items: list, inflight: InFlight) -> None:
        self.data: dict[Any, Any] = {}
        for item in items:
            data = planner.resolve_data(item)
            if item.type != WriteItemType.BYTE_IO:
                source = data.detach()
                if source.device.type == "cpu" and source.nbytes >= DEFER_FROM:
                    inflight.versions.append((item.index.fqn, source, tensor_version(source)))
                    data = source
                else:
                    data = source.to("cpu", copy=True)
            self.data[item.index] = data

    def resolve_data(self, item: Any) -> Any:
        """The data of ``item`` as captured (the planner's method of that name)."""
        return self.data[item.index]
