"""Run every benchmark side by side on this machine and write ``RESULTS.md`` + ``save.png`` (+ raw JSON).

    python -m benchmarks.run                      # sizes 0.1 and 1 GB, world sizes 1 and 2, 3 repeats (~10 min)
    python -m benchmarks.run --sizes 0.1,1,2      # add the 2 GB checkpoint
    python -m benchmarks.run --quick              # 0.1 GB saves only, 1 repeat (smoke test, ~1 min)

Also available one by one: ``benchmarks/bench_save.py``, ``bench_reshard.py``, ``bench_consolidate.py``,
``bench_integrity.py``, ``bench_storage.py`` (each has ``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import lightning
import torch

from benchmarks import bench_consolidate, bench_integrity, bench_reshard, bench_save

LABELS = {
    "lightning_dcp": "lightning_dcp (sync)",
    "lightning_dcp_async": "lightning_dcp (async)",
    "torch_save_rank0": "Lightning TorchCheckpointIO (rank-0 torch.save)",
    "lightning_async_io": "Lightning AsyncCheckpointIO",
    "raw_dcp_save": "raw dcp.save (= ModelParallelStrategy's sharded save)",
    "disk_limit": "sequential write + fsync (disk limit)",
}
PEERS = ("torch_save_rank0", "lightning_async_io", "raw_dcp_save")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    disk = subprocess.run(["df", "-h", "."], capture_output=True, text=True).stdout.splitlines()[-1].split()[0]
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GB RAM, disk {disk}; Python {platform.python_version()},"
        f" torch {torch.__version__}, lightning {lightning.__version__}"
    )


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_table(results: list[dict]) -> list[str]:
    header = (
        "| size | ranks | method | time s (min-max) | GB/s | stall s | peak RSS GB per rank | vs best peer | vs limit |"
    )
    lines = [
        header,
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        methods = res["methods"]
        best_peer = min(methods[p]["seconds"] for p in PEERS if p in methods)
        limit = methods["disk_limit"]["seconds"]
        for name, m in methods.items():
            lines.append(
                f"| {res['size_gb']:.2f} GB | {res['world_size']} | {LABELS[name]} | {m['seconds']:.2f}"
                f" ({m['seconds_min']:.2f}-{m['seconds_max']:.2f}) | {m['gb_per_s']:.2f} | {m['stall_s']:.3f} |"
                f" {', '.join(f'{r:.2f}' for r in m['peak_rss_gb_per_rank'])} | {best_peer / m['seconds']:.2f}x |"
                f" {limit / m['seconds']:.2f}x |"
            )
    return lines


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        names = list(res["methods"])
        values = [res["methods"][n]["gb_per_s"] for n in names]
        stalls = [res["methods"][n]["stall_s"] for n in names]
        colors = ["tab:blue" if n.startswith("lightning_dcp") else "tab:gray" for n in names]
        colors[names.index("disk_limit")] = "tab:green"
        ax.barh(range(len(names)), values, color=colors)
        ax.set_yticks(range(len(names)), [n.replace("_", " ") for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("save throughput, GB/s (higher is better)")
        ax.set_title(f"{res['size_gb']:.2f} GB, {res['world_size']} rank(s)", fontsize=10)
        for i, (v, s) in enumerate(zip(values, stalls, strict=True)):
            ax.text(v, i, f" {v:.2f} (stall {s:.2f}s)", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0.1,1", help="checkpoint sizes in GB, comma separated")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="0.1 GB saves only, 1 repeat")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    sizes = [0.1] if args.quick else [float(s) for s in args.sizes.split(",")]
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="lightning_dcp_bench_", dir=os.path.abspath("."))
    report: dict = {
        "machine": machine(),
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "save": [],
    }
    try:
        for size in sizes:
            for ws in world_sizes:
                _log(f"save: {size} GB at world size {ws} ({len(bench_save.METHODS)} methods x {repeats})")
                report["save"].append(
                    bench_save.run(size, os.path.join(workdir, "save"), world_size=ws, repeats=repeats)
                )
                shutil.rmtree(os.path.join(workdir, "save"), ignore_errors=True)
        big = max(sizes)
        if not args.quick and big >= 0.5:
            _log(f"load / reshard: {big} GB")
            report["reshard"] = bench_reshard.run(big, os.path.join(workdir, "reshard"), repeats=repeats)
            shutil.rmtree(os.path.join(workdir, "reshard"), ignore_errors=True)
            _log(f"consolidate: {big} GB")
            report["consolidate"] = bench_consolidate.run(big, os.path.join(workdir, "consolidate"), repeats=repeats)
            shutil.rmtree(os.path.join(workdir, "consolidate"), ignore_errors=True)
            _log(f"checksums: {big} GB")
            report["integrity"] = bench_integrity.run(big, os.path.join(workdir, "integrity"), repeats=repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=2)
    plot(report["save"], os.path.join(args.out, "save.png"))
    lines = [
        "# Benchmark results",
        "",
        f"Machine: {report['machine']}.",
        f"Command: `{report['command'].strip()}` (medians of {repeats} runs; min-max in parentheses).",
        "",
        "## Save",
        "",
        *save_table(report["save"]),
        "",
        "![save throughput](save.png)",
    ]
    for key in ("reshard", "consolidate", "integrity"):
        if key in report:
            lines += ["", f"## {key}", "", "```json", json.dumps(report[key], indent=2), "```"]
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _log(f"wrote {args.out}/RESULTS.md and save.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
