"""The remote-fault pass: store outages while a Trainer saves to S3 through a local tier (``local_dir``).

Each trial is one training process (``tests/chaos/_outage_train.py``: top-k pruning with ``save_top_k=2``,
``save_last="link"``, a save every few steps) whose s3fs reaches SeaweedFS (on loopback) through a fault proxy
(``tests/_faults.py``, a real TCP proxy). While it trains, outages of random kind and duration are injected one after
the other, with a few seconds of service between them:

- ``stop``: SeaweedFS itself is stopped (SIGTERM, SIGKILL after 1 s) and started again on the same ports and data;
- ``freeze``: SeaweedFS stopped with SIGSTOP (the kernel still accepts connections, nothing answers), then SIGCONT:
  every request must give up within its timeout (``S3_TIMEOUTS``, issue 40) and be retried once the store is back;
- ``refuse``, ``reset``, ``error`` (HTTP 500 or 503 to every request), ``hang`` (accepted, never answered): the proxy's;
- besides the outages, one ``latency`` episode per trial (every answer 0.2-1 s late: a slow store, still serving).

Then the trial stops training (a stop file), the process tears down (its uploads finish) and the remote directory is
checked from a client that bypasses the proxy. Counts, all of which must be 0: ``crashed`` (the fit raised, or did not
end), ``lost`` (a checkpoint top-k keeps that the remote does not hold committed, verified and bit-equal to its local
copy; or a newest checkpoint whose weights differ from the final weights), ``extra`` (anything in the remote directory
beyond top-k and ``last.ckpt``), ``stale_pointers`` (a remote ``last.ckpt`` seen designating a checkpoint the remote
does not hold committed, polled during the trial and checked at its end), ``last_wrong`` (at the end, ``last.ckpt``
does not designate the newest checkpoint).

    python -m tests.chaos.remote --outages 20 --seed 1                 # ~25 min on 2 cores
    python -m nox -s chaos -- --skip-kills --skip-fuzz --remote-outages 20 --seed 1
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTAGES = ("stop", "freeze", "refuse", "reset", "error", "hang")
FAILURES = ("crashed", "lost", "extra", "stale_pointers", "last_wrong")
_OBSERVER = {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 10}


def run_remote_faults(
    *,
    workdir: str,
    outages: int,
    seed: int,
    per_trial: int = 5,
    shortest: float = 5.0,
    longest: float = 60.0,
    hidden: int = 512,
    every: int = 10,
    time_limit_s: float = 3600.0,
    log=print,
) -> dict:
    """Inject ``outages`` outages (``per_trial`` per training process) of ``shortest``-``longest`` s. Returns counts."""
    sys.path.insert(0, ROOT)
    from harness.s3 import S3Server
    from tests._faults import FaultProxy

    rng = random.Random(seed)
    os.makedirs(workdir, exist_ok=True)
    server = S3Server(os.path.join(workdir, "seaweedfs"))
    server.start()
    proxy = FaultProxy(server.ports["s3"]).start()
    bucket = server.new_bucket()
    summary = {"seed": seed, "outages": 0, "trials": [], **dict.fromkeys(FAILURES, 0)}
    started = time.monotonic()
    try:
        trial = 0
        while summary["outages"] < outages and time.monotonic() - started < time_limit_s:
            planned = [
                (rng.choice(OUTAGES), rng.uniform(shortest, longest))
                for _ in range(min(per_trial, outages - summary["outages"]))
            ]
            result = _trial(
                os.path.join(workdir, f"trial-{trial}"),
                f"s3://{bucket}/trial-{trial}",
                server,
                proxy,
                planned,
                rng,
                hidden=hidden,
                every=every,
                log=lambda line, t=trial: log(f"trial {t}: {line}"),
            )
            summary["trials"].append(result)
            summary["outages"] += sum(1 for o in result["faults"] if o["kind"] != "latency")
            for key in FAILURES:
                summary[key] += result[key]
            trial += 1
    finally:
        proxy.stop()
        server.stop()
    summary["seconds"] = round(time.monotonic() - started)
    seconds = [o["seconds"] for t in summary["trials"] for o in t["faults"] if o["kind"] != "latency"]
    summary["outage_seconds"] = {"min": min(seconds, default=0), "max": max(seconds, default=0)}
    summary["by_kind"] = {
        kind: sum(1 for t in summary["trials"] for o in t["faults"] if o["kind"] == kind)
        for kind in (*OUTAGES, "latency")
    }
    return summary


def _trial(trial_dir: str, remote_url: str, server, proxy, planned, rng, *, hidden: int, every: int, log) -> dict:
    from lightning_dcp.engine.storage.location import Location

    os.makedirs(trial_dir, exist_ok=True)
    through_proxy = server.storage_options()  # the training process: s3fs' own retries and timeouts
    through_proxy["client_kwargs"]["endpoint_url"] = proxy.endpoint
    options = {**server.storage_options(), "config_kwargs": _OBSERVER}  # directly, never through the proxy
    config = {
        "dir": trial_dir,
        "remote": remote_url,
        "options": through_proxy,
        "every": every,
        "hidden": hidden,
        "async_save": rng.random() < 0.5,
        "at_teardown": 120.0,
    }
    result = {"remote": remote_url, "async_save": config["async_save"], "faults": [], **dict.fromkeys(FAILURES, 0)}
    remote = Location(remote_url, storage_options=options)
    with open(os.path.join(trial_dir, "train.log"), "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.chaos._outage_train", json.dumps(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        if not _watch(proc, remote, result, until=lambda: _uploaded(remote), limit=300):
            raise RuntimeError(f"no checkpoint reached the remote store in 300 s; see {trial_dir}/train.log")
        faults = list(planned)
        faults.insert(rng.randrange(len(faults) + 1), ("latency", rng.uniform(5, 15)))
        for kind, seconds in faults:
            _watch(proc, remote, result, limit=rng.uniform(3, 8))  # the store serves for a while
            if proc.poll() is not None:
                break
            began = time.monotonic()
            _fault_on(kind, server, proxy, rng)
            _watch(proc, remote, result, limit=seconds)
            _fault_off(kind, server, proxy)
            result["faults"].append({"kind": kind, "seconds": round(time.monotonic() - began, 1)})
            log(f"{kind} for {result['faults'][-1]['seconds']} s")
        _watch(proc, remote, result, limit=5)
        open(os.path.join(trial_dir, "stop"), "w").close()
        _watch(proc, remote, result, until=lambda: proc.poll() is not None, limit=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    result.update(_check(trial_dir, remote, proc.returncode, log=log))
    for key in FAILURES:
        result[key] += result.pop(f"end_{key}", 0)
    log(json.dumps({k: v for k, v in result.items() if k != "faults"}))
    return result


def _fault_on(kind: str, server, proxy, rng) -> None:
    if kind == "stop":
        server.stop()
    elif kind == "freeze":
        os.killpg(server.proc.pid, signal.SIGSTOP)
    elif kind == "error":
        proxy.set("error", status=rng.choice((500, 503)))
    elif kind == "latency":
        proxy.set("pass", delay=rng.uniform(0.2, 1.0))
    else:
        proxy.set(kind)


def _fault_off(kind: str, server, proxy) -> None:
    if kind == "stop":
        server.start()  # same ports and data; waits until it stores objects
    elif kind == "freeze":
        os.killpg(server.proc.pid, signal.SIGCONT)
    proxy.set("pass")


def _uploaded(remote) -> bool:
    from lightning_dcp.engine.catalog.integrity import committed_checkpoints

    try:
        return bool(committed_checkpoints(remote))
    except Exception:
        return False


def _watch(proc, remote, result: dict, *, limit: float, until=None) -> bool:
    """Poll the remote ``last.ckpt`` for ``limit`` seconds (or until ``until()``); count stale pointers seen."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if until is not None and until():
            return True
        if proc.poll() is not None:
            return False
        if _stale(remote):
            result["stale_pointers"] += 1
        time.sleep(0.5)  # an observer's polling interval, not a wait for a save
    return until is None


def _stale(remote) -> bool:
    """Whether ``last.ckpt`` designates a checkpoint the remote does not hold committed (read twice: not moving)."""
    try:
        pointer = remote.child("last.ckpt")
        target = pointer.read_pointer() if pointer.exists() else None
        if target is None or remote.child(target).is_committed():
            return False
        return pointer.read_pointer() == target  # the pointer did not move meanwhile
    except Exception:  # the store is down (a `stop` outage): nothing to observe
        return False


def _check(trial_dir: str, remote, returncode: int | None, *, log) -> dict:
    import torch

    from lightning_dcp import DCPCheckpointIO, verify_checkpoint
    from lightning_dcp.engine.catalog.integrity import committed_checkpoints

    found = {"end_crashed": 0, "end_lost": 0, "end_extra": 0, "end_stale_pointers": 0, "end_last_wrong": 0}
    result_path = os.path.join(trial_dir, "result.json")
    if returncode != 0 or not os.path.exists(result_path):
        log(f"the fit crashed ({returncode}); see {trial_dir}/train.log")
        return {**found, "end_crashed": 1}
    with open(result_path) as f:
        expected = json.load(f)
    keep = set(expected["top_k"])
    committed = {loc.name for _, loc in committed_checkpoints(remote)}
    entries = {name for name, _ in remote.entries()}
    found["end_extra"] = len(entries - keep - {"last.ckpt"})
    for name in sorted(keep):
        local = os.path.join(trial_dir, "local", name)
        try:
            assert name in committed, "not committed remotely"
            verify_checkpoint(remote.child(name).url, storage_options=remote.storage_options)
            files = sorted(os.listdir(local))
            assert sorted(remote.child(name).sizes()) == files, "other files than the local copy"
            for file in files:
                with remote.child(name).open(file) as f, open(os.path.join(local, file), "rb") as g:
                    assert f.read() == g.read(), f"{file} differs from the local copy"
        except Exception as err:
            found["end_lost"] += 1
            log(f"{name}: {err}")
    pointer = remote.child("last.ckpt")
    last = pointer.read_pointer() if pointer.exists() else None
    found["end_last_wrong"] = int(last != expected["newest"])
    found["end_stale_pointers"] = int(last is not None and last not in committed)
    if last == expected["newest"] and last in committed:
        final = torch.load(os.path.join(trial_dir, "final.pt"), weights_only=True)
        loaded = DCPCheckpointIO(storage_options=remote.storage_options).load_checkpoint(remote.child(last).url)
        if any(not torch.equal(loaded["state_dict"][k], v) for k, v in final.items()):
            found["end_lost"] += 1
            log(f"{last}: its weights differ from the final weights")
    found.update(
        global_step=expected["global_step"],
        saves=expected["saves"],
        unreachable_warnings=expected["unreachable_warnings"],
        remote_entries=sorted(entries),
    )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.remote", description=__doc__)
    parser.add_argument("--outages", type=int, default=20)
    parser.add_argument("--per-trial", type=int, default=5)
    parser.add_argument("--shortest", type=float, default=5.0, help="shortest outage (s)")
    parser.add_argument("--longest", type=float, default=60.0, help="longest outage (s)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=3600.0)
    parser.add_argument("--workdir", default="outputs/chaos/remote")
    parser.add_argument("--out", default="outputs/chaos/remote.json")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"remote-fault pass, seed {seed}", flush=True)
    workdir = os.path.abspath(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    summary = run_remote_faults(
        workdir=workdir,
        outages=args.outages,
        seed=seed,
        per_trial=args.per_trial,
        shortest=args.shortest,
        longest=args.longest,
        time_limit_s=args.time_limit,
        log=lambda line: print(line, flush=True),
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(report(summary))
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(summary[key] for key in FAILURES) else 0


def report(summary: dict) -> str:
    """One line per count, for the campaign's printed summary."""
    return (
        f"remote faults (seed {summary['seed']}, {summary['seconds']} s): {summary['outages']} outages of"
        f" {summary['outage_seconds']['min']}-{summary['outage_seconds']['max']} s {summary['by_kind']} in"
        f" {len(summary['trials'])} trials; crashed {summary['crashed']}, lost {summary['lost']}, extra"
        f" {summary['extra']}, stale pointers {summary['stale_pointers']}, last wrong {summary['last_wrong']}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
