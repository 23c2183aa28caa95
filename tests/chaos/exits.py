"""The exit campaign: many short real runs that end as users' scripts end, counting what a scheduler would see.

``python -m tests.chaos.exits`` (``nox -s exits``): ``--runs`` runs drawn round-robin from ``--cases``
(tests/chaos/_exit_run.py: Trainer and Fabric, single device, DDP, FSDP2, sync, async, the memory tier, 1 and 2
ranks, and stock Lightning as the baseline), each rank its own process started here (so that every rank's exit code
is seen), beside ``--hogs`` CPU-bound processes. For each run it records:

- ``nonzero``: ranks that exited with a status other than 0 after the run printed ``DONE`` (a successful run);
- ``terminate``: ranks whose output holds "terminate called" (the C++ runtime's abort at exit);
- ``final_lost``: the run's final checkpoint (``FINAL <path>``) not committed after the processes ended;
- ``unverified``: committed checkpoints of the run that fail ``verify`` (every byte against its checksums);
- ``failed``: runs that did not print ``DONE`` on every rank (the run itself failed: its output is kept).

The summary (per case and in all, with the seed and the command) goes to ``--out`` as JSON and is printed; the exit
status is 1 when any of ours counted anything (the stock baseline's counts are reported, never failed on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from typing import Any

from harness.ranks import free_port, port_env
from tests.chaos._exit_run import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNTS = ("runs", "failed", "nonzero", "terminate", "final_lost", "unverified")


def _hog() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_one(case: str, workdir: str, *, steps: int, every: int, timeout: float) -> dict[str, Any]:
    """One run of ``case`` in a fresh ``workdir``; its outcome (see the module docstring)."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    ranks = CASES[case]["ranks"]
    config = {"dir": workdir, "case": case, "world_size": ranks, "steps": steps, "every": every}
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = port_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank))
        env.update(WORLD_SIZE=str(ranks), NODE_RANK="0", PYTHONPATH=ROOT, PYTHONFAULTHANDLER="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.chaos._exit_run", json.dumps(config)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs, codes = [], []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
        outputs.append(out.decode(errors="replace"))
        codes.append(proc.returncode)
    done = [f"DONE {rank}" in output for rank, output in enumerate(outputs)]
    final = next((line.split(" ", 1)[1] for line in outputs[0].splitlines() if line.startswith("FINAL ")), None)
    outcome: dict[str, Any] = {"case": case, "codes": codes, "failed": not all(done)}
    outcome["nonzero"] = sum(1 for ok, code in zip(done, codes, strict=True) if ok and code != 0)
    outcome["terminate"] = sum("terminate called" in output for output in outputs)
    outcome["final_lost"], outcome["unverified"] = _check(case, final, os.path.join(workdir, "ckpts"))
    if outcome["failed"] or outcome["nonzero"] or outcome["terminate"] or outcome["final_lost"]:
        outcome["output"] = [output[-4000:] for output in outputs]
    return outcome


def _check(case: str, final: str | None, directory: str) -> tuple[int, int]:
    """``(final checkpoint lost, committed checkpoints that fail verify)`` of a run's checkpoint directory."""
    if CASES[case]["front"] == "stock":
        return (0 if final is not None and os.path.isfile(final) else 1), 0
    from lightning_dcp import CheckpointError, verify_checkpoint
    from lightning_dcp.engine.catalog.integrity import committed_checkpoints
    from lightning_dcp.engine.storage.location import Location

    committed = [location for _, location in committed_checkpoints(Location(directory))]
    lost = int(final is None or os.path.realpath(final) not in {os.path.realpath(c.path) for c in committed})
    unverified = 0
    for location in committed:
        try:
            verify_checkpoint(location.path)
        except CheckpointError:
            unverified += 1
    return lost, unverified


def campaign(
    *,
    cases: list[str],
    runs: int,
    hogs: int,
    seed: int,
    workdir: str,
    steps: int,
    every: int,
    timeout: float,
    log=print,
) -> dict[str, Any]:
    """Run the campaign; the summary (see the module docstring)."""
    rng = random.Random(seed)
    order = [cases[i % len(cases)] for i in range(runs)]
    rng.shuffle(order)
    totals = {case: dict.fromkeys(COUNTS, 0) for case in cases}
    problems: list[dict[str, Any]] = []
    hogs_running = [_hog() for _ in range(hogs)]
    started = time.monotonic()
    try:
        for i, case in enumerate(order):
            outcome = run_one(case, os.path.join(workdir, "run"), steps=steps, every=every, timeout=timeout)
            counts = totals[case]
            counts["runs"] += 1
            for key in COUNTS[1:]:
                counts[key] += int(outcome[key])
            if "output" in outcome:
                problems.append({"run": i, **outcome})
            log(
                f"run {i + 1}/{runs} {case}: exit codes {outcome['codes']}"
                + (" PROBLEM" if "output" in outcome else "")
            )
    finally:
        for hog in hogs_running:
            hog.kill()
            hog.wait()
    ours = [case for case in cases if CASES[case]["front"] != "stock"]
    return {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "commit": _commit(),
        "seed": seed,
        "hogs": hogs,
        "seconds": round(time.monotonic() - started, 1),
        "cases": totals,
        "ours": {key: sum(totals[case][key] for case in ours) for key in COUNTS},
        "stock": {key: sum(totals[case][key] for case in cases if case not in ours) for key in COUNTS},
        "problems": problems,
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.exits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=240, help="runs in all (default 240)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--hogs", type=int, default=1, help="CPU-bound processes beside the runs (default 1)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="a checkpoint every this many steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workdir", default="outputs/exits/work")
    parser.add_argument("--out", default="outputs/exits/summary.json")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"exit campaign seed {seed}", flush=True)
    summary = campaign(
        cases=args.cases,
        runs=args.runs,
        hogs=args.hogs,
        seed=seed,
        workdir=args.workdir,
        steps=args.steps,
        every=args.every,
        timeout=args.timeout,
        log=lambda line: print(line, flush=True),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{'case':28s} " + " ".join(f"{key:>10s}" for key in COUNTS))
    for case, counts in summary["cases"].items():
        print(f"{case:28s} " + " ".join(f"{counts[key]:10d}" for key in COUNTS))
    print(f"ours:  {summary['ours']}\nstock: {summary['stock']}\nsummary: {args.out}")
    bad = any(summary["ours"][key] for key in COUNTS[1:])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
