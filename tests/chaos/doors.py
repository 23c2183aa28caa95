"""The doors passes of the campaign: wall clocks and path strings (issue 21).

- **Clock pass**: trials of chained runs of 2-node DDP (one process per node, started as a cluster launcher would),
  each node with its own wall clock through libfaketime: offsets of up to +-2 h between runs and between nodes, and a
  clock stepped back or forward while a run trains. Every run resumes with ``ckpt_path="last"``. A run only ever
  trains forward, so the newest checkpoint is the one with the largest step saved so far; a resume of anything else
  is ``resumed_older``. The restored state is also checked against the hash recorded when it was saved.
- **Path pass**: the hypothesis properties of ``tests/integration/test_path_door.py`` (save -> list -> "last" ->
  load -> remove agree, or the path is refused at once) with many examples per store (local, ``memory://``, S3).
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

from harness.ranks import free_port

OFFSETS_S = (-7200, -3600, -600, 0, 600, 3600, 7200)


def _faketime_env() -> dict[str, str]:
    import libfaketime

    _, env = libfaketime.get_reload_information()
    return {**env, "FAKETIME_NO_CACHE": "1"}


def _write_clock(path: str, offset_s: float) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{offset_s:+.0f}\n")
    os.replace(tmp, path)


def _read_records(directory: str, pattern: str) -> dict[str, dict]:
    found = {}
    for path in glob.glob(os.path.join(directory, "records", pattern)):
        with open(path) as f:
            found[os.path.basename(path)] = json.load(f)
    return found


def _launch(trial_dir: str, run: str, max_steps: int, callback: str, clocks: list[str], timeout: float) -> list[int]:
    port = free_port()
    config = json.dumps({"dir": trial_dir, "run": run, "max_steps": max_steps, "callback": callback, "resume": True})
    base = {**os.environ, **_faketime_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = []
    for rank, clock in enumerate(clocks):
        env = {**base, "RANK": str(rank), "NODE_RANK": str(rank), "LOCAL_RANK": "0", "FAKETIME_TIMESTAMP_FILE": clock}
        log = open(os.path.join(trial_dir, f"{run}-rank{rank}.log"), "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.chaos._clock_train", config], env=env, stdout=log, stderr=log
            )
        )
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def clock_pass(
    *, workdir: str, trials: int, runs_per_trial: int, seed: int, keep: bool = False, log=print
) -> dict[str, Any]:
    """Run the clock pass; returns counts of verdicts and every run's record (see the module docstring)."""
    rng = random.Random(seed)
    verdicts: Counter[str] = Counter()
    runs: list[dict] = []
    started = time.monotonic()
    for trial in range(trials):
        trial_dir = os.path.join(workdir, f"clock-{trial}")
        shutil.rmtree(trial_dir, ignore_errors=True)
        os.makedirs(trial_dir)
        clocks = [os.path.join(trial_dir, f"clock-node{n}") for n in range(2)]
        callback = rng.choice(["dcp", "lightning"])
        newest_step = 0
        for r in range(runs_per_trial):
            run = f"t{trial}r{r}"
            offsets = [rng.choice(OFFSETS_S) for _ in clocks]
            for clock, offset in zip(clocks, offsets, strict=True):
                _write_clock(clock, offset)
            step_to = [rng.choice(OFFSETS_S), rng.randrange(2), rng.uniform(1.0, 6.0)]  # offset, node, after (s)
            stepper = threading.Timer(step_to[2], _write_clock, (clocks[step_to[1]], step_to[0]))
            stepper.start()
            max_steps = newest_step + 2 * rng.randint(1, 3)
            codes = _launch(trial_dir, run, max_steps, callback, clocks, timeout=600)
            stepper.cancel()
            skew = _marker_skew(trial_dir)
            resumed = _read_records(trial_dir, f"resume-{run}-*.json")
            saves = _read_records(trial_dir, "save-*.json")
            verdict = _verdict(codes, resumed, saves, newest_step)
            verdicts[verdict] += 1
            runs.append(
                {
                    "run": run,
                    "callback": callback,
                    "offsets_s": offsets,
                    "stepped": step_to,
                    "expected": newest_step,
                    "commit_clock_skew_s": skew,
                    "resumed": [r.get("global_step") for r in resumed.values()],
                    "codes": codes,
                    "verdict": verdict,
                }
            )
            log(
                f"clock {run}: node clocks {offsets} s, then node {step_to[1]} -> {step_to[0]} s after"
                f" {step_to[2]:.1f} s (newest .commit written {skew:+.0f} s off the real clock); expected step"
                f" {newest_step}, resumed {runs[-1]['resumed']}: {verdict}"
            )
            if codes == [0, 0]:
                newest_step = max_steps
        if not keep:
            shutil.rmtree(trial_dir, ignore_errors=True)
    return {"runs": len(runs), "verdicts": dict(verdicts), "seconds": round(time.monotonic() - started), "log": runs}


def _marker_skew(trial_dir: str) -> float:
    """How far the clock that wrote the newest ``.commit`` was from the real clock (proof the offsets took hold)."""
    markers = glob.glob(os.path.join(trial_dir, "ckpts", "*", ".commit"))
    if not markers:
        return 0.0
    newest = max(markers, key=os.path.getmtime)
    with open(newest) as f:
        return json.load(f)["committed_at"] - os.path.getmtime(newest)


def _verdict(codes: list[int], resumed: dict[str, dict], saves: dict[str, dict], expected_step: int) -> str:
    if codes != [0, 0] or len(resumed) != 2:
        return "failed"
    steps = {r["global_step"] for r in resumed.values()}
    hashes = {r["hash"] for r in resumed.values()}
    if steps != {expected_step}:
        if expected_step and steps == {0}:
            return "started_fresh"
        return "resumed_older" if max(steps) < expected_step else "resumed_other"
    if expected_step == 0:
        return "ok"
    loaded = {json.dumps(r["loaded"], sort_keys=True) for r in resumed.values()}
    identity = json.loads(loaded.pop()) if len(loaded) == 1 else None
    saved = next(
        (s for s in saves.values() if identity and s["run"] == identity["run"] and s["step"] == expected_step), None
    )
    if saved is None or hashes != {saved["hash"]}:
        return "resumed_torn"
    return "ok"


def path_pass(*, examples: int, report: str) -> dict[str, Any]:
    """Run the path properties with ``examples`` examples per store; returns the counts per store and outcome."""
    env = {**os.environ, "LIGHTNING_DCP_PATH_EXAMPLES": str(examples), "LIGHTNING_DCP_PATH_REPORT": report}
    started = time.monotonic()
    code = subprocess.call(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/integration/test_path_door.py", "-k",
         "test_paths_"], env=env,
    )  # fmt: skip
    counts = {}
    if os.path.exists(report):
        with open(report) as f:
            counts = json.load(f)
    return {"pytest_exit_code": code, "examples_per_store": examples, "counts": counts,
            "seconds": round(time.monotonic() - started)}  # fmt: skip
