"""What an async save does when it is called while the previous one is still being written (``when_busy``).

At most one async save is in flight (:mod:`lightning_dcp.engine.save.async_save`): its staging buffers are reused by the
next save, and two writers would share the disk anyway. When saves are requested faster than the disk takes them, a
new save finds the previous write unfinished, and the front ends offer two policies:

- ``"wait"`` (the default): the call blocks until the previous save is committed, then saves. Every requested
  checkpoint is written; the loop pays the rest of the previous write.
- ``"skip"``: the call returns at once without saving and warns naming the step and path skipped (never silently).
  The loop pays nothing; the checkpoint of that step does not exist. A save of the same step as the one in flight
  (``ModelCheckpoint``'s ``last.ckpt`` right after its top-k file) is never skipped: it waits. Removals requested
  after a skipped save (``ModelCheckpoint`` pruning the file the skipped one would have replaced) are held until a
  later save commits, so a checkpoint is never removed before a newer one exists; those left when the run ends stay
  on disk. A ``last`` link to a skipped path dangles; ``ckpt_path="last"`` loads the newest committed checkpoint of
  the directory anyway (:func:`lightning_dcp.engine.catalog.lookup.candidates`).

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
