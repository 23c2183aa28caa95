"""Tiered saves (``DCPCheckpointIO(local_dir=...)``) to S3 on a local SeaweedFS server, side by side with a local-only
save of the same checkpoint and a plain s3fs ``put`` of the same bytes.

``python benchmarks/bench_tiered.py --size-gb 0.25 --repeats 3`` prints one JSON object. Per repeat, in alternating
order: a local-only save and a tiered save (sync, then async), each time with the uploader idle; the training-loop
stall is ``last_save_seconds`` (the whole save when sync, staging when async). The upload time is the uploader's own
``Tiers.last_upload_seconds`` (snapshot, put, verification, remote commit); the plain ``put`` uploads the same
checkpoint directory with ``s3fs.S3FileSystem.put(recursive=True)``. Goals: tiered stall <= 1.2x local-only; upload
throughput >= 1.0x the plain put.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checkpoint(size_gb: float) -> dict:
    import torch

    n = int(size_gb * 1e9) // 4 // 4
    return {"state_dict": {f"layer{i}.weight": torch.randn(n) for i in range(4)}, "epoch": 0}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def run(size_gb: float, workdir: str, *, repeats: int = 3) -> dict:
    """Start SeaweedFS in ``workdir``, measure, stop it. Returns medians (seconds, GB/s) and the ratios."""
    sys.path.insert(0, REPO)
    import s3fs

    from harness.s3 import S3Server
    from lightning_dcp import DCPCheckpointIO

    server = S3Server(os.path.join(workdir, "seaweedfs"))
    server.start()
    try:
        bucket = server.new_bucket()
        options = server.storage_options()
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        checkpoint = _checkpoint(size_gb)
        size_bytes = sum(t.numel() * t.element_size() for t in checkpoint["state_dict"].values())
        rows: dict[str, list[float]] = {}
        for mode in ("sync", "async"):
            local_io = DCPCheckpointIO(async_save=mode == "async")
            tier_dir = os.path.join(workdir, f"tier-{mode}")
            tiered_io = DCPCheckpointIO(
                storage_options=options, local_dir=tier_dir, local_keep=1, async_save=mode == "async"
            )
            remote = f"s3://{bucket}/{mode}"
            for r in range(repeats):
                order = ("local", "tiered") if r % 2 == 0 else ("tiered", "local")
                for which in order:
                    if which == "local":
                        path = os.path.join(workdir, f"local-{mode}", f"r{r}.ckpt")
                        local_io.save_checkpoint(checkpoint, path)
                        rows.setdefault(f"{mode}_local_stall_s", []).append(local_io.last_save_seconds)
                        local_io.wait()
                        shutil.rmtree(os.path.dirname(path))
                        continue
                    tiered_io.save_checkpoint(checkpoint, f"{remote}/r{r}.ckpt")
                    rows.setdefault(f"{mode}_tiered_stall_s", []).append(tiered_io.last_save_seconds)
                    tiered_io.wait()
                    tiered_io.tiers.wait()
                    rows.setdefault(f"{mode}_upload_s", []).append(tiered_io.tiers.last_upload_seconds)
                    if mode == "sync":  # the plain put of the very same files
                        start = time.perf_counter()
                        fs.put(os.path.join(tier_dir, f"r{r}.ckpt"), f"{bucket}/plain/r{r}", recursive=True)
                        rows.setdefault("plain_put_s", []).append(time.perf_counter() - start)
                        fs.rm(f"{bucket}/plain/r{r}", recursive=True)
                    if r > 0:  # pruning, as top-k does; finished before the next measurement
                        tiered_io.remove_checkpoint(f"{remote}/r{r - 1}.ckpt")
                        tiered_io.tiers.wait()
            tiered_io.teardown()
            local_io.teardown()
        out: dict = {"size_gb": size_bytes / 1e9, "repeats": repeats, "raw": rows}
        for key, values in rows.items():
            out[key] = _median(values)
        for mode in ("sync", "async"):
            out[f"{mode}_stall_ratio"] = out[f"{mode}_tiered_stall_s"] / out[f"{mode}_local_stall_s"]
        out["upload_gb_per_s"] = size_bytes / 1e9 / out["sync_upload_s"]
        out["plain_put_gb_per_s"] = size_bytes / 1e9 / out["plain_put_s"]
        out["upload_vs_put"] = out["plain_put_s"] / out["sync_upload_s"]
        return out
    finally:
        server.stop()


def markdown(result: dict, command: str) -> list[str]:
    """The TIERED.md section: stalls and upload throughput with the goals."""
    r = result
    return [
        "# Tiered saves to S3 (SeaweedFS on loopback)",
        "",
        f"Command: `{command.strip()}`; {r['size_gb']:.3g} GB checkpoint, medians of {r['repeats']} alternating runs.",
        "",
        "| mode | local-only stall | tiered stall | tiered / local (goal <= 1.2x) |",
        "|---|---|---|---|",
        *(
            f"| {m} | {r[f'{m}_local_stall_s']:.3f} s | {r[f'{m}_tiered_stall_s']:.3f} s |"
            f" {r[f'{m}_stall_ratio']:.2f}x |"
            for m in ("sync", "async")
        ),
        "",
        "| upload of the committed checkpoint | plain s3fs put of the same files | upload / put (goal >= 1.0x) |",
        "|---|---|---|",
        f"| {r['sync_upload_s']:.2f} s ({r['upload_gb_per_s']:.3f} GB/s) | {r['plain_put_s']:.2f} s"
        f" ({r['plain_put_gb_per_s']:.3f} GB/s) | {r['upload_vs_put']:.2f}x |",
    ]


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    from benchmarks._cli import bench_main

    raise SystemExit(bench_main(run, None, doc=__doc__, default_size_gb=0.25, prefix="lightning_dcp_bench_tiered_"))
