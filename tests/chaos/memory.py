"""The memory-tier pass of the chaos campaign: simulated nodes killed with ``kill -9``, memory areas wiped.

Each trial runs ``tests/integration/_memory_train.py`` on ``--nodes`` simulated nodes of 2 CPU ranks (each node its
own memory area under ``/dev/shm`` and its own process group of processes), kills it at a random moment, then resumes
with ``ckpt_path="last"`` and checks, from the resumed run's own record:

- ``whole_job``: every process killed; the resume must start at the newest checkpoint complete in the areas when the
  job died (0 lost committed memory checkpoints) with the state hashed at its save (0 torn states);
- ``node_loss``: one node's processes killed and its memory area wiped (the survivors are then killed, as a job
  restart does): the lost node's part can only come from the peers' replicas;
- ``resize``: a node loss as above, then the resume runs on one node fewer (another world size, from a replica).

In every kind the durable directory's checkpoints are moved away before the resume (the run's token stays:
:mod:`lightning_dcp.engine.tiers.runs`), so it can only come from the memory areas.
Kills land anywhere: during saves, replication and persistence, which run every few steps. The oracle is the areas
themselves: the newest checkpoint whose every part is committed on some surviving area
(:func:`lightning_dcp.engine.tiers.parts.complete`).

``python -m tests.chaos.memory --trials 20 --seed 1`` (``nox -s chaos_memory``); a slice runs in CI
(tests/integration/test_memory_tier.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from harness.ranks import free_port
from lightning_dcp.engine.tiers.parts import PartStore, complete
from lightning_dcp.engine.tiers.runs import RUN_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ("whole_job", "node_loss", "resize")


def start(workdir: str, areas: list[str], *, nodes: int, max_steps: int, hidden: int, sync: bool) -> list:
    """Start one process per node (each in its own process group, with its local ranks under it)."""
    port = free_port()
    procs = []
    for node in range(nodes):
        env = {**os.environ, "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.pop("LOCAL_RANK", None)
        cmd = [sys.executable, "-m", "tests.integration._memory_train", "--workdir", workdir, "--memory", areas[node]]
        cmd += ["--durable", os.path.join(workdir, "durable"), "--nodes", str(nodes), "--devices", "2"]
        cmd += ["--max-steps", str(max_steps), "--hidden", str(hidden), *(["--sync"] if sync else [])]
        out = open(os.path.join(workdir, f"node{node}.out"), "a")  # noqa: SIM115 (closed with the process)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True))
    return procs


def kill(proc: subprocess.Popen) -> None:
    """``kill -9`` of a node: its launcher process and the ranks it started (one process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def records(workdir: str, *, after: dict[str, int] | None = None) -> list[dict]:
    """Every rank's records (``log-{rank}.jsonl``), skipping the first ``after[file]`` lines of each file."""
    out = []
    for name in sorted(os.listdir(workdir)):
        if name.startswith("log-"):
            with open(os.path.join(workdir, name)) as f:
                lines = [line for line in f if line.strip()]
            out += [json.loads(line) for line in lines[(after or {}).get(name, 0) :]]
    return out


def line_counts(workdir: str) -> dict[str, int]:
    """How many records each rank's file holds now (what a later launch's records come after)."""
    counts = {}
    for name in os.listdir(workdir):
        if name.startswith("log-"):
            with open(os.path.join(workdir, name)) as f:
                counts[name] = sum(1 for line in f if line.strip())
    return counts


def newest_complete(areas: list[str]) -> tuple | None:
    """``(step, name)`` of the newest checkpoint whose every part is committed in one of ``areas``."""
    parts = [(i, part) for i, area in enumerate(areas) if os.path.isdir(area) for part in PartStore(area).parts()]
    found = complete(parts)
    if not found:
        return None
    key, name, _ = found[0]
    return key[1], name


def trial(workdir: str, kind: str, rng: random.Random, *, nodes: int = 2, hidden: int = 256, timeout: float = 180):
    """One kill and resume; returns its record (``lost`` and ``torn`` must stay 0)."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    areas = [f"/dev/shm/lightning_dcp-chaos-{os.getpid()}-{node}" for node in range(nodes)]
    started: list[subprocess.Popen] = []
    try:
        return _trial(workdir, kind, rng, areas, started, nodes=nodes, hidden=hidden, timeout=timeout)
    finally:  # nothing outlives a trial: no process, no memory area
        for proc in started:
            kill(proc)
        for area in areas:
            shutil.rmtree(area, ignore_errors=True)


def _trial(workdir, kind, rng, areas, started, *, nodes, hidden, timeout) -> dict:
    for area in areas:
        shutil.rmtree(area, ignore_errors=True)
    sync = rng.random() < 0.3
    procs = start(workdir, areas, nodes=nodes, max_steps=400, hidden=hidden, sync=sync)
    started += procs
    deadline = time.monotonic() + timeout
    want = rng.randint(3, 8)  # memory saves seen before the kill, then a random extra dwell
    while sum(r["event"] == "saved" for r in records(workdir)) < want * 2 * nodes and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 0.6))
    victims = procs if kind == "whole_job" else [procs[-1]]
    for proc in victims:
        kill(proc)
    if kind != "whole_job":
        shutil.rmtree(areas[-1], ignore_errors=True)  # the lost node's memory goes with it
        for proc in procs:
            kill(proc)  # the job restarts as a whole
    surviving = areas if kind == "whole_job" else areas[:-1]
    expected = newest_complete(surviving)
    saved = {r["step"]: r["hash"] for r in records(workdir) if r["event"] == "saved"}
    durable = os.path.join(workdir, "durable")
    if os.path.isdir(durable):  # the resume may only read the memory areas: every persisted checkpoint moved away,
        os.rename(durable, durable + ".hidden")  # the run's token kept (without it the areas are another run's)
        os.makedirs(durable)
        if os.path.exists(os.path.join(durable + ".hidden", RUN_FILE)):
            shutil.copyfile(os.path.join(durable + ".hidden", RUN_FILE), os.path.join(durable, RUN_FILE))
    before = line_counts(workdir)  # the resumed launch's records come after these, in each rank's file
    resume_nodes = nodes - 1 if kind == "resize" else nodes
    resume_areas = surviving if kind == "resize" else areas
    stop = (expected[0] if expected else 0) + 2
    procs = start(workdir, resume_areas, nodes=resume_nodes, max_steps=stop, hidden=hidden, sync=sync)
    started += procs
    codes = [p.wait(timeout=timeout) for p in procs]
    resumed = [r for r in records(workdir, after=before) if r["event"] == "resumed"]
    steps = {r["step"] for r in resumed}
    result = {"kind": kind, "sync": sync, "expected": expected, "resumed_steps": sorted(steps), "exit": codes}
    step = next(iter(steps)) if len(steps) == 1 else None
    result["lost"] = int(expected is not None and step != expected[0])
    result["torn"] = int(step is not None and step > 0 and any(r["hash"] != saved.get(step) for r in resumed))
    result["failed"] = int(any(codes) or len(resumed) != resume_nodes * 2)  # every rank of the launch resumed
    return result


def campaign(workdir: str, *, trials: int, seed: int, kinds: tuple[str, ...] = KINDS, nodes: int = 2) -> dict:
    rng = random.Random(seed)
    results = []
    for i in range(trials):
        kind = kinds[i % len(kinds)]
        result = trial(os.path.join(workdir, f"trial-{i}"), kind, rng, nodes=nodes)
        print(json.dumps(result), flush=True)
        results.append(result)
    summary = {k: sum(r[k] for r in results) for k in ("lost", "torn", "failed")}
    summary["trials"] = {k: sum(r["kind"] == k for r in results) for k in kinds}
    summary["results"] = results
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.memory", description=__doc__)
    parser.add_argument("--trials", type=int, default=42, help="trials, cycling through the kinds (default 42)")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--workdir", default="outputs/chaos/memory")
    parser.add_argument("--out", default="outputs/chaos/memory.json")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"memory-tier chaos seed {seed}", flush=True)
    summary = campaign(args.workdir, trials=args.trials, seed=seed, kinds=tuple(args.kinds), nodes=args.nodes)
    summary["seed"] = seed
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    return int(summary["lost"] or summary["torn"] or summary["failed"])


if __name__ == "__main__":
    raise SystemExit(main())
