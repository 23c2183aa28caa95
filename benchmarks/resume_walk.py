"""The walk of one Trainer resume through the engine's rooms: which rooms and files it enters, and how often.

One process: a ``Trainer(strategy="dcp_ddp", devices=1)`` fit of a small model saves a checkpoint with
``ModelCheckpoint``; a second Trainer resumes it with ``fit(model, ckpt_path=...)`` while ``sys.setprofile`` watches
every Python call into ``lightning_dcp/engine``. A call *enters* a room (``engine/<package>`` or a top-level
``engine/<module>.py``) when its caller is outside that room. Reported per room: ``entries`` (calls that entered it),
``sites`` (distinct caller function -> callee function pairs among them) and ``files`` (its files the resume ran), and
the room order of the walk with repeats folded (``A B A`` stays, ``A A B`` is ``A B``).

    python -m benchmarks.resume_walk > walk.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
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
    """Run ``run()`` under ``sys.setprofile`` and count the engine rooms its calls enter."""
    entries: collections.Counter[str] = collections.Counter()
    sites: dict[str, set] = collections.defaultdict(set)
    files: dict[str, set] = collections.defaultdict(set)
    walk: list[str] = []

    def profile(frame: Any, event: str, _: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        callee = room(code.co_filename)
        if callee is None:
            return
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

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    rooms = sorted(entries, key=lambda r: -entries[r])
    return {
        "rooms": {r: {"entries": entries[r], "sites": len(sites[r]), "files": sorted(files[r])} for r in rooms},
        "walk_length": len(walk),
        "walk_visits": dict(collections.Counter(walk).most_common()),
    }


def main(argv: list[str] | None = None) -> int:
    """Save once, trace one resume, print the result as JSON with its commit, date, machine and command."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resume_walk", description=__doc__)
    parser.parse_args(argv)
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lightning_dcp  # noqa: F401  (registers the dcp_* strategies)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory() as tmp:

        def trainer(**kwargs: Any) -> pl.Trainer:
            return pl.Trainer(
                strategy="dcp_ddp",
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                default_root_dir=tmp,
                **kwargs,
            )

        torch.manual_seed(0)
        trainer(max_steps=2, callbacks=[ModelCheckpoint(dirpath=tmp, save_last=True)]).fit(BoringModel())
        resumed = trainer(max_steps=3, enable_checkpointing=False)
        result = trace(lambda: resumed.fit(BoringModel(), ckpt_path=os.path.join(tmp, "last.ckpt")))
        result["resumed_step"] = resumed.global_step
    print(json.dumps({**stamp(argv), **result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
