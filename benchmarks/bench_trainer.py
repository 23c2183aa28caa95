"""What users run: saves, fits with ``ModelCheckpoint`` and resume loads through a real Lightning ``Trainer``.

Each task spawns ``world_size`` real processes (gloo, ``strategy="dcp_ddp"`` on CPU) training one mix of
:mod:`benchmarks.mixes` with AdamW, and times, ``repeats`` times after one untimed warm-up, methods interleaved in
every round (A B C A B C ...) so that they see the same machine:

- ``save``: ``trainer.save_checkpoint(path)`` with ``DCPCheckpointIO()`` (``sync``); the same with
  ``DCPCheckpointIO(async_save=True)`` (``async``, deferred staging: ``stall`` is the time ``save_checkpoint``
  blocks, ``seconds`` the time until the checkpoint is committed) and with ``defer_staging=False`` (``plain``: every
  staging copy made in the call); and ``limit``:
  rank 0 writes the checkpoint's bytes (the sum of its files' sizes) into a fresh file sequentially in 64 MiB
  blocks and ``fsync``s (the disk's limit for those bytes, through the page cache).
- ``stock``: stock Lightning DDP (``strategy="ddp"``, ``TorchCheckpointIO``: rank 0 ``torch.save``s the whole
  checkpoint, without ``fsync``), a peer on the same state: raw DCP (``dcp``: ``dcp.save`` of
  ``get_state_dict(model, optimizer)``; ``dcp_async``: ``dcp.async_save``, ``stall`` its call) and ``limit`` again.
- ``fit``: ``trainer.fit`` for ``fit_steps`` steps with no checkpointing (``none``) and with a ``ModelCheckpoint``
  every ``every`` steps: sync (``sync``), async (``async``: the default, deferred staging) and async without
  deferred staging (``plain``); optionally with Lightning's ``EMAWeightAveraging`` callback in the run (``--ema``).
  ``limit``: the same fit while, at the same steps, a thread of each rank writes that rank's share of the state
  (parameters and optimizer state split across ranks by size, as a DDP save splits the replicated state) with
  ``O_DIRECT`` straight from the training tensors: no staging copy, no checksum, no file format and no consistency
  (optimizer steps do not wait, so the bytes may mix steps): a lower bound of what overlapping those bytes' write
  with training costs the fit, which no correct async save can beat on the machine. ``--fit-methods`` picks a subset.
  Reports the fit's wall time and, per save, ``stall`` (the time ``trainer.save_checkpoint`` blocked inside
  ``ModelCheckpoint``) and ``blocked`` (the stall plus the time the next optimizer step waited for the save's
  background staging copies). Async fits include the wait for the last save at teardown. ``added``: per round, a
  method's fit minus that round's fit without saves; ``added_over_sync``: per round, that over the sync fit's
  (issue 53's figure: what async saves add to the fit's wall time, over what sync saves add).
- ``load``: resumes as users see them (:mod:`benchmarks.bench_resume`): per round, ``Trainer.fit(model,
  ckpt_path=...)`` in fresh processes for our checkpoint (``load``) and for stock Lightning DDP's single ``.ckpt`` of
  the same state (``stock``), the same fits without a ``ckpt_path`` (``fresh``, ``stock_fresh``), each timed from the
  ``setup`` hook to ``on_train_start`` (and to the end of the first step, ``*_first``) with the checkpoints' files
  dropped from the page cache, and a cold sequential read of our checkpoint's bytes (``read``). ``paired``: each
  round's ``read`` over its ``load``; ``stock_paired``: each round's ``stock`` over its ``load``; ``added``: each
  round's ``load`` minus its ``fresh``, both without the interpreter's full collections inside them (``*_gc``; a
  fresh process owes one either way, see ``bench_resume``): what the resume itself adds to a fit's start;
  ``stock_added`` the same for stock; ``added_paired``: ``read`` over ``added``; ``stock_added_paired``:
  ``stock_added`` over ``added``; ``added_first``: ``load_first`` minus ``fresh_first`` (collections included, and
  the first step's noise); ``phases``: the parts of our restore (target, probe, plan, read, apply, gc), medians over
  the rounds. ``floor``: each round, :mod:`benchmarks.resume_floor`'s floor for the mix's bytes (every rank reading
  the weights' and the optimizer state's bytes cold into its own memory, the optimizer's fresh) and
  ``added_over_floor``: each round's ``added`` over it; ``stock_added_over_added``: each round's ratio, listed.

Times run from a barrier to the slowest rank's return. One JSON object per task on stdout:

    python -m benchmarks.bench_trainer --mix huge --world-size 2 --tasks save,stock,fit
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch

try:
    from benchmarks.bench_resume import run_rounds
    from benchmarks.bench_save import disk_write
    from benchmarks.mixes import MIXES, make_module
    from benchmarks.provenance import stamp
    from benchmarks.trainer_runs import (
        _barrier,
        _max_over_ranks,
        _remove,
        _timed,
        dir_bytes,
        make_trainer,
        spawn,
        summary,
    )
except ImportError:  # run as a script
    from bench_resume import run_rounds
    from bench_save import disk_write
    from mixes import MIXES, make_module
    from provenance import stamp
    from trainer_runs import (
        _barrier,
        _max_over_ranks,
        _remove,
        _timed,
        dir_bytes,
        make_trainer,
        spawn,
        summary,
    )

TASKS = ("save", "stock", "fit", "load")
FIT_METHODS = ("none", "sync", "async", "plain", "limit")
ASYNC_CHOICES = ("adaptive", "live", "live-copy", "staged")
"""``--async-choice``: how the ``async`` fit's saves treat the tensors they defer. ``adaptive``: the default (live
writes or staging copies, chosen save by save); ``live``: live writes always; ``live-copy``: live writes always, a step
that finds one unfinished copying the rest and never waiting for the writer (what ``when_busy="skip"`` chooses);
``staged``: staging copies always. Set on the engine's private ``AsyncSaves`` (no public option: an experiment)."""
ASYNC = ("async", "plain")


def _timed_checkpoint_class():
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dcp import DCPModelCheckpoint

    class TimedCheckpoint(DCPModelCheckpoint):
        """``DCPModelCheckpoint`` that records how long each save blocked the training loop.

        ``stalls``: the save call; ``waits``: for async saves, how long the optimizer steps after each save waited
        for its background staging copies (known once the save completed: read at the next save and at the end).
        """

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.stalls: list[float] = []
            self.waits: list[float] = []

        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            start = time.perf_counter()
            ModelCheckpoint._save_checkpoint(self, trainer, filepath)
            self.stalls.append(time.perf_counter() - start)
            self._record_wait(trainer, len(self.stalls) - 1)

        def _record_wait(self, trainer: Any, saves: int) -> None:
            wait = getattr(trainer.strategy.checkpoint_io, "last_step_wait", None)
            if wait is not None and len(self.waits) < saves:
                self.waits.append(wait)

        def finish(self, trainer: Any) -> None:
            """After ``fit`` (teardown waited for the last save): its step wait."""
            self._record_wait(trainer, len(self.stalls))

    return TimedCheckpoint


def _as_in_a_fresh_process() -> None:
    """Forget what earlier runs in this process planned and parsed: each fit pays its first save's planning."""
    from lightning_dcp.engine.catalog import metadata
    from lightning_dcp.engine.save import memo

    memo.forget_all()
    metadata._PARSED.clear()


# ---------------------------------------------------------------------------------------------- tasks
def _fitted(world_size: int, mix: str, scale: float, *, strategy: str = "dcp_ddp", plugins=()):
    """A Trainer after one training step (AdamW state exists) and its module."""
    module = make_module(mix, scale=scale)
    trainer = make_trainer(world_size, strategy=strategy, max_steps=1, plugins=list(plugins))
    trainer.fit(module)
    return trainer, module


def task_save(rank: int, world_size: int, workdir: str, mix: str, scale: float, repeats: int) -> dict:
    from lightning_dcp import DCPCheckpointIO

    ios = {
        "sync": DCPCheckpointIO(),
        "async": DCPCheckpointIO(async_save=True),  # deferred staging: the default
        "plain": DCPCheckpointIO(async_save=True, defer_staging=False),
    }
    trainer, _ = _fitted(world_size, mix, scale, plugins=[ios["sync"]])
    runs: dict[str, dict[str, list[float]]] = {m: {"seconds": [], "stall": []} for m in (*ios, "limit")}
    nbytes = 0
    for round_ in range(repeats + 1):
        for method in (*ios, "limit"):
            path = os.path.join(workdir, f"{method}-{round_}.ckpt")
            if method == "limit":
                stall, seconds = _timed(lambda p=path, n=nbytes: disk_write(p, n) if rank == 0 else None)
            else:
                io = ios[method]
                trainer.strategy.checkpoint_io = io
                _barrier()
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                stall = _max_over_ranks(time.perf_counter() - start)
                io.wait(collective=True)
                seconds = _max_over_ranks(time.perf_counter() - start)
            if method == "sync" and round_ == 0:
                nbytes = dir_bytes(path) if rank == 0 else 0
                nbytes = int(_max_over_ranks(nbytes))
            if round_ > 0:  # round 0 is the warm-up
                runs[method]["seconds"].append(seconds)
                runs[method]["stall"].append(stall)
            _barrier()
            if rank == 0:
                _remove(path)
    for io in ios.values():
        io.teardown()
    return {"bytes": nbytes, "runs": runs}


def _dcp_state(trainer: Any) -> dict[str, Any]:
    """What a raw DCP user saves of the trained module: ``get_state_dict(model, optimizer)`` (FQN-keyed)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(trainer.lightning_module, trainer.optimizers[0])
    return {"model": model, "optimizer": optimizer}


def _dcp_async_save(state: dict[str, Any], path: str) -> float:
    """``dcp.async_save`` (a background thread; the default staging copies the state in the call); returns the call's
    seconds, after waiting for the save to finish."""
    import torch.distributed.checkpoint as dcp

    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=path)
    stall = time.perf_counter() - start
    future.result()
    return stall


def task_stock(rank: int, world_size: int, workdir: str, mix: str, scale: float, repeats: int) -> dict:
    """Stock Lightning DDP's save, a peer's (raw ``dcp.save`` and ``dcp.async_save`` of the same state) and the
    disk's limit, in turn."""
    import torch.distributed.checkpoint as dcp

    trainer, _ = _fitted(world_size, mix, scale, strategy="ddp")
    methods = ("stock", "dcp", "dcp_async", "limit")
    runs: dict[str, dict[str, list[float]]] = {m: {"seconds": [], "stall": []} for m in methods}
    nbytes = 0
    for round_ in range(repeats + 1):
        for method in methods:
            path = os.path.join(workdir, f"stock-{method}-{round_}.ckpt")
            if method == "dcp":
                stall, seconds = _timed(lambda p=path: dcp.save(_dcp_state(trainer), checkpoint_id=p))
            elif method == "dcp_async":
                calls: list[float] = []
                _, seconds = _timed(lambda p=path, c=calls: c.append(_dcp_async_save(_dcp_state(trainer), p)))
                stall = _max_over_ranks(calls[0])
            elif method == "stock":
                stall, seconds = _timed(lambda p=path: trainer.save_checkpoint(p))
                if round_ == 0:
                    nbytes = int(_max_over_ranks(dir_bytes(path) if rank == 0 else 0))
            else:
                stall, seconds = _timed(lambda p=path, n=nbytes: disk_write(p, n) if rank == 0 else None)
            if round_ > 0:
                runs[method]["seconds"].append(seconds)
                runs[method]["stall"].append(stall)
            _barrier()
            if rank == 0:
                _remove(path)
    return {"bytes": nbytes, "runs": runs}


def task_fit(
    rank: int,
    world_size: int,
    workdir: str,
    mix: str,
    scale: float,
    repeats: int,
    fit_steps: int,
    every: int,
    ema: bool = False,
    methods: tuple[str, ...] = FIT_METHODS,
    async_choice: str = "adaptive",
) -> dict:
    import gc

    from lightning_dcp import DCPCheckpointIO

    timed_checkpoint = _timed_checkpoint_class()
    runs: dict[str, dict[str, list]] = {m: {"seconds": [], "stalls": [], "waits": []} for m in methods}
    for round_ in range(repeats + 1):
        for method in methods:
            dirpath = os.path.join(workdir, f"fit-{method}-{round_}")
            if method == "limit":
                callbacks: list[Any] = [_overlapped_write_class()(dirpath, every)]
            elif method == "none":
                callbacks = []
            else:
                callbacks = [timed_checkpoint(dirpath=dirpath, every_n_train_steps=every)]
            if ema:
                from lightning.pytorch.callbacks import EMAWeightAveraging

                callbacks.append(EMAWeightAveraging(decay=0.99))
            trainer = make_trainer(
                world_size,
                max_steps=fit_steps,
                callbacks=callbacks,
                enable_checkpointing=method not in ("none", "limit"),
                plugins=[DCPCheckpointIO(async_save=method in ("async", "plain"), defer_staging=method == "async")],
            )
            if method == "async" and async_choice != "adaptive":
                saves = trainer.strategy.checkpoint_io.checkpointer._async
                saves.live = async_choice != "staged"
                saves.steps_wait_for_writer = async_choice != "live-copy"
            module = make_module(mix, scale=scale, steps=fit_steps)
            _as_in_a_fresh_process()  # a sync fit would otherwise reuse the plan of the previous round's sync fit
            _, seconds = _timed(functools.partial(trainer.fit, module))
            timed = callbacks[0] if method not in ("none", "limit") else None
            if timed is not None:
                timed.finish(trainer)
            stalls = [_max_over_ranks(s) for s in timed.stalls] if timed else []
            waits = [_max_over_ranks(w) for w in timed.waits] if timed else []
            if round_ > 0:
                runs[method]["seconds"].append(seconds)
                runs[method]["stalls"].append(stalls)
                runs[method]["waits"].append(waits)
            _barrier()
            if rank == 0:
                _remove(dirpath)
            del trainer, module, callbacks, timed
            gc.collect()
    return {"runs": runs, "fit_steps": fit_steps, "every": every, "ema": ema}


def _overlapped_write_class():
    """The ``limit`` fit's callback (module docstring): direct writes of the live tensors every ``every`` steps."""
    import threading

    from lightning.pytorch.callbacks import Callback

    class OverlappedWrite(Callback):
        def __init__(self, dirpath: str, every: int) -> None:
            self.dirpath, self.every = dirpath, every
            self.thread: threading.Thread | None = None
            self.stalls: list[float] = []
            self.waits: list[float] = []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step % self.every:
                return
            start = time.perf_counter()
            self.join()
            state = [p.detach() for p in trainer.lightning_module.parameters()]
            for optimizer in trainer.optimizers:
                state += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
            state.sort(key=lambda t: -t.numel() * t.element_size())
            mine = state[trainer.global_rank :: trainer.world_size]
            path = os.path.join(self.dirpath, f"{trainer.global_step}-{trainer.global_rank}.bin")
            os.makedirs(self.dirpath, exist_ok=True)
            self.thread = threading.Thread(target=_direct_write, args=(path, mine))
            self.thread.start()
            self.stalls.append(time.perf_counter() - start)

        def on_train_end(self, trainer: Any, *args: Any) -> None:
            self.join()

        def join(self) -> None:
            if self.thread is not None:
                self.thread.join()
                self.thread = None

    return OverlappedWrite


def _direct_write(path: str, tensors: list[torch.Tensor], piece: int = 16 << 20) -> None:
    """Write the page-aligned spans of ``tensors`` (up to 4 KiB of each one's head and tail left out) with
    ``O_DIRECT`` from their own memory, in ``piece``-byte calls; buffered where the filesystem refuses direct I/O."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd, direct = os.open(path, flags | os.O_DIRECT), True
    except (AttributeError, OSError):
        fd, direct = os.open(path, flags), False
    offset = 0
    try:
        for t in tensors:
            view = memoryview(t.numpy()).cast("B")
            head = (-t.data_ptr()) % 4096 if direct else 0
            end = head + (len(view) - head) // 4096 * 4096 if direct else len(view)
            for i in range(head, end, piece):
                offset += os.pwrite(fd, view[i : min(end, i + piece)], offset)
        if not direct:
            os.fsync(fd)
    finally:
        os.close(fd)


def task_prepare_load(rank: int, world_size: int, workdir: str, mix: str, scale: float) -> dict:
    """Write the checkpoints the ``load`` task resumes from (saved at this world size): ours and stock DDP's."""
    trainer, _ = _fitted(world_size, mix, scale)
    trainer.save_checkpoint(os.path.join(workdir, f"resume-ws{world_size}.ckpt"))
    del trainer
    stock, _ = _fitted(world_size, mix, scale, strategy="ddp")
    stock.save_checkpoint(os.path.join(workdir, f"stock-ws{world_size}.ckpt"))
    return {}


def run(
    mix: str,
    workdir: str,
    *,
    world_size: int = 2,
    repeats: int = 3,
    scale: float = 1.0,
    tasks: tuple[str, ...] = TASKS,
    fit_steps: int = 12,
    every: int = 3,
    load_world_sizes: tuple[int, ...] = (2, 1),
    ema: bool = False,
    fit_methods: tuple[str, ...] = FIT_METHODS,
    async_choice: str = "adaptive",
) -> dict:
    """Run ``tasks`` for one mix at one world size; returns medians (min-max) and ratios (see module docstring)."""
    common = {"mix": mix, "scale": scale}
    out: dict[str, Any] = {"mix": mix, "world_size": world_size, "repeats": repeats, "scale": scale}
    if "save" in tasks:
        res = spawn(task_save, world_size, os.path.join(workdir, "save"), repeats=repeats, **common)
        out["bytes"] = res["bytes"]
        out["save"] = {m: {k: summary(v) for k, v in r.items()} for m, r in res["runs"].items()}
    if "stock" in tasks:
        res = spawn(task_stock, world_size, os.path.join(workdir, "stock"), repeats=repeats, **common)
        out["stock_bytes"] = res["bytes"]
        out["stock"] = {m: {k: summary(v) for k, v in r.items()} for m, r in res["runs"].items()}
    if "fit" in tasks:
        res = spawn(
            task_fit,
            world_size,
            os.path.join(workdir, "fit"),
            repeats=repeats,
            fit_steps=fit_steps,
            every=every,
            ema=ema,
            methods=fit_methods,
            async_choice=async_choice,
            **common,
        )
        out["fit"] = {}
        none = res["runs"].get("none", {}).get("seconds")
        for m, r in res["runs"].items():
            if not r["stalls"][0]:
                out["fit"][m] = {"seconds": summary(r["seconds"]), "saves": 0}
                continue
            # The loop is blocked by a save for its call plus what the next optimizer step waited for its copies.
            blocked = [
                [s + (w[i] if i < len(w) else 0.0) for i, s in enumerate(st)]
                for st, w in zip(r["stalls"], r["waits"], strict=True)
            ]
            # A save at the last step has no next step: the wait for it at the end of training (the Trainer waits
            # for its staging before on_train_end, and teardown for its write) is reported apart from the loop's.
            at_end = fit_steps % every == 0
            in_loop = [run[:-1] if at_end else run for run in blocked]
            out["fit"][m] = {
                "seconds": summary(r["seconds"]),
                "stall": summary([s for run in r["stalls"] for s in run]),
                "blocked": summary([b for run in in_loop for b in run]),
                "blocked_total": summary([sum(run) for run in in_loop]),
                "blocked_each": blocked,  # per run, per save (seconds), the one at the end included
                "end_blocked": summary([run[-1] for run in blocked]) if at_end else None,
                "saves": len(r["stalls"][0]),
            }
        if none:
            for m, r in out["fit"].items():
                if m != "none":
                    runs = res["runs"][m]["seconds"]
                    r["added"] = summary([t - n for t, n in zip(runs, none, strict=True)])
                    r["added_each"] = [t - n for t, n in zip(runs, none, strict=True)]
            if "sync" in out["fit"]:
                sync = out["fit"]["sync"]["added_each"]
                for m, r in out["fit"].items():
                    if m not in ("none", "sync"):
                        r["added_over_sync"] = summary([a / s for a, s in zip(r["added_each"], sync, strict=True)])
        out["fit_steps"], out["every"], out["ema"] = fit_steps, every, ema
    if "load" in tasks:
        out["load"] = {}
        loaddir = os.path.join(workdir, "load")
        for saved in sorted(set(load_world_sizes)):
            spawn(task_prepare_load, saved, loaddir, **common)
        for saved in load_world_sizes:
            res = run_rounds(world_size, loaddir, saved=saved, repeats=repeats, **common)
            runs = res["runs"]
            phases = runs.pop("phases")
            out["load"][f"saved_ws{saved}"] = {
                "bytes": res["bytes"],
                "stock_bytes": res["stock_bytes"],
                "cold": res["cold"],
                **{m: summary(v) for m, v in runs.items()},
                "paired": summary([r / t for t, r in zip(runs["load"], runs["read"], strict=True)]),
                "stock_paired": summary([s / t for t, s in zip(runs["load"], runs["stock"], strict=True)]),
                **_added(runs),
                "phases": {p: summary([ph[p] for ph in phases]) for p in phases[0]} if phases else {},
                "rounds": runs,
            }
    return out


def _added(runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per round, what a resume adds to a fit's start (see ``bench_resume``), and the ratios the targets use."""

    def own(method: str) -> list[float]:  # the window without the full collections the process owes either way
        return [t - g for t, g in zip(runs[method], runs[f"{method}_gc"], strict=True)]

    added = [r - f for r, f in zip(own("load"), own("fresh"), strict=True)]
    stock_added = [r - f for r, f in zip(own("stock"), own("stock_fresh"), strict=True)]
    added_first = [r - f for r, f in zip(runs["load_first"], runs["fresh_first"], strict=True)]
    return {
        "added": summary(added),
        "stock_added": summary(stock_added),
        "added_first": summary(added_first),
        "added_paired": summary([r / a for r, a in zip(runs["read"], added, strict=True) if a > 0] or [float("inf")]),
        "stock_added_paired": summary([s / a for s, a in zip(stock_added, added, strict=True) if a > 0] or [0.0]),
        "added_over_floor": summary([a / f for a, f in zip(added, runs["floor"], strict=True)]),
        "stock_added_over_added": stock_added_each(added, stock_added),
    }


def stock_added_each(added: list[float], stock_added: list[float]) -> list[float]:
    """Each round's ``stock_added / added`` (issue 53's "in every round": the list, not a summary)."""
    return [s / a if a > 0 else float("inf") for s, a in zip(stock_added, added, strict=True)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mix", choices=MIXES, default="huge")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--fit-steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--ema", action="store_true", help="fit: with Lightning's EMAWeightAveraging callback")
    parser.add_argument("--fit-methods", default=",".join(FIT_METHODS), help="fit: which fits to run, each round")
    parser.add_argument("--async-choice", choices=ASYNC_CHOICES, default="adaptive", help="fit: see ASYNC_CHOICES")
    parser.add_argument("--load-world-sizes", default="2,1", help="world sizes the loaded checkpoints are saved at")
    parser.add_argument("--workdir", default=None, help="default: a temporary directory, removed afterwards")
    args = parser.parse_args(argv)
    stamped = stamp(argv)  # the code measured: at the start (files edited during the run do not count)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_trainer_", dir=os.path.abspath("."))
    try:
        result = run(
            args.mix,
            workdir,
            world_size=args.world_size,
            repeats=args.repeats,
            scale=args.scale,
            tasks=tuple(args.tasks.split(",")),
            fit_steps=args.fit_steps,
            every=args.every,
            load_world_sizes=tuple(int(n) for n in args.load_world_sizes.split(",")),
            ema=args.ema,
            fit_methods=tuple(args.fit_methods.split(",")),
            async_choice=args.async_choice,
        )
        print(json.dumps({**stamped, **result}, indent=2))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
