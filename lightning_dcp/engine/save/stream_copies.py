"""Async saves of GPU tensors: staging copies queued on CUDA streams, never waited for by the save call.

Deferred staging (:mod:`lightning_dcp.engine.save.async_save`) makes the call cheap on CPU; on a GPU the same holds with
streams instead of a thread. The save call queues every device-to-host copy into the pinned staging buffers and
returns without synchronizing:

- the tensors only optimizer steps change (parameters an optimizer holds, its state) are copied on a side stream
  that first waits for the current stream: the copy engine moves them while the next step's forward and backward
  run. The first optimizer step after the call makes the current stream wait for the side stream's event (a wait on
  the GPU: the CPU goes on queueing the update, which runs once the copies are done), through the step gate
  (:mod:`lightning_dcp.engine.save.step_gate`, :meth:`StreamCopies.at_step`);
- the others (module buffers a forward pass changes, tensors learned to change outside steps) are copied on the
  current stream, so they are done before any later kernel of the loop touches them.

The background writer waits for both events before it reads a buffer (:meth:`StreamCopies.wait`). A tensor whose
in-place version counter moved between the call and the first optimizer step (or the writer's wait, whichever comes
first) may have changed under its side-stream copy: the save is dropped with a warning naming it, and it is copied
at the call from then on, as on CPU. Writes through ``param.data`` and inside kernels are not seen, as on CPU.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lightning_dcp._compat.torch_dcp import tensor_version

__all__ = ["StreamCopies"]

_SIDE: dict[torch.device, Any] = {}  # one side stream per device, made once


class StreamCopies:
    """One save's device-to-host copies of CUDA tensors into pinned buffers, queued without blocking the caller."""

    def __init__(self) -> None:
        self._now: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, source) on the current stream
        self._later: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []  # (key, buffer, source, version): side
        self._events: list[Any] = []  # every copy done once these are
        self._side_events: list[tuple[torch.device, Any]] = []  # what an optimizer update waits for
        self._lock = threading.Lock()
        self._settled = False
        self.changed: list[str] = []
        """Keys of side-stream sources that changed before the first step (or the writer's wait): the save drops."""

    def add(self, key: str, source: torch.Tensor, buffer: torch.Tensor, *, later: bool) -> None:
        """Queue ``buffer.copy_(source)``: on the side stream when ``later`` (only optimizer steps change it)."""
        if later:
            self._later.append((key, buffer, source, tensor_version(source)))
        else:
            self._now.append((buffer, source))

    def launch(self) -> None:
        """Queue every copy (non-blocking; the pinned buffers make them asynchronous) and record the events."""
        devices = {source.device for _, source in self._now} | {source.device for _, _, source, _ in self._later}
        for device in devices:
            current = torch.cuda.current_stream(device)
            for buffer, source in self._now:
                if source.device == device:
                    buffer.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(current)
            self._events.append(event)
            later = [(buffer, source) for _, buffer, source, _ in self._later if source.device == device]
            if not later:
                continue
            side = _SIDE.get(device)
            if side is None:
                side = _SIDE[device] = torch.cuda.Stream(device=device)
            side.wait_stream(current)  # the values at the call, after what the loop queued before it
            with torch.cuda.stream(side):
                for buffer, source in later:
                    buffer.copy_(source, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            self._events.append(event)
            self._side_events.append((device, event))

    def at_step(self) -> None:
        """Before an optimizer update (the training thread): note changes so far, make the update wait on the GPU."""
        self._settle()
        for device, event in self._side_events:
            torch.cuda.current_stream(device).wait_event(event)

    def wait(self) -> None:
        """Block this thread until every copy has landed (the writer's thread, or code outside optimizer steps)."""
        for event in self._events:
            event.synchronize()
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            if not self._settled:
                self._settled = True
                self.changed = [key for key, _, source, version in self._later if tensor_version(source) != version]
