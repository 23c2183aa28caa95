"""Resuming from S3 (SeaweedFS on loopback) through the Trainer vs a parallel ``get`` of the same files.

A ``world_size``-rank ``dcp_ddp`` run of a mix (:mod:`benchmarks.mixes`) saves one checkpoint to ``s3://``; then,
``repeats`` times after a warm-up, methods alternating:

- ``load``: a resume's restore from the ``s3://`` path (``strategy.load_checkpoint`` into the model and AdamW state,
  then ``load_model_state_dict`` / ``load_optimizer_state_dict``), as it runs by default: each record that every
  rank needs is read by one rank and broadcast to the others (``engine/load/shared_reads.py``);
- ``alone``: the same with every rank reading every byte itself, one stream per file (the default before shared
  reads: under DDP the state is replicated, so at 2 ranks it moves twice the bytes of one ``get``);
- ``get``: rank 0 downloads the checkpoint's files with s3fs' parallel ``get`` into a local directory (the network
  limit for those bytes from this server).

Also reported: each rank's peak RSS growth during ``load`` (the rounds bound what is held).

    python -m benchmarks.bench_remote --mix gpt2 --scale 0.5 --world-size 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

try:
    from benchmarks.bench_trainer import _barrier, _fitted, _max_over_ranks, _timed, summary
except ImportError:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.bench_trainer import _barrier, _fitted, _max_over_ranks, _timed, summary

METHODS = ("load", "alone", "get")


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _entry(rank: int, world_size: int, url: str, options: dict, mix: str, scale: float, repeats: int, out: str):
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import s3fs

    from lightning_dcp import DCPCheckpointIO
    from lightning_dcp.engine.load import dcp_reader

    trainer, _ = _fitted(world_size, mix, scale, plugins=[DCPCheckpointIO(storage_options=options, sync_files=False)])
    path = f"{url}/resume.ckpt"
    trainer.save_checkpoint(path)
    strategy = trainer.strategy
    fs = s3fs.S3FileSystem(**options)
    files = [f for f in fs.find(path.removeprefix("s3://"))]
    nbytes = sum(fs.size(f) for f in files)

    def restore() -> None:
        checkpoint = strategy.load_checkpoint(path)
        strategy.load_model_state_dict(checkpoint)
        strategy.load_optimizer_state_dict(checkpoint)

    runs: dict[str, list[float]] = {m: [] for m in METHODS}
    rss: list[float] = []
    local = tempfile.mkdtemp(prefix="bench_remote_get_")
    for round_ in range(repeats + 1):
        for method in METHODS:
            _barrier()
            if method == "get":
                _, seconds = _timed(lambda: fs.get(files, local + "/") if rank == 0 else None)
                shutil.rmtree(local, ignore_errors=True)
                os.makedirs(local, exist_ok=True)
            else:
                default = dcp_reader._FsspecReader.shares_reads
                dcp_reader._FsspecReader.shares_reads = method == "load"
                base = _peak_rss_mb()
                _reset_peak()
                _, seconds = _timed(restore)
                if method == "load" and round_ > 0:
                    rss.append(_max_over_ranks(_peak_rss_mb() - base))
                dcp_reader._FsspecReader.shares_reads = default
            if round_ > 0:
                runs[method].append(seconds)
    shutil.rmtree(local, ignore_errors=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes": nbytes, "files": len(files), "runs": runs, "rss_growth_mb": rss}, f)


def run(mix: str, *, world_size: int, repeats: int, scale: float, workdir: str) -> dict[str, Any]:
    """Start SeaweedFS in ``workdir``, run the ranks, stop it; medians and ratios."""
    from harness.ranks import spawn
    from harness.s3 import S3Server

    server = S3Server(workdir)
    server.start()
    try:
        url, options = f"s3://{server.new_bucket()}", server.storage_options()
        out = os.path.join(workdir, "result.json")
        spawn(_entry, world_size, url, options, mix, scale, repeats, out, timeout=3600.0, fresh=True)
        with open(out) as f:
            res = json.load(f)
    finally:
        server.stop()
    result: dict[str, Any] = {"mix": mix, "scale": scale, "world_size": world_size, "repeats": repeats, **res}
    result["runs"] = {m: summary(v) for m, v in res["runs"].items()}
    get, load = result["runs"]["get"]["median"], result["runs"]["load"]["median"]
    result["load_vs_get"] = get / load  # >= 1.0: the resume is at least as fast as a parallel get of the files
    result["load_MBps_per_rank"] = res["bytes"] / load / 1e6
    result["get_MBps"] = res["bytes"] / get / 1e6
    result["alone_vs_load"] = result["runs"]["alone"]["median"] / load
    return result


def markdown(result: dict[str, Any], command: str) -> list[str]:
    """One table of medians (seconds) and the ratios."""
    runs = result["runs"]
    cell = lambda m: f"{runs[m]['median']:.3f} ({runs[m]['min']:.3f}-{runs[m]['max']:.3f})"  # noqa: E731
    rss = max(result["rss_growth_mb"]) if result["rss_growth_mb"] else float("nan")
    return [
        "# Resuming from S3 (SeaweedFS on loopback)",
        "",
        f"Command: `{command}`. {result['mix']} x {result['scale']}, {result['bytes'] / 1e6:.0f} MB in"
        f" {result['files']} files, {result['world_size']} ranks (shared reads: each byte read by one rank).",
        "",
        "| resume, shared reads s | resume, every rank reads every byte s | parallel `get` s (rank 0) |"
        " get/resume | peak RSS growth per rank MB |",
        "|---|---|---|---|---|",
        f"| {cell('load')} | {cell('alone')} | {cell('get')} | {result['load_vs_get']:.2f} | {rss:.0f} |",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mix", default="gpt2")
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write REMOTE.md and remote.json into this directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_remote_") as workdir:
        start = time.perf_counter()
        result = run(args.mix, world_size=args.world_size, repeats=args.repeats, scale=args.scale, workdir=workdir)
        result["wall_s"] = time.perf_counter() - start
    print(json.dumps(result, indent=2))
    if args.out:
        command = "python -m benchmarks.bench_remote " + " ".join(argv if argv is not None else sys.argv[1:])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "remote.json"), "w") as f:
            json.dump({"command": command, **result}, f, indent=2)
        with open(os.path.join(args.out, "REMOTE.md"), "w") as f:
            f.write("\n".join(markdown(result, command)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
