"""The kill campaign: ``kill -9`` of 2-rank DDP training runs at random moments of sync and async saves.

A trial is one checkpoint directory and one setup drawn at random: stock ``strategy="ddp"`` with
``DCPCheckpointIO`` as a plugin or ``strategy="dcp_ddp"``; Lightning's ``ModelCheckpoint`` or
``DCPModelCheckpoint``; ``save_last="link"`` or a copy (``save_last=True``); always top-k pruning
(``save_top_k=2, monitor="step", mode="max"``) and a save every few steps. Within a trial, launches are chained: each
launch (sync or async saves, drawn per launch) resumes with ``ckpt_path="last"``, trains until a save is under way,
and is killed (the whole process group, SIGKILL) at a random moment of that save; the next launch's restore is
then checked against what was on disk at the kill:

- ``ok``: it resumed the newest committed checkpoint (by commit time), and the model and optimizer state of both
  ranks hash to what was saved at that step (recorded by the run before the save started);
- ``fresh_ok``: nothing was committed yet, and it started fresh;
- ``unresumable``: the resume failed or hung;
- ``started_fresh``: it started from step 0 while a committed checkpoint existed;
- ``resumed_uncommitted_or_torn``: what it restored is not a committed checkpoint, or its state differs from what was
  saved at that step (or between ranks);
- ``resumed_older``: a committed checkpoint older than the newest.

After every kill each committed checkpoint is also verified byte for byte (``verify_checkpoint``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import json
import os
import pickle
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning_dcp import verify_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAILURES = ("unresumable", "started_fresh", "resumed_uncommitted_or_torn", "resumed_older")
OUTCOMES = ("ok", "fresh_ok", *FAILURES)


@dataclasses.dataclass(frozen=True)
class Setup:
    strategy: str  # "ddp" (DCPCheckpointIO as a plugin) or "dcp_ddp"
    callback: str  # "lightning" (ModelCheckpoint) or "dcp" (DCPModelCheckpoint)
    save_last: str  # "link" or "copy"

    def __str__(self) -> str:
        return f"{self.strategy}/{self.callback}/{self.save_last}"


SETUPS = [Setup(s, c, last) for s in ("ddp", "dcp_ddp") for c in ("lightning", "dcp") for last in ("link", "copy")]


class Launch:
    """One training process (and the rank it starts), in its own process group."""

    def __init__(self, trial_dir: str, run: str, setup: Setup, *, async_save: bool, resume: bool, model: dict) -> None:
        self.run, self.trial_dir = run, trial_dir
        config = {
            "dir": trial_dir,
            "run": run,
            "strategy": setup.strategy,
            "callback": setup.callback,
            "save_last": setup.save_last,
            "async_save": async_save,
            "resume": resume,
            **model,
        }
        os.makedirs(os.path.join(trial_dir, "logs"), exist_ok=True)
        self.log_path = os.path.join(trial_dir, "logs", f"{run}.log")
        self.started = time.time()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos._train", json.dumps(config)],
                cwd=ROOT,
                start_new_session=True,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=120)
        time.sleep(0.05)  # rank 1 is in the same group; let the kernel reap it

    def tail(self, chars: int = 2500) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-chars:]


# ------------------------------------------------------------------------------------------- what is on disk
def read_records(trial_dir: str) -> tuple[dict, dict]:
    """``({(run, step): save record}, {(run, rank): resume record})`` written by the training processes."""
    saves, resumes = {}, {}
    directory = os.path.join(trial_dir, "records")
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith(".") or not name.endswith(".json"):
            continue
        with open(os.path.join(directory, name)) as f:
            record = json.load(f)
        if name.startswith("save-"):
            saves[(record["run"], record["step"])] = record
        else:
            resumes[(record["run"], record["rank"])] = record
    return saves, resumes


def identity(checkpoint: str) -> dict | None:
    """The ``chaos`` identity a run stored in a checkpoint, read without lightning_dcp (plain DCP files)."""
    with open(os.path.join(checkpoint, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # written by this campaign's own runs
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == "lightning")
    with open(os.path.join(checkpoint, info.relative_path), "rb") as f:
        f.seek(info.offset)
        record = f.read(info.length)
    blob = torch.load(io.BytesIO(record), weights_only=True)
    return torch.load(io.BytesIO(blob), weights_only=True).get("chaos")


def disk_state(ckpt_dir: str, since: float) -> dict[str, Any]:
    """Committed checkpoints (identity, commit time, verification) and saves in progress since ``since``."""
    committed, in_progress, corrupt = [], [], []
    for name in sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else ():
        path = os.path.join(ckpt_dir, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        marker = os.path.join(path, ".commit")
        if not os.path.isfile(marker):
            if os.path.getmtime(path) >= since - 1:
                in_progress.append(name)
            continue
        if name.startswith("."):
            continue  # a committed staging directory waiting to be renamed: not a checkpoint yet
        try:
            with open(marker) as f:
                recorded = json.load(f)
            order = recorded.get("order") or {}
            committed_at = (order.get("counter", 0), order.get("step") or -1, recorded["committed_at"])
            verify_checkpoint(path)
            ident = identity(path)
        except Exception as err:  # noqa: BLE001 - any failure to verify or read it back is what we report
            corrupt.append(f"{name}: {type(err).__name__}: {err}")
            continue
        committed.append({"name": name, "committed_at": committed_at, "mtime": os.path.getmtime(marker), **ident})
    newest = max(committed, key=lambda c: (c["committed_at"], c["name"]), default=None)
    return {"committed": committed, "newest": newest, "in_progress": in_progress, "corrupt": corrupt}


# ------------------------------------------------------------------------------------------------ verdicts
def verdict(state: dict, saves: dict, resumed: list[dict] | None) -> str:
    """Classify a resume (both ranks' resume records) against the disk state at the kill before it."""
    if resumed is None:
        return "unresumable"
    loaded = resumed[0]["loaded"]
    newest = state["newest"]
    if loaded is None:
        return "fresh_ok" if newest is None else "started_fresh"
    key = (loaded["run"], loaded["step"])
    saved = saves.get(key)
    committed = {(c["run"], c["step"]) for c in state["committed"]}
    exact = saved is not None and all(
        r["hash"] == saved["hash"] and r["global_step"] == loaded["step"] and r["loaded"] == loaded for r in resumed
    )
    if key not in committed or not exact:
        return "resumed_uncommitted_or_torn"
    if key != (newest["run"], newest["step"]):
        return "resumed_older"
    return "ok"


def _resumed(trial_dir: str, run: str) -> list[dict] | None:
    """Both ranks' resume records of ``run``, once both exist."""
    records = read_records(trial_dir)[1]
    both = [records.get((run, rank)) for rank in (0, 1)]
    return both if all(both) else None


def _nth_save(trial_dir: str, run: str, m: int) -> dict | None:
    """The save record of the ``m``-th save of ``run``, once it exists."""
    mine = sorted((r for (r_run, _), r in read_records(trial_dir)[0].items() if r_run == run), key=lambda r: r["step"])
    return mine[m - 1] if len(mine) >= m else None


def wait_for(condition: Callable[[], Any], *, launch: Launch, timeout: float, poll: float = 0.01) -> Any:
    """Poll ``condition`` until it returns something truthy; ``None`` if the launch exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if not launch.alive():
            return condition() or None
        time.sleep(poll)
    return None


# ------------------------------------------------------------------------------------------------ the campaign
def run_campaign(
    *,
    workdir: str,
    sync_kills: int,
    async_kills: int,
    kills_per_trial: int = 4,
    seed: int = 0,
    time_limit_s: float = 3600.0,
    width: int = 2048,
    layers: int = 3,
    every: int = 2,
    setups: list[Setup] | None = None,
    keep: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Kill and resume until ``sync_kills`` and ``async_kills`` kills were made (or ``time_limit_s`` ran out).

    Returns the summary (see :func:`summarize`); ``events`` holds every kill with its setup, delay, what was on disk
    and the verdict of the resume after it.
    """
    rng = random.Random(seed)
    setups = setups or SETUPS
    model = {"width": width, "layers": layers, "every": every}
    need = {"sync": sync_kills, "async": async_kills}
    done: collections.Counter = collections.Counter()
    spans: dict[str, list[float]] = {"sync": [], "async": []}
    events: list[dict[str, Any]] = []
    problems: list[dict[str, Any]] = []
    started = time.monotonic()
    log(f"kill campaign: seed {seed}, {sync_kills} sync + {async_kills} async kills, model {model}")
    trial = 0
    while any(done[m] < need[m] for m in need) and time.monotonic() - started < time_limit_s:
        trial += 1
        setup = rng.choice(setups)
        trial_dir = os.path.join(workdir, f"trial-{trial}")
        shutil.rmtree(trial_dir, ignore_errors=True)
        ckpt_dir = os.path.join(trial_dir, "ckpts")
        log(f"trial {trial}: {setup} (seed {seed})")
        previous: dict[str, Any] | None = None
        for k in range(kills_per_trial + 1):
            wanted = [m for m in need if done[m] < need[m]]
            last = k == kills_per_trial or not wanted or time.monotonic() - started > time_limit_s
            mode = rng.choice(wanted or ["sync", "async"])
            run = f"t{trial}l{k}"
            launch = Launch(trial_dir, run, setup, async_save=mode == "async", resume=k > 0, model=model)

            records = wait_for(functools.partial(_resumed, trial_dir, run), launch=launch, timeout=300)
            if previous is not None:
                previous["verdict"] = verdict(previous["state"], read_records(trial_dir)[0], records)
                log(f"  resume after kill {previous['kill']}: {previous['verdict']}")
                if previous["verdict"] in FAILURES:
                    problems.append({**_brief(previous), "log": launch.tail()})
            if records is None:
                problems.append(
                    {"trial": trial, "run": run, "problem": "launch never started training", "log": launch.tail()}
                )
                launch.kill()
                break
            if last:
                launch.kill()
                break
            # Kill at a random moment of the m-th save of this launch (mostly after a first commit: a kill before it
            # only checks that the run starts fresh).
            nothing_committed = previous is None or previous["state"]["newest"] is None
            m = rng.choice([1, 2, 2, 3] if nothing_committed else [1, 2])

            save = wait_for(functools.partial(_nth_save, trial_dir, run, m), launch=launch, timeout=300)
            if save is None:
                kind = "crashed" if not launch.alive() else "hung (no save in 300 s)"
                problems.append({"trial": trial, "run": run, "problem": kind, "log": launch.tail()})
                launch.kill()
                break
            window = 1.3 * (statistics.median(spans[mode][-10:]) if spans[mode] else 0.5)
            delay = rng.uniform(0, window) if rng.random() < 0.8 else rng.uniform(0, 2 * window)
            time.sleep(max(0.0, save["time"] + delay - time.time()))
            if not launch.alive():
                problems.append({"trial": trial, "run": run, "problem": "crashed", "log": launch.tail()})
                break
            launch.kill()
            saves = read_records(trial_dir)[0]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                state = disk_state(ckpt_dir, since=launch.started)
            latest = max((r for (r_run, _), r in saves.items() if r_run == run), key=lambda r: r["step"])
            in_flight = bool(state["in_progress"]) or not any(
                (c["run"], c["step"]) == (run, latest["step"]) for c in state["committed"]
            )
            for c in state["committed"]:  # how long saves took, from "save started" to their commit
                if c["run"] == run and (run, c["step"]) in saves:
                    spans[mode].append(c["mtime"] - saves[(run, c["step"])]["time"])
            done[mode] += 1
            previous = {
                "kill": sum(done.values()),
                "trial": trial,
                "run": run,
                "setup": str(setup),
                "mode": mode,
                "save_step": save["step"],
                "delay_s": round(delay, 3),
                "in_flight": in_flight,
                "state": state,
            }
            events.append(previous)
            if state["corrupt"]:
                problems.append({**_brief(previous), "problem": "committed checkpoint does not verify"})
            log(
                f"  kill {previous['kill']} ({mode}, step {save['step']} + {delay:.2f} s, "
                f"{'save in flight' if in_flight else 'between saves'}): committed "
                f"{[c['name'] for c in state['committed']]}, in progress {state['in_progress']}"
            )
        if not keep:
            shutil.rmtree(trial_dir, ignore_errors=True)
    return summarize(events, problems, seed=seed, model=model, seconds=time.monotonic() - started)


def _brief(event: dict[str, Any]) -> dict[str, Any]:
    state = event["state"]
    return {
        **{k: v for k, v in event.items() if k != "state"},
        "newest": state["newest"] and state["newest"]["name"],
        "committed": [c["name"] for c in state["committed"]],
        "in_progress": state["in_progress"],
        "corrupt": state["corrupt"],
    }


def summarize(events: list[dict], problems: list[dict], *, seed: int, model: dict, seconds: float) -> dict[str, Any]:
    """Counts per mode and per setup, the problems seen, and every kill (without its full disk state)."""
    table: dict[str, dict[str, int]] = {}
    for event in events:
        for key in (event["mode"], f"{event['mode']} {event['setup']}"):
            row = table.setdefault(key, {"kills": 0, "in_flight": 0, **{o: 0 for o in OUTCOMES}, "unchecked": 0})
            row["kills"] += 1
            row["in_flight"] += event["in_flight"]
            row[event.get("verdict", "unchecked")] += 1
    # a broken directory stays (Lightning's ModelCheckpoint never lists it again): count each one once
    corrupt = len({(e["trial"], entry.split(":", 1)[0]) for e in events for entry in e["state"]["corrupt"]})
    return {
        "seed": seed,
        "model": model,
        "checkpoint_mb": round(12 * model["layers"] * model["width"] ** 2 / 1e6, 1),
        "seconds": round(seconds),
        "kills": {m: sum(1 for e in events if e["mode"] == m) for m in ("sync", "async")},
        "failures": {f: sum(1 for e in events if e.get("verdict") == f) for f in FAILURES},
        "committed_but_not_verifying": corrupt,
        "table": table,
        "problems": problems,
        "events": [_brief(e) for e in events],
    }


def format_table(summary: dict[str, Any]) -> str:
    """The summary as a fixed-width table (one row per mode, then per mode and setup)."""
    columns = ["kills", "in_flight", *OUTCOMES, "unchecked"]
    lines = [f"{'':34}" + "".join(f"{c[:12]:>13}" for c in columns)]
    for key, row in sorted(summary["table"].items(), key=lambda kv: (" " in kv[0], kv[0])):
        lines.append(f"{key:34}" + "".join(f"{row[c]:>13}" for c in columns))
    return "\n".join(lines)
