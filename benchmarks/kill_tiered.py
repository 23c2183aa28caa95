"""kill -9 campaign over tiered saves (``DCPCheckpointIO(local_dir=...)`` to S3 on a local SeaweedFS server).

A 2-rank DDP run (``tests/integration/_tier_kill_train.py``: an async save every epoch, top-k pruning with
``save_top_k=2``, ``save_last="link"``, a local tier keeping 1 checkpoint) is started again and again and SIGKILLed (the
whole process group) in one of four phases, taken in turn: ``local_save`` (a local save under way), ``upload`` (an
upload snapshot exists), ``remote_commit`` (every file of the upload is on S3 with its full size, its ``.commit`` is
not: verifying and committing) or ``pending_removal`` (the tier's journal holds a removal not carried out yet). The
phases a kill actually hit are read back right after it. After each kill every checkpoint committed on either tier is
verified byte for byte, and the remote ``last.ckpt`` checked. A last run then trains to the end (every run resumes
from "last") and waits for its uploads.

Counts reported (all must be 0): ``unresumable`` (a restarted run that exited on its own with an error, or a final
run that failed or ended with weights other than an uninterrupted run's, bit for bit), ``corrupt`` (a committed
checkpoint that failed verification), ``resaved`` (a committed name saved again with another commit: a resume that
skipped a newer checkpoint), ``stale_pointers`` (a remote ``last.ckpt`` that designates a checkpoint the remote does not
hold committed, after any kill or at the end), ``resurrected`` (a checkpoint pruned from both tiers that came back),
``orphans`` (at the end, a committed checkpoint on either tier that top-k does not keep), ``not_uploaded`` (at the
end, a checkpoint top-k keeps that the remote does not hold committed), ``last_wrong`` (at the end, a remote
``last.ckpt`` that does not designate the newest checkpoint).

    python benchmarks/kill_tiered.py --kills 30 --seed 1 --epochs 60          # ~15 min on 2 cores
    python -m nox -s kill_tiered -- --kills 30 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("local_save", "upload", "remote_commit", "pending_removal")
FAILURES = (
    "unresumable",
    "corrupt",
    "resaved",
    "stale_pointers",
    "resurrected",
    "orphans",
    "not_uploaded",
    "last_wrong",
)


_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def _run(workdir: str, epochs: int, remote: str, options: dict) -> subprocess.Popen:
    args = [sys.executable, "-m", "tests.integration._tier_kill_train", workdir, str(epochs), remote]
    # A Trainer that ran in this process (pytest) left MASTER_PORT & co. behind, its store still listening there.
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    return subprocess.Popen(
        [*args, json.dumps(options)],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


class _Watch:
    """Reads the two tiers of one run directory (local path, remote ``Location``) as the campaign sees them."""

    def __init__(self, local_dir: str, remote) -> None:
        self.local_dir, self.remote = local_dir, remote

    def _local(self) -> list[str]:
        try:
            return os.listdir(self.local_dir)
        except FileNotFoundError:
            return []

    def phases(self) -> set[str]:
        """The phases of the run at this moment (several at once: an upload runs while a removal waits behind it)."""
        names, found = self._local(), set()
        uploads = [n for n in names if n.startswith(".upload-")]
        for name in uploads:  # every file on the remote store with its size, no .commit yet: verifying, committing
            ckpt = name[len(".upload-") : -13]  # ".upload-<name>-<12 hex token>"
            try:
                frozen = {
                    n: os.path.getsize(os.path.join(self.local_dir, name, n))
                    for n in os.listdir(os.path.join(self.local_dir, name))
                }
                files = self.remote.child(ckpt).sizes()
            except Exception:  # a snapshot removed or a prefix being written meanwhile: not the phase we look for
                continue
            frozen.pop(".commit", None)
            if frozen and ".commit" not in files and all(files.get(n) == size for n, size in frozen.items()):
                found.add("remote_commit")
        if uploads:
            found.add("upload")
        for name in names:
            path = os.path.join(self.local_dir, name)
            if os.path.isdir(path) and (".tmp-" in name or not os.path.exists(os.path.join(path, ".commit"))):
                if not name.startswith(".upload-"):
                    found.add("local_save")
        if self.pending_removals():
            found.add("pending_removal")
        return found

    def pending_removals(self) -> set[str]:
        """Names of the removals the tier's journal holds and has not carried out (read only: the file is left)."""
        intents, finished = {}, set()
        try:
            with open(os.path.join(self.local_dir, ".lightning_dcp-tier-journal"), "rb") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return set()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # the line being appended
            if record.get("op") == "remove":
                intents[record["seq"]] = record["name"]
            elif record.get("op") == "done":
                finished.add(record["seq"])
        return {name for seq, name in intents.items() if seq not in finished}

    def stale_pointer(self) -> str | None:
        """What is wrong with the remote ``last.ckpt``, or ``None`` (absent, or designating a committed checkpoint)."""
        pointer = self.remote.child("last.ckpt")
        if not pointer.exists():
            return None
        target = pointer.read_pointer()
        if target is None or not self.remote.child(target).is_committed():
            return f"last.ckpt designates {target!r}, which the remote store does not hold committed"
        return None

    def committed(self) -> dict[tuple[str, str], tuple]:
        """``{(tier, name): order key}`` of every committed checkpoint of both tiers."""
        from lightning_dcp.engine import Location, committed_checkpoints

        found = {}
        for tier, directory in (("local", Location(self.local_dir)), ("remote", self.remote)):
            for key, location in committed_checkpoints(directory):
                found[(tier, location.name)] = key
        return found


def campaign(
    workdir: str,
    *,
    kills: int,
    seed: int,
    epochs: int = 30,
    server=None,
    compare: bool = True,
    phases: tuple[str, ...] = PHASES,
    log=print,
) -> dict:
    """Run the campaign in ``workdir`` (on ``server``, a started ``tests._s3.S3Server``, or a new one). Returns counts.

    Kills aim at ``phases`` in turn. ``compare=False`` skips the uninterrupted reference run (and the bit-for-bit
    comparison of the final weights); a resume from an older checkpoint still shows as ``resaved``.
    """
    import torch

    sys.path.insert(0, REPO)
    from harness.s3 import S3Server
    from lightning_dcp.engine import Location

    own = server is None
    if own:
        server = S3Server(os.path.join(workdir, "seaweedfs"))
        server.start()
    options = server.storage_options()
    rng = random.Random(seed)
    counts = dict.fromkeys(("kills", "unresumable", "corrupt", "resaved", "stale_pointers", "resurrected"), 0)
    counts.update(verified=0, phases=dict.fromkeys([*PHASES, "idle"], 0))
    try:
        reference = None
        if compare:
            reference_dir = os.path.join(workdir, "reference")
            os.makedirs(reference_dir)
            proc = _run(reference_dir, epochs, f"s3://{server.new_bucket()}/run", options)
            _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"the uninterrupted reference run failed:\n{err.decode()[-3000:]}")
            reference = torch.load(os.path.join(reference_dir, "final.pt"), weights_only=True)

        run_dir = os.path.join(workdir, "run")
        os.makedirs(run_dir)
        remote_url = f"s3://{server.new_bucket()}/run"
        watch = _Watch(os.path.join(run_dir, "local"), Location(remote_url, storage_options=options))
        ever: dict[str, tuple] = {}  # name -> order key of every checkpoint seen committed
        pruned: set[str] = set()  # seen committed once, then on no tier
        for k in range(kills):
            # Kill at the 1st to 3rd time the phase begins, or after 0-0.5 s inside it (a phase can last long).
            target, skip, dwell = phases[k % len(phases)], rng.randint(0, 2), rng.uniform(0, 0.5)
            proc = _run(run_dir, epochs, remote_url, options)
            deadline, seen, since = time.monotonic() + 120, 0, None
            while proc.poll() is None and time.monotonic() < deadline:
                if target not in watch.phases():
                    since = None
                elif since is None:
                    since, seen = time.monotonic(), seen + 1
                if since is not None and (seen > skip or time.monotonic() - since > dwell):
                    break
                time.sleep(0.002)
            if proc.poll() is not None:  # ended before the kill: it must not have failed
                if proc.returncode != 0:
                    counts["unresumable"] += 1
                    log(f"kill {k}: run exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
                else:
                    log(f"kill {k}: the run ended before {target} was seen")
                continue
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            hit = watch.phases() or {"idle"}
            counts["kills"] += 1
            for phase in hit:
                counts["phases"][phase] += 1
            _check(watch, remote_url, options, counts, ever, pruned, log=lambda line, k=k: log(f"kill {k}: {line}"))
            log(f"kill {k}: aimed at {target}, hit {sorted(hit)}; {len(ever)} checkpoints committed so far")
        proc = _run(run_dir, epochs, remote_url, options)
        _, err = proc.communicate(timeout=600)
        final_path = os.path.join(run_dir, "final.pt")
        if proc.returncode != 0 or not os.path.exists(final_path):
            counts["unresumable"] += 1
            log(f"final run failed ({proc.returncode}):\n{err.decode()[-3000:]}")
        elif reference is not None:
            final = torch.load(final_path, weights_only=True)
            if final.keys() != reference.keys() or any(not torch.equal(final[k], reference[k]) for k in reference):
                counts["unresumable"] += 1
                log("final weights differ from the uninterrupted run")
        _check(watch, remote_url, options, counts, ever, pruned, log=lambda line: log(f"at the end: {line}"))
        counts.update(_final(watch, run_dir, log=log), checkpoints=len(ever), pruned=len(pruned))
        return counts
    finally:
        if own:
            server.stop()


def _check(watch: _Watch, remote_url: str, options: dict, counts: dict, ever: dict, pruned: set, *, log) -> None:
    """After a kill: verify every committed checkpoint, check the remote pointer, and what came back or changed."""
    from lightning_dcp import verify_checkpoint

    committed = watch.committed()
    for (tier, name), key in sorted(committed.items()):
        url = os.path.join(watch.local_dir, name) if tier == "local" else f"{remote_url}/{name}"
        try:
            verify_checkpoint(url, storage_options=None if tier == "local" else options)
            counts["verified"] += 1
        except Exception as err:
            counts["corrupt"] += 1
            log(f"{url} committed but does not verify: {err}")
        if name in pruned:
            counts["resurrected"] += 1
            log(f"{name} was pruned from both tiers and is committed again ({tier})")
            pruned.discard(name)
        if name in ever and ever[name] != key:
            counts["resaved"] += 1
            log(f"{name} was committed as {ever[name]} and again as {key}")
        ever[name] = key
    present = {name for _, name in committed}
    pruned.update(name for name in ever if name not in present)
    stale = watch.stale_pointer()
    if stale is not None:
        counts["stale_pointers"] += 1
        log(stale)


def _final(watch: _Watch, run_dir: str, *, log) -> dict:
    """At the end: both tiers hold exactly what top-k keeps (the remote all of it), ``last.ckpt`` the newest."""
    try:
        with open(os.path.join(run_dir, "expected.json")) as f:
            expected = json.load(f)
    except FileNotFoundError:
        return {"orphans": 0, "not_uploaded": 0, "last_wrong": 1}
    keep = set(expected["top_k"])
    committed = watch.committed()
    remote = {name for tier, name in committed if tier == "remote"}
    orphans = sorted((tier, name) for tier, name in committed if name not in keep)
    if orphans:
        log(f"at the end: committed beyond top-k: {orphans}")
    pointer = watch.remote.child("last.ckpt")
    last = pointer.read_pointer() if pointer.exists() else None
    if last != expected["last"]:
        log(f"at the end: last.ckpt designates {last!r}, not {expected['last']!r}")
    return {"orphans": len(orphans), "not_uploaded": len(keep - remote), "last_wrong": int(last != expected["last"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        counts = campaign(workdir, kills=args.kills, seed=args.seed, epochs=args.epochs)
    print(json.dumps({"kills": args.kills, "seed": args.seed, "epochs": args.epochs, **counts}, indent=2))
    return 1 if any(counts[key] for key in FAILURES) else 0


if __name__ == "__main__":
    raise SystemExit(main())
