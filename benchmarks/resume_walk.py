"""The walk of one Trainer resume through the engine's rooms: which rooms and files it enters, and how often.

One process: a ``Trainer(strategy="dcp_ddp", devices=1)`` fit of a small model saves a checkpoint with
``ModelCheckpoint``; a second Trainer resumes it with ``fit(model, ckpt_path=...)`` while ``sys.setprofile`` watches
every Python call into ``lightning_dcp/engine``. A call *enters* a room (``engine/<package>`` or a top-level
``engine/<module>.py``) when its caller is outside that room. Reported per room: ``entries`` (calls that entered it),
``sites`` (distinct caller function -> callee function pairs among them) and ``files`` (its files the resume ran), and
the room order of the walk with repeats folded (``A B A`` stays, ``A A B`` is ``A B``).

The walk counts every visit, also a room's value objects used from above (a ``Location``'s property read by the
catalog is a visit to ``storage``). The call stack shows the layering instead: ``stack_runs`` gives, per room, the
most separate runs of its frames in any one call stack of the resume (frames outside the engine skipped). A room
below calling back up into a room above it (a callback, a method of the caller handed down) shows as 2 runs of
the upper room; a strictly layered path has 1 everywhere. ``stack_back`` names the call stacks (as room sequences,
each room with the function its run began in) where some room has more than one run. ``--saves`` traces a fit
that saves every step instead of a resume.

    python -m benchmarks.resume_walk > walk.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
from typing import Any

from benchmarks.provenance import stamp

ENGINE = os.sep + os.path.join("lightning_dcp", "engine") + os.sep


def room(filename: str) -> str | None:
    """``engine/<package>`` or ``engine/<module>.py`` of an engine file; ``None`` outside the engine."""
    at = filename.find(ENGINE)
    if at < 0:
        return None
    first = filename[at + len(ENGINE) :].split(os.sep)[0]
    return "engine/" + first


def trace(run: Any) -> dict[str, Any]:
    """Run ``run()`` under ``sys.setprofile`` and count the engine rooms its calls enter.

    The walk (entries, sites, visits) is this thread's; the call stacks are every thread's that runs Python while
    ``run`` does (``threading.setprofile``: the threads it starts), each thread's stack apart.
    """
    caller_thread = threading.get_ident()
    entries: collections.Counter[str] = collections.Counter()
    sites: dict[str, set] = collections.defaultdict(set)
    files: dict[str, set] = collections.defaultdict(set)
    walk: list[str] = []
    # per thread: the engine rooms of the frames on its call stack (innermost last, repeats folded, each with the
    # function its run began in), and how many frames of each run are on it
    stacks: dict[int, tuple[list[tuple[str, str]], list[int]]] = collections.defaultdict(lambda: ([], []))
    runs: collections.Counter[str] = collections.Counter()
    back: set[tuple[str, ...]] = set()

    def profile(frame: Any, event: str, _: Any) -> None:
        if event not in ("call", "return"):
            return
        callee = room(frame.f_code.co_filename)
        if callee is None:
            return
        thread = threading.get_ident()
        stack, depth = stacks[thread]
        if event == "return":
            if depth:
                depth[-1] -= 1
                if not depth[-1]:
                    depth.pop()
                    stack.pop()
            return
        if stack and stack[-1][0] == callee:
            depth[-1] += 1
        else:
            stack.append((callee, frame.f_code.co_name))
            depth.append(1)
            counts = collections.Counter(name for name, _ in stack)
            for name, n in counts.items():
                runs[name] = max(runs[name], n)
            if max(counts.values()) > 1:
                back.add(tuple(f"{name}({function})" for name, function in stack))
        if thread != caller_thread:
            return
        code = frame.f_code
        caller_frame = frame.f_back
        caller = room(caller_frame.f_code.co_filename) if caller_frame is not None else None
        files[callee].add(os.path.basename(code.co_filename))
        if caller == callee:
            return
        entries[callee] += 1
        where = (
            "outside" if caller_frame is None else f"{caller_frame.f_code.co_filename}:{caller_frame.f_code.co_name}"
        )
        sites[callee].add((where, f"{code.co_filename}:{code.co_name}"))
        if not walk or walk[-1] != callee:
            walk.append(callee)

    before, before_threads = sys.getprofile(), threading.getprofile()
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(before)
        threading.setprofile(before_threads)
    rooms = sorted(entries, key=lambda r: -entries[r])
    return {
        "rooms": {r: {"entries": entries[r], "sites": len(sites[r]), "files": sorted(files[r])} for r in rooms},
        "walk_length": len(walk),
        "walk_visits": dict(collections.Counter(walk).most_common()),
        "stack_runs": dict(runs.most_common()),
        "stack_back": sorted(" > ".join(s) for s in back),
    }


def traced_resume(directory: str, *, memory: bool = False, saves: bool = False) -> dict[str, Any]:
    """Save once under ``directory`` and trace one resume of it (see the module's text); the trace and the step.

    ``memory``: the save and the resume with a memory tier (``MemoryCheckpoint``, its area in ``directory``) beside
    ``DCPModelCheckpoint``, the resume with ``ckpt_path="last"`` (the newest across the tiers). ``saves``: instead,
    trace a fit of 3 steps from scratch that saves after every step (async, the default), into those tiers.
    """
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    from benchmarks.trainer_runs import make_trainer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

    def trainer(**kwargs: Any) -> Any:
        return make_trainer(1, default_root_dir=directory, **kwargs)

    torch.manual_seed(0)
    if saves:
        from lightning_dcp import DCPModelCheckpoint, MemoryCheckpoint

        every = [DCPModelCheckpoint(dirpath=os.path.join(directory, "run"), every_n_train_steps=1, save_top_k=-1)]
        if memory:
            every.append(MemoryCheckpoint(os.path.join(directory, "area"), every_n_train_steps=1))
        fit = trainer(max_steps=3, callbacks=every)
        result = trace(lambda: fit.fit(BoringModel()))
        result["resumed_step"] = fit.global_step
        return result
    if memory:
        from lightning_dcp import DCPModelCheckpoint, MemoryCheckpoint

        area, dirpath = os.path.join(directory, "area"), os.path.join(directory, "run")

        def callbacks() -> list:
            return [DCPModelCheckpoint(dirpath=dirpath), MemoryCheckpoint(area, every_n_train_steps=1)]

        trainer(max_steps=2, callbacks=callbacks()).fit(BoringModel())
        resumed = trainer(max_steps=2, callbacks=callbacks())  # the resume alone: no step, so no save, follows
        result = trace(lambda: resumed.fit(BoringModel(), ckpt_path="last"))
    else:
        trainer(max_steps=2, callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)]).fit(BoringModel())
        resumed = trainer(max_steps=3, enable_checkpointing=False)
        result = trace(lambda: resumed.fit(BoringModel(), ckpt_path=os.path.join(directory, "last.ckpt")))
    result["resumed_step"] = resumed.global_step
    return result


def main(argv: list[str] | None = None) -> int:
    """Save once, trace one resume, print the result as JSON with its commit, date, machine and command."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resume_walk", description=__doc__)
    parser.add_argument("--memory", action="store_true", help="with a memory tier, resuming ckpt_path='last'")
    parser.add_argument("--saves", action="store_true", help="trace a fit that saves every step, not a resume")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = traced_resume(tmp, memory=args.memory, saves=args.saves)
    print(json.dumps({**stamp(argv), **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
