"""The gate every optimizer step passes while an async save still needs the tensors it would change.

A save that reads tensors after its call returned (deferred staging copies, live writes, the memory tier's copies;
see :mod:`lightning_dcp.engine.save.async_save`) holds the gate; a global optimizer pre-step hook, installed on first
use, makes every step wait until the save lets it go. Lightning's Trainer runs forward and backward inside
``optimizer.step(closure)``: its strategies wait after the closure instead (:meth:`_StepGate.after_closure`).

An optimizer whose ``step`` does not run torch.optim's hooks (not a ``torch.optim.Optimizer``, or a subclass that
never called ``Optimizer.__init__``, which wraps ``step``) would change weights under a save's deferred copies:
:meth:`_StepGate.check` finds it (the Trainer's strategies check every optimizer they step, Fabric's saves the
optimizers in the saved state) and remembers it while it lives; async saves then copy everything at the call
(:meth:`_StepGate.bypassed`), with a warning once per optimizer class.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.optim.optimizer import Optimizer, register_optimizer_step_pre_hook

__all__ = ["STEP_GATE"]


def _reaches(optimizer: Any, step: Callable) -> bool:
    """Whether ``optimizer.step`` ends in its class's wrapped ``step``.

    An instance attribute may shadow the method. torch's LR schedulers set one (``LRScheduler.__init__`` wraps
    ``optimizer.step`` with :func:`functools.wraps` to track the call order): such wrappers, followed down their
    ``__wrapped__`` chain or bound ``__func__``, still call the class's ``step`` and so its hooks.
    """
    own = vars(optimizer).get("step") if hasattr(optimizer, "__dict__") else None
    for _ in range(16):  # a chain of wrappers, never a cycle
        if own is None or own is step:
            return True
        if getattr(own, "__func__", None) is step and getattr(own, "__self__", None) is optimizer:
            return True
        own = getattr(own, "__wrapped__", False) or False
        if own is False:
            return False
    return False


class _StepGate:
    """A global optimizer pre-step hook that holds steps while staging copies are pending.

    While a save's deferred copies are being made (its event not set yet), every optimizer step (and
    :meth:`wait_all`) waits for them; ``on_wait`` gets the seconds waited (a save's ``step_wait``). While nothing is
    pending the hook returns at once. Installed on first use.
    """

    def __init__(self) -> None:
        self._pending: dict[threading.Event, tuple[Callable[[float], None] | None, Callable[[], None] | None]] = {}
        self._lock = threading.Lock()
        self._hook: Any = None
        self._local = threading.local()  # .closing: the optimizer whose step waits after its closure instead
        self._watch: Callable[[float], None] | None = None
        self._streams: list[Any] = []  # queued GPU copies: the next step waits for them on the GPU (hold_stream)
        self._unhooked: weakref.WeakSet = weakref.WeakSet()  # live optimizers whose steps bypass the hooks
        self._warned: set[str] = set()  # their classes, warned about once

    def check(self, optimizer: Any) -> bool:
        """Whether ``optimizer.step`` runs torch.optim's global pre-step hooks, so its steps wait at this gate.

        ``False`` for an object that is not a ``torch.optim.Optimizer``, one whose class's ``step`` was never
        wrapped (``Optimizer.__init__`` wraps it; a subclass that skips it is not), or one with its own ``step``
        attribute shadowing the method. Such an optimizer is remembered while it lives (:meth:`bypassed`), and the
        first of its class is warned about.
        """
        step = getattr(type(optimizer), "step", None)
        if isinstance(optimizer, Optimizer) and getattr(step, "hooked", False) and _reaches(optimizer, step):
            return True
        try:
            self._unhooked.add(optimizer)
        except TypeError:  # not weakly referenceable: remembered by its class only (see bypassed)
            self._warned.add(f"@{type(optimizer).__qualname__}")
        name = type(optimizer).__qualname__
        if name not in self._warned:
            self._warned.add(name)
            rank_zero_warn(
                f"lightning_dcp: the optimizer `{name}` does not run torch.optim's step hooks (it is not a"
                " `torch.optim.Optimizer` whose `step` was wrapped by `Optimizer.__init__`), which async saves with"
                " deferred staging rely on to hold its updates until the saved tensors are copied. Async saves now"
                " copy every tensor before the save call returns, as with `defer_staging=False`."
            )
        return False

    def bypassed(self) -> bool:
        """Whether an optimizer found by :meth:`check` to bypass the step hooks is alive (saves stage at the call)."""
        return len(self._unhooked) > 0 or any(name.startswith("@") for name in self._warned)

    def hold(
        self,
        copied: threading.Event,
        on_wait: Callable[[float], None] | None = None,
        hurry: Callable[[], None] | None = None,
    ) -> None:
        """Make optimizer steps wait until ``copied`` is set (or :meth:`release` is called).

        ``hurry``: run by a step (in its thread) that finds ``copied`` not set, before it waits.
        """
        with self._lock:
            if self._hook is None:
                self._hook = register_optimizer_step_pre_hook(self._before_step)
            self._pending[copied] = (on_wait, hurry)

    def release(self, copied: threading.Event) -> None:
        """The copies behind ``copied`` are made."""
        with self._lock:
            self._pending.pop(copied, None)

    def hold_stream(self, copies: Any) -> None:
        """Hold queued GPU copies (:class:`~lightning_dcp.engine.save.stream_copies.StreamCopies`) to a step or wait.

        The next optimizer step calls ``copies.at_step()`` (its update then waits for them on the GPU, not the CPU);
        other waiters (:meth:`wait_all` with ``step=False``) block in ``copies.wait()``. Either lets them go.
        """
        with self._lock:
            if self._hook is None:
                self._hook = register_optimizer_step_pre_hook(self._before_step)
            self._streams.append(copies)

    def release_stream(self, copies: Any) -> None:
        """Forget ``copies`` (the writer waited for them, or the save failed before)."""
        with self._lock:
            self._streams = [held for held in self._streams if held is not copies]

    def watch(self, seen: Callable[[float], None]) -> None:
        """Call ``seen(perf_counter())`` once, when the next optimizer step reaches the gate."""
        self._watch = seen

    def unwatch(self, seen: Callable[[float], None]) -> None:
        """Forget ``seen`` if it is still watching.

        The gate then holds no reference to a finished save: a save kept alive until interpreter exit keeps its
        gloo group alive, whose threads, torn down during finalization, abort the process.
        """
        if self._watch == seen:
            self._watch = None

    def pending(self) -> bool:
        """Whether some staging copy held here is not made yet."""
        with self._lock:
            return bool(self._streams) or any(not copied.is_set() for copied in self._pending)

    def wait_all(self, *, step: bool = True) -> None:
        """Wait for every pending staging copy.

        ``step``: the caller is an optimizer step (it may hurry a save, see :meth:`hold`, and counts as the first
        step after a save for :meth:`watch`); ``False`` for other code that must not see the tensors change, such
        as the end of training, which only waits.
        """
        seen = self._watch
        if seen is not None and step:
            self._watch = None
            seen(time.perf_counter())
        if self._streams:
            with self._lock:
                streams, self._streams = self._streams, []
            for copies in streams:
                if step:
                    copies.at_step()
                else:
                    copies.wait()
        if not self._pending:
            return
        with self._lock:
            pending = list(self._pending.items())
        for copied, (on_wait, hurry) in pending:
            start = time.perf_counter()
            if hurry is not None and step and not copied.is_set():
                hurry()
            copied.wait()
            if on_wait is not None:
                on_wait(time.perf_counter() - start)

    @contextlib.contextmanager
    def after_closure(self, optimizer: Any, closure: Callable[[], Any]) -> Iterator[Callable[[], Any]]:
        """Inside: ``optimizer.step(closure=...)`` waits after its closure (forward and backward), not before it.

        Lightning's automatic optimization runs the forward and backward passes inside ``optimizer.step(closure)``,
        after the optimizer's pre-step hooks: a wait in the hook would keep them from overlapping the copies.
        Yields the closure to pass instead of ``closure``: it runs ``closure`` and then waits for every pending
        copy (:meth:`wait_all`); the pre-step hook of ``optimizer`` (that object only) does not wait meanwhile.
        Only for torch's own optimizers (``torch.optim``), which evaluate the closure before they change a tensor:
        others may change parameters first (SAM-like optimizers perturb them, then call the closure), so they wait
        in the hook as before and ``closure`` is yielded unchanged. One whose step bypasses the hooks
        (:meth:`check`) waits here, before the closure, and is remembered: later saves copy at the call.
        """
        if not self.check(optimizer):  # its step never reaches the hook: the pending copies are made first
            self.wait_all()
            yield closure
            return
        if not type(optimizer).__module__.startswith("torch.optim."):
            yield closure
            return

        def closure_then_wait() -> Any:
            result = closure()
            self.wait_all()
            return result

        outer = getattr(self._local, "closing", None)
        self._local.closing = optimizer
        try:
            yield closure_then_wait
        finally:
            self._local.closing = outer

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer is getattr(self._local, "closing", None):
            return  # its closure waits (after_closure)
        self.wait_all()


STEP_GATE = _StepGate()
"""The gate every optimizer step passes: ``hold(event)`` makes steps wait until ``event`` is set, ``release(event)``
lets them go (the memory tier's async saves copy into shared memory behind it too)."""
