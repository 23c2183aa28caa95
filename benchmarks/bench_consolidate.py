"""Peak memory and wall time of consolidation: lightning_dcp vs torch's dcp_to_torch vs Lightning's tool.

Builds a GPT-style checkpoint (embedding, per-layer attention/MLP weights, AdamW ``exp_avg``/``exp_avg_sq``/``step``)
of about ``size_gb`` GB twice: as a lightning_dcp checkpoint (``DCPCheckpointIO``, one process) and, with the same
tensors, in Lightning's own sharded layout (``FSDPStrategy(state_dict_type="sharded")``: ``model.*``,
``optimizer_0.*`` + ``meta.pt``), the one Lightning's ``consolidate_checkpoint`` reads (it renames ``model`` to
``state_dict``, so it fails on ``ModelParallelStrategy``'s ``state_dict.*`` layout). Each tool runs in a fresh
subprocess that imports torch, records its RSS (the baseline), runs the tool's ``__main__`` and reports ``VmHWM``;
the median of ``repeats`` runs is reported. Files are read from a warm page cache (dropping it needs root).

    python benchmarks/bench_consolidate.py --size-gb 2 --workdir /tmp/bench
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed.checkpoint as dcp

try:
    from benchmarks._cli import bench_main
except ImportError:  # run as a script: python benchmarks/bench_consolidate.py
    from _cli import bench_main

VOCAB, CONTEXT, WIDTH = 50257, 1024, 768

_RUNNER = """
import runpy, sys, time
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch
base = status("VmRSS:")
sys.argv = sys.argv[1:]
start = time.perf_counter()
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as exit:
    if exit.code not in (None, 0):
        raise
print("BENCH", base, status("VmHWM:"), time.perf_counter() - start, file=sys.stderr)
"""


def gpt_state(size_gb: float) -> tuple[dict[str, torch.Tensor], dict]:
    """Model weights and an AdamW ``optimizer.state_dict()`` of about ``size_gb`` GB in total (fp32)."""
    params = size_gb * 1e9 / 12  # weights + exp_avg + exp_avg_sq, 4 bytes each
    layers = max(1, round((params - (VOCAB + CONTEXT) * WIDTH) / (12 * WIDTH * WIDTH)))
    shapes = {"wte.weight": (VOCAB, WIDTH), "wpe.weight": (CONTEXT, WIDTH)}
    for i in range(layers):
        p = f"h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (WIDTH,),
                p + "ln_1.bias": (WIDTH,),
                p + "attn.c_attn.weight": (3 * WIDTH, WIDTH),
                p + "attn.c_attn.bias": (3 * WIDTH,),
                p + "attn.c_proj.weight": (WIDTH, WIDTH),
                p + "attn.c_proj.bias": (WIDTH,),
                p + "ln_2.weight": (WIDTH,),
                p + "ln_2.bias": (WIDTH,),
                p + "mlp.c_fc.weight": (4 * WIDTH, WIDTH),
                p + "mlp.c_fc.bias": (4 * WIDTH,),
                p + "mlp.c_proj.weight": (WIDTH, 4 * WIDTH),
                p + "mlp.c_proj.bias": (WIDTH,),
            }
        )
    shapes.update({"ln_f.weight": (WIDTH,), "ln_f.bias": (WIDTH,)})
    weights = {k: torch.randn(s) * 0.02 for k, s in shapes.items()}
    state = {
        i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(s) * 1e-3, "exp_avg_sq": torch.rand(s) * 1e-6}
        for i, s in enumerate(shapes.values())
    }
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(len(shapes)))}]
    return weights, {"state": state, "param_groups": groups}


def build(size_gb: float, workdir: str) -> dict:
    """Write both checkpoints into ``workdir``; returns their paths and sizes."""
    from lightning_dcp import DCPCheckpointIO

    weights, optimizer = gpt_state(size_gb)
    names = list(weights)
    extra = {"epoch": 1, "global_step": 100, "hyper_parameters": {"width": WIDTH}, "loops": {}, "callbacks": {}}
    ours = os.path.join(workdir, "ours.ckpt")
    checkpoint = {"state_dict": weights, "optimizer_states": [optimizer], "lr_schedulers": [], **extra}
    DCPCheckpointIO(sync_files=False).save_checkpoint(checkpoint, ours)
    lightning = os.path.join(workdir, "lightning.ckpt")
    by_fqn = {
        "state": {names[i]: s for i, s in optimizer["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optimizer["param_groups"]],
    }
    dcp.save({"model": weights, "optimizer_0": by_fqn}, checkpoint_id=lightning, no_dist=True)
    torch.save(extra, os.path.join(lightning, "meta.pt"))
    largest = max(t.nbytes for t in weights.values())
    total = sum(t.nbytes for t in weights.values()) * 3
    return {"ours": ours, "lightning": lightning, "checkpoint_bytes": total, "largest_tensor_bytes": largest}


def measure(module_argv: list[str], output: str, repeats: int) -> dict:
    """Median peak RSS above the ``import torch`` baseline and median wall time of ``python -m ...``."""
    runs = []
    for _ in range(repeats):
        if os.path.isdir(output):
            shutil.rmtree(output)
        elif os.path.exists(output):
            os.remove(output)
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-c", _RUNNER, *module_argv], capture_output=True, text=True)
        wall = time.perf_counter() - start
        line = [ln for ln in result.stderr.splitlines() if ln.startswith("BENCH")]
        if result.returncode != 0 or not line:
            raise RuntimeError(f"{module_argv[0]} failed:\n{result.stderr[-3000:]}")
        _, base, peak, inner = line[-1].split()
        runs.append({"rss_above_baseline": int(peak) - int(base), "seconds": float(inner), "process_seconds": wall})
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"output_bytes": os.path.getsize(output)}


def run(size_gb: float, workdir: str, *, repeats: int = 3) -> dict:
    """Build a ``size_gb`` GB checkpoint in ``workdir`` and measure the three tools (``repeats`` runs each)."""
    os.makedirs(workdir, exist_ok=True)
    info = build(size_gb, workdir)
    out = os.path.join(workdir, "out.ckpt")
    tools = {
        "lightning_dcp": ["lightning_dcp.consolidate", info["ours"], "-o", out, "--no-progress"],
        "torch_dcp_to_torch": ["torch.distributed.checkpoint.format_utils", "dcp_to_torch", info["ours"], out],
        "lightning_consolidate": [
            "lightning.pytorch.utilities.consolidate_checkpoint",
            info["lightning"],
            "--output_file",
            out,
        ],
    }
    results = {name: measure(argv, out, repeats) for name, argv in tools.items()}
    ours, peers = results["lightning_dcp"], [v for k, v in results.items() if k != "lightning_dcp"]
    fastest = min(p["seconds"] for p in peers)
    return {
        "size_gb": size_gb,
        **{k: v for k, v in info.items() if k.endswith("bytes")},
        "results": results,
        "goal_rss_ok": ours["rss_above_baseline"] <= info["largest_tensor_bytes"] + 300e6,
        "time_ratio_vs_fastest_peer": ours["seconds"] / fastest,
        "goal_time_ok": ours["seconds"] <= 1.2 * fastest,
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main(run, argv, doc=__doc__, default_size_gb=2.0, prefix="bench_consolidate_")


if __name__ == "__main__":
    raise SystemExit(main())
