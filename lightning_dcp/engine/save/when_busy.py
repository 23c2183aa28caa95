"""What an async save does when it is called while the previous one is still being written (``when_busy``).

At most one async save is in flight (:mod:`lightning_dcp.engine.save.async_save`): its staging buffers are reused by the
next save, and two writers would share the disk anyway. When saves are requested faster than the disk takes them, a
new save finds the previous write unfinished, and the front ends offer two policies:

- ``"wait"`` (the default): the call blocks until the previous save is committed, then saves. Every requested
  checkpoint is written; the loop pays the rest of the previous write (counted in that save's
  ``checkpoint/save_blocked_s``).
- ``"skip"``: the call returns at once without saving and warns naming the step and path skipped (never silently).
  The loop pays nothing for it (the vote below, counted on the save in flight); the checkpoint of that step does not
  exist. A save of the same step as the one in flight
  (``ModelCheckpoint``'s ``last.ckpt`` right after its top-k file) is never skipped: it waits. Removals requested
  after a skipped save (``ModelCheckpoint`` pruning the file the skipped one would have replaced) are held until a
  later save commits, so a checkpoint is never removed before a newer one exists; those left when the run ends stay
  on disk. A ``last`` link to a skipped path dangles; ``ckpt_path="last"`` loads the newest committed checkpoint of
  the directory anyway (:func:`lightning_dcp.engine.catalog.lookup.candidates`).

**When a save is busy.** ``checkpoint/save_blocked_s`` (:mod:`lightning_dcp.engine.save_log`) counts every wait of
the loop for a save: its call, the optimizer steps after it waiting at the step gate for its staging copies (or its
live write), a later call waiting for its write, and the teardown. Of these, only the wait of a later call depends
on the storage (how long the write takes); the call and the steps wait for memory copies that every save costs. So
``"skip"`` skips exactly the saves that would wait for the storage: a save is skipped when, at its call, the
previous save's write is not finished on some rank, which is when ``"wait"`` would block the call for it (and count
that block on the previous save). A save the steps already waited for is not busy: those waits were its copies. For
this to hold with live writes (:mod:`lightning_dcp.engine.save.live_write`), under ``"skip"`` a step that arrives
while the writer still reads the live tensors never waits for the writer: it copies what is left and goes on, so the
write goes on in the background and the next call finds it unfinished. Under ``"skip"``, then, the loop waits for a
save's copies (in its call and the next step: what its ``save_blocked_s`` shows), for at most one 16 MiB piece of
each file being written, for the first save of a run (and a save whose plan changed) to be planned before its
copies are made, and at the end of training for the last save's write (the teardown); never for a write still
running when the next save is called. The time a background write takes from the training in other ways (cores,
memory bandwidth and the kernel's work for the write on a machine the training keeps busy) is no wait and is in no
metric: compare a fit with and without saves (``python -m benchmarks.bench_loop_cost``).

A second set of staging buffers (a save staged while the previous one writes) was not taken: it doubles the pinned
or page-locked memory of the state and only helps while the disk keeps up on average, which is when ``"wait"``
costs nothing either.

The decision is collective when the save is: every rank votes whether its part of the previous save is done, over
the default process group in the caller's thread (one small all-reduce, where ``_await_pending`` would gather the
previous save's errors anyway), so all ranks skip or save together.
"""

from __future__ import annotations

from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_dcp.engine.dist import all_true, distributed
from lightning_dcp.engine.storage.location import Location

__all__ = ["WHEN_BUSY", "WhenBusy"]

WHEN_BUSY = ("wait", "skip")
"""The accepted ``when_busy`` values."""


class WhenBusy:
    """The ``when_busy`` policy of one checkpointer: decide skips, remember them, hold removals behind them.

    Args:
        policy: ``"wait"`` or ``"skip"`` (see the module docstring).

    Raises:
        ValueError: ``policy`` is neither.
    """

    def __init__(self, policy: str) -> None:
        if policy not in WHEN_BUSY:
            raise ValueError(f"`when_busy` must be one of {WHEN_BUSY}, got {policy!r}.")
        self.policy = policy
        self.skipped: list[tuple[int | None, str]] = []
        """``(step, url)`` of every save skipped so far, oldest first."""
        self._held: list[Location] | None = None  # removals requested since the last skip (None: no skip pending)
        self._step: int | None = None  # the step of the save in flight
        self._url: str | None = None  # ... and its location

    def skip(self, saves: Any, location: Location, *, step: int | None, collective: bool) -> bool:
        """Whether this save is skipped (``"skip"`` and the save in flight not done on some rank); warns if so.

        ``saves``: the :class:`~lightning_dcp.engine.save.async_save.AsyncSaves` of the checkpointer.

        Collective: call on all ranks when ``collective`` (and a save is in flight); otherwise no collective.
        """
        if self.policy != "skip" or saves is None or saves.in_flight is None:
            return False
        if step is not None and step == self._step:  # a second file of the step in flight: never skipped
            return False
        done = saves.done()
        if distributed(collective):
            done = all_true(done)
        if done:
            return False
        self.skipped.append((step, location.url))
        if self._held is None:
            self._held = []
        what = "the checkpoint" if step is None else f"the checkpoint of step {step}"
        rank_zero_warn(
            f"lightning_dcp: skipped {what} to {location.url!r} (`when_busy='skip'`): the previous async save"
            f" (to {self._url!r}) was still being written. Nothing was written for this save; earlier checkpoints are"
            " intact and no checkpoint is removed until a newer one is committed. Save less often, or pass"
            " `when_busy='wait'` to block until the previous write is done."
        )
        return True

    def hold(self, location: Location) -> bool:
        """Whether the removal of ``location`` is held (a save was skipped since the last one that started)."""
        if self._held is None:
            return False
        if all(held.url != location.url for held in self._held):
            self._held.append(location)
        return True

    def started(self, location: Location, *, step: int | None) -> list[Location]:
        """A save to ``location`` started in the background: returns the removals held so far, to request now.

        Requested after the start, they run once that save commits (``Checkpointer.remove``); a held removal of
        ``location`` itself is dropped (the new save replaces it).
        """
        self._step, self._url = step, location.url
        held, self._held = self._held or [], None
        return [removal for removal in held if removal.url != location.url]
