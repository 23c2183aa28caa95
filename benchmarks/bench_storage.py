"""DCPCheckpointIO save/load throughput to a real S3 server (SeaweedFS) vs plain s3fs put/get of the same bytes.

``python benchmarks/bench_storage.py --size-mb 256`` prints one JSON object. Each measurement runs in a fresh
process so that its peak RSS (``VmHWM``, reset once the state is allocated) is its own. Goals: DCP throughput
>= 0.8x plain s3fs; peak client RSS during a save or load < 1.5x the shard.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _phase(phase: str, size_mb: int, url: str, options: dict, local: str) -> dict:
    import s3fs
    import torch

    from lightning_dcp import DCPCheckpointIO

    fs = s3fs.S3FileSystem(**options)
    io = DCPCheckpointIO(storage_options=options)
    n = size_mb * 2**20 // 4 // 4
    if phase in ("dcp_save", "put"):
        state = {f"t{i}": torch.randn(n) for i in range(4)}
        if phase == "put":
            with open(local, "wb") as f:
                for t in state.values():
                    f.write(t.numpy().tobytes())
    base = _rss_mb("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    if phase == "dcp_save":
        io.save_checkpoint({"state_dict": state}, url + "/dcp.ckpt")
    elif phase == "dcp_load":
        loaded = io.load_checkpoint(url + "/dcp.ckpt")
        assert len(loaded["state_dict"]) == 4
    elif phase == "put":
        fs.put_file(local, url.removeprefix("s3://") + "/plain.bin")
    elif phase == "get":
        fs.get_file(url.removeprefix("s3://") + "/plain.bin", local + ".back")
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "MBps": size_mb / seconds, "rss_base_mb": base, "rss_peak_mb": _rss_mb("VmHWM")}


def run(size_mb: int, workdir: str) -> dict:
    """Start SeaweedFS in ``workdir``, measure the four phases in fresh processes, stop it. Returns the numbers."""
    sys.path.insert(0, REPO)
    from harness.s3 import S3Server

    server = S3Server(workdir)
    server.start()
    try:
        url, options = f"s3://{server.new_bucket()}", server.storage_options()
        local = os.path.join(workdir, "plain.bin")
        out: dict = {"size_mb": size_mb}
        for phase in ("put", "get", "dcp_save", "dcp_load"):
            args = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--size-mb", str(size_mb)]
            args += ["--url", url, "--options", json.dumps(options), "--local", local]
            proc = subprocess.run(args, check=True, capture_output=True, text=True, cwd=REPO)
            out[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
        out["save_vs_put"] = out["dcp_save"]["MBps"] / out["put"]["MBps"]
        out["load_vs_get"] = out["dcp_load"]["MBps"] / out["get"]["MBps"]
        for phase in ("dcp_save", "dcp_load"):
            out[f"{phase}_peak_rss_over_shard"] = out[phase]["rss_peak_mb"] / size_mb
            out[f"{phase}_rss_growth_over_shard"] = (out[phase]["rss_peak_mb"] - out[phase]["rss_base_mb"]) / size_mb
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--options", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(_phase(args.phase, args.size_mb, args.url, json.loads(args.options), args.local)))
        return 0
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        print(json.dumps(run(args.size_mb, workdir), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
