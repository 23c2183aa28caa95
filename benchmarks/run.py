"""Run every benchmark side by side on this machine and write ``RESULTS.md`` + ``save.png`` (+ raw JSON).

    python -m benchmarks.run                      # sizes 0.1 and 1 GB, world sizes 1 and 2, 3 repeats (~10 min)
    python -m benchmarks.run --sizes 0.1,1,2      # add the 2 GB checkpoint
    python -m benchmarks.run --quick              # 0.1 GB saves only, 1 repeat (smoke test, ~1 min)
    python -m benchmarks.run --gpu                # one CUDA GPU: 2, 8 and 20 GB + a training run -> GPU.md
    python -m benchmarks.run --gpu --smoke        # the GPU benchmark's code paths on CPU, tiny sizes, no files
    python -m benchmarks.run --tiered             # tiered saves to S3 (SeaweedFS): 0.25 GB, 5 repeats -> TIERED.md
    python -m benchmarks.run --remote             # 2-rank resume from S3 vs a parallel get, 1.49 GB -> REMOTE.md

Also available one by one: ``benchmarks/bench_save.py``, ``bench_reshard.py``, ``bench_consolidate.py``,
``bench_integrity.py``, ``bench_storage.py``, ``bench_gpu.py``, ``bench_tiered.py``, ``bench_remote.py`` (each has
``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import torch

from benchmarks import (
    bench_consolidate,
    bench_gpu,
    bench_integrity,
    bench_remote,
    bench_reshard,
    bench_save,
    bench_tiered,
)
from benchmarks.provenance import stamp
from benchmarks.trainer_report import trainer_main

LABELS = {
    "lightning_dcp": "lightning_dcp (sync)",
    "lightning_dcp_async": "lightning_dcp (async)",
    "torch_save_rank0": "Lightning TorchCheckpointIO (rank-0 torch.save)",
    "lightning_async_io": "Lightning AsyncCheckpointIO",
    "raw_dcp_save": "raw dcp.save (= ModelParallelStrategy's sharded save)",
    "disk_limit": "sequential write + fsync (disk limit)",
}
PEERS = ("torch_save_rank0", "lightning_async_io", "raw_dcp_save")


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


def _disk(path: str) -> str:
    lines = subprocess.run(["df", "-hT", path], capture_output=True, text=True).stdout.splitlines()
    device, kind, size = (lines[-1].split() + ["?"] * 3)[:3] if lines else ("?", "?", "?")
    return f"{device} ({kind}, {size})"


def _gpu_name() -> str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    smi = shutil.which("nvidia-smi")
    driver = ""
    if smi:
        query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = f", driver {subprocess.run(query, capture_output=True, text=True).stdout.strip()}"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB{driver}, CUDA {torch.version.cuda}"


def _cell(method: dict, *, stall: bool = False) -> str:
    seconds = method["stall_s"] if stall else method["seconds"]
    return f"{seconds:.3f} s" if stall else f"{seconds:.3f} s ({method['gb_per_s']:.2f} GB/s)"


def gpu_markdown(report: dict) -> list[str]:
    """GPU.md: the save table per size and the training table (goals from issue 17 in the headers)."""
    smoke = report["smoke"]
    lines = [
        "# GPU benchmark results" + (" (SMOKE RUN on CPU, tiny sizes: not GPU numbers)" if smoke else ""),
        "",
        f"GPU: {report['gpu']}. Machine: {report['machine']}. Checkpoint disk: {report['disk']}.",
        f"Command: `{report['command'].strip()}` (medians; min-max in results JSON).",
        "",
        "## Saves",
        "",
        "| state | pinned D2H copy (limit) | async stall | stall / copy (goal <= 1.5x) | async until committed |"
        " sync save | write + fsync (limit) | sync / limit (goal >= 0.8x) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for res in report["saves"]:
        m = res["methods"]
        lines.append(
            f"| {res['size_gb']:.3g} GB | {_cell(m['pinned_copy'])} | {_cell(m['async'], stall=True)} |"
            f" {res['stall_vs_pinned_copy']:.2f}x | {_cell(m['async'])} | {_cell(m['sync'])} |"
            f" {_cell(m['disk_limit'])} | {res['sync_vs_disk_limit']:.2f}x |"
        )
    train = report.get("training")
    if train:
        s = train["settings"]
        lines += [
            "",
            "## Training step time with saves",
            "",
            f"MLP of {train['layers']} x {s['width']}x{s['width']} layers ({train['state_gb']:.3g} GB of weights +"
            f" AdamW state), batch {s['batch']}, `{s['precision']}`, `dcp_single_device`; {s['steps']} timed steps"
            f" after {s['warmup']}, a save every {s['every']} steps; runs alternate between modes.",
            "",
            "| saves | mean step (runs) | vs no saves (goal async <= 1.03x) | saves per run | median stall |",
            "|---|---|---|---|---|",
        ]
        for mode, entry in train["modes"].items():
            runs = ", ".join(f"{1e3 * t:.1f}" for t in entry["step_s_all"])
            ratio = f"{entry['vs_none']:.3f}x" if entry["vs_none"] else "-"
            lines.append(
                f"| {mode} | {1e3 * entry['step_s']:.1f} ms ({runs}) | {ratio} | {entry['saves_per_run']} |"
                f" {entry['stall_s']:.3f} s |"
            )
    return lines


def gpu_main(args: argparse.Namespace, stamped: dict[str, str]) -> int:
    """``--gpu``: bench_gpu's saves at each size, then its training run; GPU.md and gpu.json in ``--out``."""
    smoke = args.smoke
    if not bench_gpu.cuda_ready(smoke):
        return 0
    sizes = [0.002, 0.004] if smoke else [float(s) for s in (args.sizes or "2,8,20").split(",")]
    repeats = 1 if smoke else args.repeats
    out = args.out or (None if smoke else "benchmarks/results")
    workdir = tempfile.mkdtemp(prefix="lightning_dcp_bench_gpu_", dir=os.path.abspath("."))
    report: dict = {
        **stamped,
        "gpu": _gpu_name(),
        "disk": _disk(workdir),
        "smoke": smoke,
        "saves": [],
    }
    try:
        for size in sizes:
            _log(f"gpu saves: {size} GB of state, {repeats} repeats")
            report["saves"].append(bench_gpu.run(size, os.path.join(workdir, "saves"), repeats=repeats, smoke=smoke))
        if args.train_steps > 0:
            train: dict = {"steps": args.train_steps, "every": args.save_every}
            if smoke:
                train = {"steps": min(args.train_steps, 12), "every": min(args.save_every, 4), "warmup": 2}
                train.update(state_gb=0.0005, batch=64, repeats=1)
            _log(f"gpu training: {train}")
            report["training"] = bench_gpu.run_training(os.path.join(workdir, "train"), smoke=smoke, **train)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    lines = gpu_markdown(report)
    print("\n".join(lines), flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu.json"), "w") as f:
            json.dump(report, f, indent=2)
        with open(os.path.join(out, "GPU.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        _log(f"wrote {out}/GPU.md and gpu.json")
    return 0


def tiered_main(args: argparse.Namespace, stamped: dict[str, str]) -> int:
    """``--tiered``: bench_tiered at each size (default 0.25 GB); TIERED.md and tiered.json in ``--out``."""
    sizes = [float(s) for s in (args.sizes or "0.25").split(",")]
    repeats = args.repeats if args.repeats_given else 5
    out = args.out or "benchmarks/results"
    lines: list[str] = []
    results = []
    for size in sizes:
        workdir = tempfile.mkdtemp(prefix="lightning_dcp_bench_tiered_", dir=os.path.abspath("."))
        try:
            _log(f"tiered: {size} GB, {repeats} repeats")
            result = bench_tiered.run(size, workdir, repeats=repeats)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        results.append(result)
        lines += [*bench_tiered.markdown(result, stamped["command"]), ""]
    lines.insert(2, f"Commit: {stamped['commit']}. Date: {stamped['date']}. Machine: {stamped['machine']}.")
    lines.insert(3, "")
    print("\n".join(lines), flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tiered.json"), "w") as f:
        json.dump({**stamped, "results": results}, f, indent=2)
    with open(os.path.join(out, "TIERED.md"), "w") as f:
        f.write("\n".join(lines))
    _log(f"wrote {out}/TIERED.md and tiered.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help="checkpoint sizes in GB, comma separated (0.1,1; GPU: 2,8,20)")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (--tiered: 5)")
    parser.add_argument("--quick", action="store_true", help="0.1 GB saves only, 1 repeat")
    parser.add_argument("--gpu", action="store_true", help="bench_gpu.py instead; skips without CUDA")
    parser.add_argument("--tiered", action="store_true", help="bench_tiered.py instead (S3 on SeaweedFS)")
    parser.add_argument("--remote", action="store_true", help="bench_remote.py instead (resume from S3) -> REMOTE.md")
    parser.add_argument("--smoke", action="store_true", help="with --gpu: tiny sizes on CPU, files only with --out")
    parser.add_argument("--train-steps", type=int, default=200, help="with --gpu: timed training steps (0: none)")
    parser.add_argument("--save-every", type=int, default=50, help="with --gpu: steps between saves")
    parser.add_argument("--trainer", action="store_true", help="bench_trainer.py on every mix instead -> TRAINER.md")
    parser.add_argument("--mixes", default=None, help="with --trainer: huge,gpt2,small (default all)")
    parser.add_argument("--scale", type=float, default=1.0, help="with --trainer: width scale of the mixes")
    parser.add_argument("--out", default=None, help="default: benchmarks/results")
    args = parser.parse_args(argv)
    args.repeats_given = args.repeats is not None
    args.repeats = 3 if args.repeats is None else args.repeats
    if args.smoke and not args.gpu:
        parser.error("--smoke goes with --gpu")
    stamped = stamp(argv)
    if args.gpu:
        return gpu_main(args, stamped)
    if args.tiered:
        return tiered_main(args, stamped)
    if args.remote:  # the gpt2 mix at full size (1.49 GB); --scale and --repeats pass through
        out = args.out or "benchmarks/results"
        options = ["--scale", str(args.scale), "--repeats", str(args.repeats), "--out", out]
        return bench_remote.main(["--mix", "gpt2", *options])
    if args.trainer:
        return trainer_main(args, stamped, log=_log)
    args.out = args.out or "benchmarks/results"
    sizes = [0.1] if args.quick else [float(s) for s in (args.sizes or "0.1,1").split(",")]
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    repeats = 1 if args.quick else args.repeats
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="lightning_dcp_bench_", dir=os.path.abspath("."))
    report: dict = {
        **stamped,
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
