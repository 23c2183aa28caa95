"""``fit(ckpt_path="last")`` with many checkpoints kept beside ``last``: ours against stock Lightning, fresh processes.

A run that keeps every checkpoint (``ModelCheckpoint(save_top_k=-1, save_last=True)``) resumes with
``ckpt_path="last"``. Stock Lightning loads its ``last.ckpt`` file; ours ranks the directory's committed checkpoints
to find the newest of the run, then loads it. This measures what that ranking costs as the directory fills: for each
number of kept checkpoints, a fit saves them (1 rank, ``every_n_train_steps=1``), then each round starts a fresh
process per engine that resumes and stops at ``on_train_start``. Reported per engine and count: the window from
``fit`` to ``on_train_start`` (median, min, max over the rounds), and the step resumed (it must be the last one).

    python -m benchmarks.last_resume --mix conv --kept 1,20 --rounds 3 > benchmarks/results/last_resume.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.provenance import stamp

ENGINES = ("stock", "ours")


def _trainer(engine: str, dirpath: str, max_steps: int, callbacks: list[Any]) -> Any:
    from benchmarks.trainer_runs import make_trainer

    strategy = "dcp_ddp" if engine == "ours" else "ddp"
    return make_trainer(1, strategy=strategy, default_root_dir=dirpath, max_steps=max_steps, callbacks=callbacks)


def _checkpointing(dirpath: str, every: int) -> Any:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(dirpath=dirpath, filename="{step}", save_top_k=-1, save_last=True, every_n_train_steps=every)


def save(engine: str, mix: str, dirpath: str, kept: int) -> None:
    """Fit ``kept`` steps of ``mix``, saving every step into ``dirpath`` (``kept`` checkpoints plus ``last``)."""
    import lightning_dcp  # noqa: F401  (registers dcp_ddp)
    from benchmarks.mixes import make_module

    _trainer(engine, dirpath, kept, [_checkpointing(dirpath, 1)]).fit(make_module(mix))


def resume(engine: str, mix: str, dirpath: str) -> dict[str, Any]:
    """One resume with ``ckpt_path="last"``, stopped at ``on_train_start``: its window (s) and step."""
    import lightning.pytorch as pl

    import lightning_dcp  # noqa: F401
    from benchmarks.mixes import make_module

    class Stop(pl.Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.at = time.perf_counter()
            raise KeyboardInterrupt  # Lightning ends the fit gracefully

    stop = Stop()
    trainer = _trainer(engine, dirpath, 10**6, [_checkpointing(dirpath, 10**6), stop])
    module = make_module(mix)
    started = time.perf_counter()
    try:
        trainer.fit(module, ckpt_path="last")
    except (KeyboardInterrupt, SystemExit):
        pass
    return {"window_s": stop.at - started, "step": trainer.global_step}


def _child(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.last_resume", "--child", *args], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Save, then resume each engine in fresh processes, alternating; print JSON with commit, date, machine, command."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.last_resume", description=__doc__)
    parser.add_argument("--mix", default="conv")
    parser.add_argument("--kept", default="1,20", help="numbers of checkpoints kept beside `last`")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=4, metavar=("TASK", "ENGINE", "DIRPATH", "KEPT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        task, engine, dirpath, kept = args.child
        if task == "save":
            save(engine, args.mix, dirpath, int(kept))
            print(json.dumps({}))
        else:
            print(json.dumps(resume(engine, args.mix, dirpath)))
        return 0
    provenance = stamp(argv)
    rows = []
    root = tempfile.mkdtemp(prefix="lightning_dcp-last-")
    try:
        for kept in (int(k) for k in args.kept.split(",")):
            dirs = {engine: os.path.join(root, f"{engine}-{kept}") for engine in ENGINES}
            for engine, dirpath in dirs.items():
                _child("save", engine, dirpath, str(kept), "--mix", args.mix)
            windows: dict[str, list[dict[str, Any]]] = {engine: [] for engine in ENGINES}
            for _ in range(args.rounds):
                for engine, dirpath in dirs.items():
                    windows[engine].append(_child("resume", engine, dirpath, str(kept), "--mix", args.mix))
            for engine, got in windows.items():
                times = [g["window_s"] for g in got]
                rows.append(
                    {
                        "engine": engine,
                        "kept": kept,
                        "window_s": round(statistics.median(times), 4),
                        "min_s": round(min(times), 4),
                        "max_s": round(max(times), 4),
                        "steps": sorted({g["step"] for g in got}),
                    }
                )
            for dirpath in dirs.values():
                shutil.rmtree(dirpath, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({**provenance, "mix": args.mix, "rounds": args.rounds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
