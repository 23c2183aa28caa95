"""What the fuzzing pass allows a reader to do, and how it watches: refuse with a CheckpointError or load exactly what
was saved, within a time limit and a memory limit; anything else is a :class:`Finding`."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import re
import resource
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from lightning_dcp import CheckpointError


class Finding(AssertionError):
    """A reader did something other than refuse with a CheckpointError or load what was saved."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class _Hang(BaseException):  # not an Exception: readers' broad `except Exception` must not swallow it
    pass


@contextlib.contextmanager
def address_space_headroom(megabytes: int) -> Iterator[None]:
    """Cap this process's address space at its current size plus ``megabytes`` (Linux), so that a reader trying to
    allocate what a crafted number claims fails at once (and is reported) instead of taking the machine's memory."""
    try:
        with open("/proc/self/status") as f:
            size_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        yield
        return
    previous = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, ((size_kb << 10) + (megabytes << 20), previous[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, previous)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_UNDER_THE_CAP = ("deallocated bytearray object has exported buffers",)
"""What CPython 3.11's C unpickler prints when allocating a BYTEARRAY8 claim fails under the address-space cap (the
reader still refuses cleanly; without the cap the same input is a plain MemoryError -> NotACheckpointError)."""


@contextlib.contextmanager
def guard(seconds: float, memory_mb: float, notes: collections.Counter | None = None) -> Iterator[None]:
    """Raise a :class:`Finding` when the block runs longer than ``seconds``, raises the peak RSS by ``memory_mb``, or
    makes the interpreter report an error it could not raise (``sys.unraisablehook``: a C extension in trouble)."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise _Hang()

    unraisable: list[str] = []
    previous_hooks = sys.unraisablehook, sys.excepthook
    sys.unraisablehook = lambda info: unraisable.append(f"{info.exc_type.__name__}: {info.exc_value} ({info.object!r})")
    sys.excepthook = lambda kind, value, tb: unraisable.append(f"{kind.__name__}: {value}")  # C code's PyErr_Print
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    before = _peak_mb()
    try:
        yield
        gc.collect()  # objects a reader left behind are freed here, inside the guard
    except _Hang:
        raise Finding("hang", f"no answer within {seconds} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.unraisablehook, sys.excepthook = previous_hooks
    unknown = [u for u in unraisable if not any(known in u for known in _UNDER_THE_CAP)]
    if notes is not None:
        notes.update(u for u in unraisable if u not in unknown)
    if unknown:
        raise Finding("unraisable", "; ".join(unknown)[:400])
    grown = _peak_mb() - before
    if grown > memory_mb:
        raise Finding("memory", f"peak RSS grew by {grown:.0f} MB")


_WRAPPED = re.compile(
    r"failed(?: on rank \d+)?: (TypeError|ValueError|IndexError|KeyError|AttributeError|RuntimeError|AssertionError|"
    r"OverflowError|ZeroDivisionError|UnicodeDecodeError|RecursionError|NotImplementedError|StopIteration|"
    r"struct\.error|OSError|UnpicklingError):"
)
_ALLOC = re.compile(r"MemoryError|can't allocate memory|DefaultCPUAllocator")


def call(fn: Callable[[], Any], stats: Stats) -> tuple[str, Any]:
    """``("ok", value)`` or ``("refused", error)``; any other exception is a :class:`Finding`."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "ok", fn()
    except CheckpointError as err:
        text = str(err)
        if _ALLOC.search(text):  # tried to allocate more than the address-space cap: see allocation_refused
            stats.allocation_refused += 1
            stats.samples.setdefault("allocation refused", text[:300])
        raw = _WRAPPED.search(text)
        if raw:  # a refusal, but one where a catch-all wrapped a reader's raw exception: message quality
            stats.unclassified[raw.group(1)] += 1
            stats.samples.setdefault(f"unclassified {raw.group(1)}", text[:300])
        stats.reasons[_reason(text)] += 1
        return "refused", err
    except (Finding, _Hang):
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - any other exception is what this fuzzing looks for
        raise Finding("exception", f"{type(err).__module__}.{type(err).__name__}: {str(err)[:300]}") from None


def _reason(text: str) -> str:
    """A refusal's message without its paths and numbers: what kind of check refused."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"|/\S+", "_", text)
    return re.sub(r"\d+", "N", text)[:90]


# ------------------------------------------------------------------------------------------------ comparisons
def same(a: Any, b: Any) -> bool:
    """Exact equality of nested checkpoint values (tensors bit for bit, numpy values by dtype and value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor leaf of nested dicts and lists, by dotted path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    found: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found.update(tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


# ------------------------------------------------------------------------------------------------ the template
@dataclasses.dataclass
class Stats:
    """What one reader's fuzzing saw."""

    reader: str
    examples: int = 0
    seconds: float = 0.0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    unclassified: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    reasons: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    allocation_refused: int = 0
    interpreter_notes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    findings: list[dict[str, str]] = dataclasses.field(default_factory=list)
    samples: dict[str, str] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "examples": self.examples,
            "seconds": round(self.seconds, 1),
            "outcomes": dict(self.outcomes),
            "non_checkpoint_errors": sum(1 for f in self.findings if f["kind"] == "exception"),
            "findings_by_kind": dict(collections.Counter(f["kind"] for f in self.findings)),
            "findings": self.findings[:20],
            "refusals_wrapping_a_raw_error": dict(self.unclassified),
            "refusals_after_an_allocation_failed": self.allocation_refused,
            "interpreter_notes_under_the_memory_cap": dict(self.interpreter_notes),
            "samples": self.samples,
            "top_refusals": dict(self.reasons.most_common(12)),
        }
