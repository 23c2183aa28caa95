"""kill -9 campaign over tiered saves (``DCPCheckpointIO(local_dir=...)`` to S3 on a local SeaweedFS server).

A 2-rank DDP run (``tests/integration/_tier_kill_train.py``: an async save every epoch, ``save_top_k=-1``, a local
tier keeping 1 checkpoint) is started again and again and SIGKILLed (the whole process group) in one of three phases,
taken in turn: ``local_save`` (a local save under way), ``upload`` (an upload snapshot exists) or ``remote_commit``
(every file of the upload is on S3 with its full size, its ``.commit`` is not: verifying and committing). The phase
a kill actually hit is read back right after it. After each kill every checkpoint committed on either tier is
verified byte for byte, and remembered. A last run then trains to the end (every run resumes from "last") and waits
for its uploads.

Counts reported: ``unresumable`` (a restarted run that exited on its own with an error, or a final run that failed
or ended with weights other than an uninterrupted run's, bit for bit), ``lost`` (a checkpoint once committed on some
tier that is committed on no tier at the end: with ``save_top_k=-1`` nothing may go), ``corrupt`` (a committed
checkpoint that failed verification), ``resaved`` (a committed name saved again with another commit time: a resume
that skipped a newer checkpoint). Goal: all 0.

    python benchmarks/kill_tiered.py --kills 30 --seed 1          # ~6 min on 2 cores
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
PHASES = ("local_save", "upload", "remote_commit")


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

    def phase(self) -> str | None:
        names = self._local()
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
                return "remote_commit"
        if uploads:
            return "upload"
        for name in names:
            path = os.path.join(self.local_dir, name)
            if os.path.isdir(path) and (".tmp-" in name or not os.path.exists(os.path.join(path, ".commit"))):
                if not name.startswith(".upload-"):
                    return "local_save"
        return None

    def committed(self) -> dict[tuple[str, str], float]:
        """``{(tier, name): committed_at}`` of every committed checkpoint of both tiers."""
        from lightning_dcp.engine.integrity import committed_checkpoints
        from lightning_dcp.engine.storage import Location

        found = {}
        for tier, directory in (("local", Location(self.local_dir)), ("remote", self.remote)):
            for committed_at, location in committed_checkpoints(directory):
                found[(tier, location.name)] = committed_at
        return found


def campaign(
    workdir: str, *, kills: int, seed: int, epochs: int = 30, server=None, compare: bool = True, log=print
) -> dict:
    """Run the campaign in ``workdir`` (on ``server``, a started ``tests._s3.S3Server``, or a new one). Returns counts.

    ``compare=False`` skips the uninterrupted reference run (and the bit-for-bit comparison of the final weights);
    a resume from an older checkpoint still shows as ``resaved``.
    """
    import torch

    sys.path.insert(0, REPO)
    from lightning_dcp import verify_checkpoint
    from lightning_dcp.engine.storage import Location
    from tests._s3 import S3Server

    own = server is None
    if own:
        server = S3Server(os.path.join(workdir, "seaweedfs"))
        server.start()
    options = server.storage_options()
    rng = random.Random(seed)
    counts = {"kills": 0, "unresumable": 0, "lost": 0, "corrupt": 0, "resaved": 0, "verified": 0}
    counts["phases"] = dict.fromkeys([*PHASES, "idle"], 0)
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
        ever: dict[str, float] = {}
        for k in range(kills):
            target, skip = PHASES[k % len(PHASES)], rng.randint(0, 2)  # kill at the 1st to 3rd time it is seen
            proc = _run(run_dir, epochs, remote_url, options)
            deadline, seen, previous = time.monotonic() + 120, 0, None
            while proc.poll() is None and time.monotonic() < deadline:
                phase = watch.phase()
                if phase == target and previous != target:
                    seen += 1
                    if seen > skip:
                        break
                previous = phase
                time.sleep(0.002)
            if proc.poll() is not None:  # ended before the kill: it must not have failed
                if proc.returncode != 0:
                    counts["unresumable"] += 1
                    log(f"kill {k}: run exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
                continue
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            hit = watch.phase() or "idle"
            counts["kills"] += 1
            counts["phases"][hit] += 1
            for (tier, name), committed_at in sorted(watch.committed().items()):
                url = os.path.join(watch.local_dir, name) if tier == "local" else f"{remote_url}/{name}"
                try:
                    verify_checkpoint(url, storage_options=None if tier == "local" else options)
                    counts["verified"] += 1
                except Exception as err:
                    counts["corrupt"] += 1
                    log(f"kill {k}: {url} committed but does not verify: {err}")
                if name in ever and ever[name] != committed_at:
                    counts["resaved"] += 1
                    log(f"kill {k}: {name} was committed at {ever[name]} and again at {committed_at}")
                ever[name] = committed_at
            log(f"kill {k}: aimed at {target}, hit {hit}; {len(ever)} checkpoints committed so far")
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
        at_end = watch.committed()
        remote_names = {name for tier, name in at_end if tier == "remote"}
        counts["lost"] = sum(1 for name in ever if name not in {n for _, n in at_end})
        counts["not_uploaded"] = sum(1 for name in ever if name not in remote_names)
        counts["checkpoints"] = len(ever)
        return counts
    finally:
        if own:
            server.stop()


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
    bad = counts["unresumable"] + counts["lost"] + counts["corrupt"] + counts["resaved"] + counts["not_uploaded"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
