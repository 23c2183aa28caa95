"""Background saves: at most one in flight; its commit and the removals queued behind it run when it completes.

The training loop pays for planning and part of the staging only. In the caller's thread, over a dedicated gloo
process group (created once per run: the training collectives must not share a group with a background thread), the
save is planned (:func:`lightning_dcp.engine.save.saving.prepare`: after the first save of a run, a 16-byte exchange)
and the items *this rank writes* are staged into reused buffers (:mod:`lightning_dcp.engine.save.staging`): under DDP a
rank stages its share of the replicated state, not all of it. A background thread then writes (direct I/O and checksums,
both outside the GIL, so the training loop keeps the interpreter) and finishes the checkpoint over the same group.
When the save completes, rank 0 commits it in that thread, then deletes the checkpoints whose removal was requested
while it was in flight: a checkpoint is never removed before its successor is saved.

**Deferred staging** (``defer=True``, the default of the front ends). Between a save call and the next optimizer
step a training loop runs a forward and a backward pass: they change buffers in place (BatchNorm statistics, buffers
DDP broadcasts), not parameters or optimizer state. So CPU tensors are copied by the background thread after the
call returned, while every optimizer step waits until those copies are made (:data:`STEP_GATE`, a global optimizer
pre-step hook; front ends also wait before other code that may change weights, such as Lightning's validation, where
weight-averaging callbacks swap weights in place). Lightning's Trainer runs the forward and backward passes inside
``optimizer.step(closure)``, after the pre-step hooks: its strategies wait after the closure instead
(:meth:`STEP_GATE.after_closure`), or the copies would never overlap them. The tensors a front end names *volatile*
(module buffers, values that are neither a module's nor an optimizer's), GPU tensors (copied into pinned buffers at
once) and the non-tensor state are copied before the call returns, the CPU ones in one batched copy. Planning moves
to the background thread too (its collectives run over the save's own group), from a run's first save on (the
``conv`` mix's first save call: 0.70 s with its planning, 0.26 s without): the call flattens the state, makes those
copies and records the version counter of every tensor it leaves live; the thread copies first the live tensors this
rank wrote in the previous save (the plan of a run rarely changes; none at a run's first save, when steps wait for
the whole plan) and lets optimizer steps go on, then plans, copies whatever else its plan names (none unless the
plan changed) and checks every version. Safety net: every deferred copy checks the tensor's in-place version counter
afterwards; a tensor that changed before its copy was made (weight clipping right after a save, by an in-place
operation on the parameter) drops that save, which is never committed (no checkpoint mixes two steps, and the
removals queued behind it do not run), with a warning naming it at the next call; that tensor is copied at the call
from then on. (Writes through ``param.data`` and inside kernels do not move version counters: code that changes
parameters that way between a save and the next optimizer update, in a callback, in ``training_step`` or in a
forward pass, needs ``defer_staging=False``.)

**Live writes** (on local disks, chosen save by save): the deferred tensors are not copied at all; the writer
reads them where they are while optimizer steps wait (:mod:`lightning_dcp.engine.save.live_write`). A step that arrives
before the writer is done copies what is left and goes on (the writer takes the copies). Each save measures how
long its write took from the call (``ready``) and when the first step after the call came (``window``); the next
save writes live unless the last live save kept steps waiting more than 5% of its write, or the last staged save's
write would have outlasted its window; a live save expected to outlast its window has its rest copied in the
background at 75% of the last window, before the step is due. A live write needs no staging memory and no copy
(the first save of a run no longer faults in fresh buffers, ~9 us per 4 KiB page on this project's machine).

Measured against the alternative of a forked writer (copy-on-write pages instead of a staging copy) on this project's
machine: forking a process holding 1.2 GB of parameters and AdamW state took 0.10-0.16 s, and the next optimizer
step then ran 0.9-2.0 s slower while the pages were copied on write, against 0.5-1.0 s for the whole staging copy
made by a background thread (``python -m benchmarks.fork_cow --mix huge``).

**What the loop pays.** The loop is blocked for the call, whatever optimizer steps (and code waiting for staging,
such as Lightning's validation) wait at the gate for the save's copies or its live write
(:attr:`AsyncSaves.last_step_wait`), and whatever later code waits for its write: the next save call
(back-pressure, ``when_busy="wait"``), a load, a removal of the checkpoint being written, the teardown. Each
:class:`~lightning_dcp.engine.save.inflight.InFlight` counts all of them after its call (``loop_wait``) and hands
each to its ``charge`` (the Checkpointer adds them to the save's record: ``checkpoint/save_blocked_s``). With
``steps_wait_for_writer=False`` (the Checkpointer's choice under ``when_busy="skip"``) a step never waits for a live
writer: it copies what the writer has not written yet and goes on, so steps wait for memory copies only (and at most
one 16 MiB piece of each file being written), and a write that outlasts the interval between two saves is found
unfinished by the next call, which skips.

**Process groups** (which group each collective uses; nothing runs a collective at world size 1 or when a single
process saves alone, and no side group is made then):

- *The save's own group*: a gloo group from :func:`~lightning_dcp.engine.dist.own_group` (destroyed at exit), made once
  per :class:`AsyncSaves` at its first distributed save (a collective of the default group, in the caller's thread).
  Gloo whatever the training backend is (``nccl``, ``cpu:gloo,cuda:nccl``, ``cpu:gloo``). Everything a background thread
  runs uses it and nothing else: planning (:func:`~lightning_dcp.engine.save.saving.prepare`), the write's gather of
  results and the broadcast of the outcome (:func:`~lightning_dcp.engine.save.saving.write`). Planning in the caller's
  thread (saves without deferred staging) and the staging agreement (:func:`~lightning_dcp.engine.save.saving.agree`)
  use it too, before the background thread starts: one thread at a time issues its collectives.
- *The default (training) group*, only in the caller's thread, in the order every rank makes its calls: rank 0's
  decisions (``on_rank0``: where to write), gathering the previous save's errors (``Checkpointer.wait``), the
  ``when_busy="skip"`` vote (:mod:`lightning_dcp.engine.save.when_busy`). A background thread never issues a collective
  on it: on a GPU it is NCCL's, and collectives from a second thread there hang or corrupt runs.
- The memory tier's copies and replication use the tier's own gloo group (``MemoryTier.group``), never this one nor
  the default group; the local tier's uploads (:mod:`lightning_dcp.engine.tiers`) run no collective.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.distributed.checkpoint import SavePlanner, StorageWriter
from torch.distributed.checkpoint.planner import WriteItem

from lightning_dcp.engine.dist import own_group
from lightning_dcp.engine.save import saving
from lightning_dcp.engine.save.inflight import InFlight, Stage
from lightning_dcp.engine.save.live_write import LiveWrite
from lightning_dcp.engine.save.planning import BalancedSavePlanner, flatten
from lightning_dcp.engine.save.staging import Deferred, Stager, StagingRaceError
from lightning_dcp.engine.save.step_gate import STEP_GATE
from lightning_dcp.engine.storage.location import Location
from lightning_dcp.errors import checkpoint_failure

__all__ = ["STEP_GATE", "AsyncSaves"]

_GATE = STEP_GATE

log = logging.getLogger(__name__)


class _Staged:
    """What the background writer reads: the staged copy of each of this rank's write items."""

    def __init__(self, staged: dict[Any, Any]) -> None:
        self.staged = staged

    def resolve_data(self, item: WriteItem) -> Any:
        return self.staged[item.index]


class AsyncSaves:
    """Run saves in the background one at a time and surface their errors at the next call.

    Args:
        pin_memory: Pinned staging buffers (default: whether CUDA is available).
        defer: Deferred staging (see the module docstring): CPU tensors other than the volatile ones are copied in
            the background while the next optimizer step waits for them; ``False`` copies everything at the call.
        live: With ``defer``, whether those tensors are written as they are instead of copied (live writes, see
            the module docstring): ``None`` chooses save by save from the last save's timings; ``True`` whenever
            the writer writes local files; ``False`` never.
        steps_wait_for_writer: Whether a step that finds a live write unfinished may wait for the writer when that
            is estimated to take less than copying the rest; ``False``: it always copies the rest and goes on.
    """

    def __init__(
        self,
        *,
        pin_memory: bool | None = None,
        defer: bool = False,
        live: bool | None = None,
        steps_wait_for_writer: bool = True,
    ) -> None:
        self.defer = defer
        self.live = live
        self.steps_wait_for_writer = steps_wait_for_writer
        self._live_next = True  # the adaptive choice for the next save (live until a save says otherwise)
        self._timings: tuple[float, float] | None = None  # the last save's (ready_time, window): see _learn
        self._write_rate: float | None = None  # bytes per second of the last live write (LiveWrite's estimates)
        self.stager = Stager(pin_memory=pin_memory)
        self._group: dist.ProcessGroup | None = None
        self._inflight: InFlight | None = None
        self._last: InFlight | None = None
        self._at_call: set[str] = set()  # keys seen changing before their deferred copy: copied at the call
        self.last_step_wait: float | None = None
        """Seconds optimizer steps (and code waiting for staging) waited at the gate for the deferred copies or the
        live write of the last save that completed (``wait``)."""
        self._last_items: list[WriteItem] | None = None  # what this rank wrote in the last save planned
        self._last_keys: frozenset[str] = frozenset()  # the flat keys of the last save planned
        self.last_deferred: list[str] = []
        """Keys of the tensors whose staging copies the last :meth:`start` left to the background thread."""
        self.last_live = False
        """Whether the last :meth:`start` writes those tensors live (no staging copies)."""

    @property
    def in_flight(self) -> Location | None:
        """The location of the save in flight, if one is."""
        return None if self._inflight is None else self._inflight.location

    def done(self) -> bool:
        """Whether this rank's part of the save in flight (if any) is finished: :meth:`wait` would not block."""
        return self._inflight is None or self._inflight.finished.is_set()

    def start(
        self,
        state_dict: dict[str, Any],
        *,
        writer: StorageWriter,
        planner: SavePlanner,
        location: Location,
        rank: int,
        distributed: bool,
        commit: Callable[[], None],
        abandon: Callable[[], None],
        volatile: Iterable[torch.Tensor] | None = None,
        charge: Callable[[float], None] | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        """Stage ``state_dict`` (what may change before the next optimizer step), then save it in the background.

        Call :meth:`wait` first. Deferred saves of plain tensors are planned in the background; saves without
        deferred staging (or of DTensor/ShardedTensor state) are planned in the call (see the module docstring).

        ``volatile``: tensors that may change in place before the next optimizer step (module buffers); their
        staging copies (of any tensor sharing their storage) are made before returning. ``None`` (not known, e.g.
        under a stock Lightning strategy): every copy is made before returning.

        ``charge(seconds)``: called (in the waiting thread) with every wait of the loop for this save after this call
        returned (see the module docstring). ``settle()``: called once on the caller's thread when no such wait can
        come any more (:meth:`collect`, :meth:`wait`, :meth:`close`).

        Collective: call on all ranks when ``distributed`` (the first call creates the gloo group).

        A failure while planning or staging (on any rank) is reported like one of the background write: by the next
        :meth:`wait` on every rank.
        """
        if self._inflight is not None:
            raise RuntimeError("A background save is still in flight: call wait() before starting another.")
        if volatile is not None and self.defer and _GATE.bypassed():  # an optimizer's steps would not wait
            volatile = None  # so everything is copied at the call
        group = None
        if distributed:
            if self._group is None:
                self._group = own_group(backend="gloo")  # destroyed at exit (engine.dist)
            group = self._group
        inflight = InFlight(location, rank, commit, abandon)
        if charge is not None:
            inflight.charge = charge
        inflight.settle = settle
        inflight.learn = self._at_call.update
        inflight.live = live = self.defer and volatile is not None and self._choose_live(writer)
        if live and self._timings is not None and self._timings[0] > self._timings[1]:
            inflight.hurry_after = 0.75 * self._timings[1]  # the write will likely outlast the window: copy early
        self.last_live = live
        self._inflight = inflight
        last_items = self._last_items
        if self.defer and volatile is not None and isinstance(planner, BalancedSavePlanner):
            flat, mappings = flatten(state_dict)
            if all(type(v) in _PLAIN for v in flat.values() if isinstance(v, torch.Tensor)):
                keys = frozenset(flat)
                if keys != self._last_keys:  # new keys (optimizer state after its first step): the plan changes,
                    last_items = []  # so steps wait until the whole plan is copied (nothing can be dropped)
                self._last_keys = keys
                stage = self._snapshot(flat, mappings, volatile, last_items, writer, planner, group, distributed, live)
                _GATE.hold(inflight.staged, inflight.add_step_wait, inflight.hurry if live else None)
                self._run(inflight, stage)
                return
        deferred: list[Deferred] = []
        try:
            prepared = saving.prepare(state_dict, writer=writer, planner=planner, group=group, distributed=distributed)
            self._last_items = prepared.plan.items
            self._last_keys = frozenset(getattr(planner, "state_dict", None) or ())
            error: BaseException | None = None
            try:
                defer = None
                if self.defer and volatile is not None:
                    at_call = self._at_call
                    now = {_storage(t) for t in volatile}

                    def defer(item: WriteItem, tensor: torch.Tensor) -> bool:
                        return item.index.fqn not in at_call and _storage(tensor) not in now

                staged, deferred = self.stager.stage_items(
                    prepared.plan.items, planner.resolve_data, defer=defer, live=live
                )
                prepared.planner = _Staged(staged)
                self.last_deferred = [copy_.name for copy_ in deferred]
            except Exception as err:  # e.g. out of memory: no rank may start writing, or the others would wait
                error = err
            saving.agree(error, group=group, distributed=distributed)
        except saving.RankFailure as failure:  # raised on every rank alike: reported at the next call, as a write's
            inflight.fail(failure)
            return
        if deferred:
            _GATE.hold(inflight.staged, inflight.add_step_wait, inflight.hurry if live else None)

        def stage_now(release: Callable[[], None]) -> tuple[saving.PreparedSave, BaseException | None, Any]:
            if live and deferred:
                return self._live_write(prepared, staged, deferred, release)
            try:
                Stager.finish(deferred)
            except Exception as err:
                return prepared, err, None
            return prepared, None, None

        self._run(inflight, stage_now)

    def _snapshot(
        self,
        flat: dict[str, Any],
        mappings: dict[str, tuple],
        volatile: Iterable[torch.Tensor],
        last_items: list[WriteItem],
        writer: StorageWriter,
        planner: BalancedSavePlanner,
        group: dist.ProcessGroup | None,
        distributed: bool,
        live: bool,
    ) -> Stage:
        """Copy what may change before the next optimizer step now; return what the background thread runs first.

        The volatile tensors, those learned to change outside optimizer steps, GPU tensors and mutable non-tensor
        leaves are copied here (the CPU tensors in one batched copy); every other tensor stays live, its version
        counter recorded now. The background thread first copies the live tensors of ``last_items`` (what this rank
        wrote last time, almost always what it writes now; empty when the state's keys changed since, and then
        steps wait for every copy) and lets optimizer steps go on, then plans the save
        (collective over the save's own group), copies the live tensors of its plan not copied yet and checks every
        version: a tensor changed after this call and before its copy drops the save. ``live``: nothing is copied
        in the background; the thread plans, writes the live tensors as they are and then checks their versions,
        while steps wait.
        """
        at_call = self._at_call
        now = {_storage(t) for t in volatile}
        error: BaseException | None = None
        try:
            snapshot, versions = self.stager.snapshot(
                flat, defer=lambda key, tensor: key not in at_call and _storage(tensor) not in now
            )
        except Exception as err:  # e.g. out of memory: planned anyway, then every rank fails the write with it
            snapshot, versions, error = flat, {}, err
        planner.use_flat(snapshot, mappings)
        self.last_deferred = list(versions)
        streams = self.stager.stream_copies if error is None else None  # queued GPU copies (stream_copies)
        if streams is not None:
            _GATE.hold_stream(streams)

        def stage(release: Callable[[], None]) -> tuple[saving.PreparedSave, BaseException | None, Any]:
            try:
                return stage_cpu(release)
            finally:
                if streams is not None:  # also when planning failed: the gate never keeps a dead save's copies
                    streams.wait()
                    _GATE.release_stream(streams)

        def stage_cpu(release: Callable[[], None]) -> tuple[saving.PreparedSave, BaseException | None, Any]:
            made: list[Deferred] = []
            if error is None and not live:
                try:
                    if last_items:
                        _, early = self.stager.stage_deferred(last_items, lambda i: _live(snapshot, i), versions)
                        made = Stager.copy(early, check=True)
                except Exception:  # e.g. out of memory: made again below, where a failure counts
                    made = []
                if made:
                    release()  # optimizer steps go on while the save is planned
            prepared = saving.prepare(snapshot, writer=writer, planner=planner, group=group, distributed=distributed)
            self._last_items = prepared.plan.items
            if error is not None:
                return prepared, error, None
            if streams is not None:
                streams.wait()  # the GPU copies land before the writer reads their buffers
                if streams.changed:  # changed before the first step, maybe under its copy: dropped, as on CPU
                    return prepared, StagingRaceError(streams.changed), None
            try:
                staged, deferred = self.stager.stage_deferred(
                    prepared.plan.items, planner.resolve_data, versions, live=live
                )
                if live and deferred:
                    return self._live_write(prepared, staged, deferred, release)
                prepared.planner = _Staged(staged)
                Stager.finish(deferred, made=made, held=not made)
            except Exception as err:
                return prepared, err, None
            return prepared, None, None

        return stage

    def _live_write(
        self, prepared: saving.PreparedSave, staged: Any, deferred: Any, release: Callable[[], None]
    ) -> tuple[saving.PreparedSave, None, LiveWrite]:
        """``prepared`` written by a :class:`LiveWrite`: the writer copies the ``deferred`` live tensors itself."""
        prepared.planner = live_write = LiveWrite(
            staged,
            deferred,
            stager=self.stager,
            release=release,
            rate=self._write_rate,
            patient=self.steps_wait_for_writer,
        )
        return prepared, None, live_write

    def _choose_live(self, writer: StorageWriter) -> bool:
        """Whether this save writes its deferred tensors live: local files only, then by :attr:`live`."""
        if self.live is False or not getattr(writer, "local_files", False):
            return False
        return True if self.live else self._live_next

    def _learn(self, inflight: InFlight) -> None:
        """Choose the next save's mode from this one's timings (adaptive :attr:`live` only).

        A live write is worth it while the writer is done by the time the first step after the call needs the
        tensors, or nearly: otherwise that step copies the rest (:meth:`LiveWrite.hurry`) and also waits for the
        records being written at that moment, which staging copies avoid. So a live save whose steps waited more
        than 5% of its write time is followed by a staged one, and a staged save whose write would have been done
        before the first step after it by a live one. Unknown (no step between two saves, a failed save):
        unchanged.
        """
        ready = inflight.ready_time()
        if inflight.step_at is None or inflight.called_at is None or ready is None or inflight.error is not None:
            return
        window = inflight.step_at - inflight.called_at
        self._timings = (ready, window)
        if inflight.live_write is not None and inflight.live_write.rate is not None:
            self._write_rate = inflight.live_write.rate
        self._live_next = inflight.step_wait <= 0.05 * ready if inflight.live else ready <= window

    @staticmethod
    def _run(inflight: InFlight, stage: Stage) -> None:
        _GATE.watch(inflight.saw_step)
        inflight.called_at = time.perf_counter()
        # A daemon thread, so that a process that fails (an exception out of the training loop) is not held by a save
        # that may never end; every ordinary exit joins it first (close, finish_at_exit).
        inflight.thread = thread = threading.Thread(target=inflight.run, args=(stage,), name="lightning_dcp-save")
        thread.daemon = True
        thread.start()

    def defer_removal(self, location: Location) -> bool:
        """Delete ``location`` once the save in flight has committed (rank 0). False when nothing is in flight."""
        return self._inflight is not None and self._inflight.defer_removal(location)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed on this rank's side.

        A save dropped because a tensor changed before its deferred copy was made is reported with a warning naming
        the tensors (never committed; the checkpoints before it are intact), not raised.

        Raises:
            CheckpointError: The background save failed (the message names the rank and the path); it was never
                committed, so the checkpoint it would have replaced is intact.
        """
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        if self._last is not None:  # nothing waits for an older save any more (its removals run on their own)
            self._last.settle_if_over(force=True)
        self._last = inflight
        inflight.finished.wait()
        _GATE.unwatch(inflight.saw_step)
        self.last_step_wait = inflight.step_wait
        self._learn(inflight)
        if inflight.dropped:
            names = ", ".join(repr(n) for n in inflight.dropped[:5])
            rank_zero_warn(
                f"lightning_dcp: the async save to {inflight.location.url!r} was dropped (not committed; earlier"
                f" checkpoints are intact): {names} changed in place after the save was called and before its"
                " background copy was made, "
                + (
                    "outside an optimizer step. These tensors are now copied when a save is called."
                    if inflight.dropped_outside_steps
                    else "by an optimizer step that ran before them because the save's plan had changed since the"
                    " previous save; the next save copies by the new plan."
                )
            )
        if inflight.error is not None:
            raise checkpoint_failure(
                inflight.error,
                f"The background save to {inflight.location.url!r} failed (seen on rank {inflight.rank})",
            ) from None

    def close(self) -> None:
        """Wait for the save in flight and the removals queued behind it, release the staging buffers.

        The time it waits counts as a wait of the loop for that save (its ``charge``), which is then settled.

        Raises like :meth:`wait`.
        """
        inflight = self._inflight or self._last
        started = time.perf_counter()
        try:
            self.wait()
        finally:
            last, self._last = self._last, None
            if last is not None:
                last.removed.wait()
                last.join()  # its thread ends before anything is torn down (see engine.shutdown)
            if inflight is not None:
                inflight.waited(time.perf_counter() - started)
                inflight.settle_if_over(force=True)
            self.stager.close()  # the gloo group stays for this plugin's next run: groups are created once

    @property
    def current(self) -> InFlight | None:
        """The save in flight (``None`` once :meth:`wait` collected it)."""
        return self._inflight

    def collect(self) -> None:
        """On the caller's thread: settle the saves that are finished (their ``settle`` runs once)."""
        for inflight in (self._last, self._inflight):
            if inflight is not None:
                inflight.settle_if_over()

    def finish_at_exit(self, deadline: float) -> None:
        """At exit: let the save in flight finish (until ``deadline``, ``time.monotonic()``) and end its thread.

        A save that finishes is committed as always (rank 0 logs that it waited and how long); one that fails is
        reported; one still running at ``deadline`` is left uncommitted with a loud error line naming it (earlier
        checkpoints are intact). Each rank alone (the save's own collectives run in its thread). See
        :mod:`lightning_dcp.engine.shutdown`.
        """
        inflight = self._inflight or self._last
        if inflight is None:
            return
        started = time.monotonic()
        pending = not inflight.finished.is_set()
        if not inflight.join(timeout=max(0.0, deadline - started)):
            log.error(
                "lightning_dcp: the background save to %r had not finished %.0f s after the process began to exit;"
                " it is NOT committed (earlier checkpoints are intact). Call the front end's wait (Fabric:"
                " `fabric.strategy.wait_for_save()`) before the script ends.",
                inflight.location.url,
                time.monotonic() - started,
            )
            return
        self._inflight = self._last = None
        inflight.settle_if_over(force=True)  # its summary line (rank 0), as a wait or the teardown would have logged it
        if inflight.error is not None:
            log.error(
                "lightning_dcp: the background save to %r failed on rank %d; it is NOT committed (earlier checkpoints"
                " are intact): %s",
                inflight.location.url,
                inflight.rank,
                inflight.error,
            )
        elif pending and inflight.rank == 0:
            log.warning(
                "lightning_dcp: the process began to exit with the background save to %r still being written; waited"
                " %.2f s for it, and it is committed.",
                inflight.location.url,
                time.monotonic() - started,
            )

    @staticmethod
    def wait_for_staging() -> None:
        """Block until the staging copies of the save in flight are made (not its write): the tensors may change.

        For a live write: until the writer is done with the live tensors (nothing is copied: waiting costs less
        than copying here). Front ends call it before code that may change weights outside an optimizer step
        (Lightning's validation, where weight-averaging callbacks swap weights in place; the end of training).
        """
        _GATE.wait_all(step=False)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _live(flat: dict[str, Any], item: WriteItem) -> torch.Tensor | None:
    """The live tensor (or row range of it) ``item`` of an earlier plan names in ``flat``; ``None`` if none fits."""
    tensor = flat.get(item.index.fqn)
    if not isinstance(tensor, torch.Tensor) or item.tensor_data is None:
        return None
    chunk = item.tensor_data.chunk
    if tuple(chunk.sizes) == tuple(tensor.shape):
        return tensor
    if tensor.dim() == 0 or tuple(chunk.sizes[1:]) != tuple(tensor.shape[1:]) or any(chunk.offsets[1:]):
        return None
    if chunk.offsets[0] + chunk.sizes[0] > tensor.shape[0]:
        return None
    return tensor.detach().narrow(0, chunk.offsets[0], chunk.sizes[0])


def _storage(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s storage (its own address when it starts there: no storage object made)."""
    return tensor.data_ptr() if tensor.storage_offset() == 0 else tensor.untyped_storage().data_ptr()
