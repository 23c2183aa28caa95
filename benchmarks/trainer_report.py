"""``python -m benchmarks.run --trainer``: the Trainer-path benchmark on every mix and world size, side by side.

Runs :func:`benchmarks.bench_trainer.run` for each mix of :mod:`benchmarks.mixes` at each world size (saves sync and
async, stock Lightning DDP, fits with no / sync / async / deferred saves, resume loads vs a cold read) and writes
``TRAINER.md`` (one table row per mix and world size, medians with min-max) and ``trainer.json`` (every figure).

The ratios are the issue's goals, each as a speed ratio (>= 1 is better than the yardstick):

- ``sync/limit``: the sequential write + ``fsync`` of the same bytes over the sync save's time (goal >= 0.8);
- ``vs stock``: stock Lightning DDP's save time over ours (goal >= 3 at >= 1 GB);
- ``stall/sync``: the async save's stall over the sync save's time (goal <= 0.05); in fits, ``blocked/sync``: the
  async save's call plus the next optimizer step's wait for its staging copies, over a sync save (goal <= 0.05);
- ``fit async/sync``: the fit with async saves over the fit with sync saves (goal <= 1.0);
- ``read/resume (per round)``: a cold sequential read of the same files over the resume's restore, round by round
  (median, min-max; goal >= 0.8), ``stock/resume``: stock Lightning DDP's restore of its own single file over ours
  (goal > 1), and ``reshard``: the restore of a checkpoint saved at the other world size over the same-size one
  (goal <= 1.2).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any

try:
    from benchmarks import bench_trainer
    from benchmarks.mixes import MIXES
except ImportError:  # run as a script
    import bench_trainer
    from mixes import MIXES

__all__ = ["trainer_main", "trainer_table"]


def _med(entry: dict | None) -> float | None:
    return None if entry is None else entry["median"]


def _cell(entry: dict | None) -> str:
    if entry is None:
        return "-"
    return f"{entry['median']:.3f} ({entry['min']:.3f}-{entry['max']:.3f})"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _paired(load: dict[str, Any]) -> str:
    """Each round's cold read over its restore (median, min-max); the ratio of the medians for older results."""
    paired = load.get("paired")
    if paired is None:
        return _ratio(_med(load.get("read")), _med(load.get("load")))
    return f"{paired['median']:.2f} ({paired['min']:.2f}-{paired['max']:.2f})"


def _row(res: dict[str, Any]) -> list[str]:
    save, stock, load = res.get("save", {}), res.get("stock", {}), res.get("load", {})
    sync = _med(save.get("sync", {}).get("seconds"))
    limit = _med(save.get("limit", {}).get("seconds"))
    stock_s = _med(stock.get("stock", {}).get("seconds"))
    stall = _med(save.get("async", {}).get("stall"))
    same = load.get(f"saved_ws{res['world_size']}") or {}
    other = next((v for k, v in load.items() if k != f"saved_ws{res['world_size']}"), {})
    return [
        res["mix"],
        str(res["world_size"]),
        f"{res.get('bytes', same.get('bytes', 0)) / 1e9:.2f}",
        _cell(save.get("sync", {}).get("seconds")),
        _cell(save.get("limit", {}).get("seconds")),
        _ratio(limit, sync),
        _cell(stock.get("stock", {}).get("seconds")),
        _ratio(stock_s, sync),
        _cell(save.get("async", {}).get("stall")),
        _ratio(stall, sync),
        _cell(save.get("plain", {}).get("stall")),
        _cell(same.get("load")),
        _cell(same.get("read")),
        _paired(same),
        _cell(same.get("stock")),
        _ratio(_med(same.get("stock")), _med(same.get("load"))),
        _ratio(_med(other.get("load")), _med(same.get("load"))),
    ]


HEADER = [
    "mix",
    "ws",
    "GB",
    "sync save s",
    "write+fsync s",
    "limit/sync",
    "stock DDP s",
    "stock/sync",
    "async stall s (call)",
    "stall/sync",
    "plain async stall s",
    "resume s",
    "cold read s",
    "read/resume (per round)",
    "stock resume s",
    "stock/resume",
    "reshard",
]

FIT_HEADER = [
    "mix",
    "ws",
    "EMA",
    "fit s: none / sync / async / plain / limit",
    "saves",
    "sync save blocked s",
    "async blocked s (call + step wait)",
    "blocked/sync",
    "plain async blocked s",
    "fit async/sync",
    "added async/sync, per round",
    "added limit/sync, per round",
]


def _fit_row(res: dict[str, Any]) -> list[str]:
    fit = res["fit"]
    choice = re.search(r"--async-choice[ =](\S+)", res.get("command", ""))  # bench_trainer's ASYNC_CHOICES
    sync_blocked = _med(fit.get("sync", {}).get("blocked"))
    async_blocked = _med(fit.get("async", {}).get("blocked"))
    return [
        res["mix"] + (f" (async: {choice.group(1)})" if choice else ""),
        str(res["world_size"]),
        "yes" if res.get("ema") else "no",
        " / ".join(_cell(fit.get(m, {}).get("seconds")) for m in ("none", "sync", "async", "plain", "limit")),
        str(fit.get("async", {}).get("saves", "-")),
        _cell(fit.get("sync", {}).get("blocked")),
        _cell(fit.get("async", {}).get("blocked")),
        _ratio(async_blocked, sync_blocked),
        _cell(fit.get("plain", {}).get("blocked")),
        _ratio(_med(fit.get("async", {}).get("seconds")), _med(fit.get("sync", {}).get("seconds"))),
        _cell(fit.get("async", {}).get("added_over_sync")),
        _cell(fit.get("limit", {}).get("added_over_sync")),
    ]


def trainer_table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown table lines: saves and resumes, then fits (rows of results that have them)."""
    lines: list[str] = []
    saves = [r for r in results if "save" in r or "load" in r]
    if saves:
        lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(_row(r)) + " |" for r in saves]
    fits = [r for r in results if "fit" in r]
    if fits:
        lines += ["", "| " + " | ".join(FIT_HEADER) + " |", "|" + "---|" * len(FIT_HEADER)]
        lines += ["| " + " | ".join(_fit_row(r)) + " |" for r in fits]
    return lines


REPORT_HEADER = [
    "# Trainer-path benchmark: tables",
    "",
    "Generated, not edited: `python -m benchmarks.trainer_report benchmarks/results/TRAINER.md"
    " benchmarks/results/trainer/*.json`",
    "renders the JSON results in `results/trainer/` (each names its commit, date, machine and command since"
    " 2026-11-29;",
    "older ones: benchmarks/README.md). The hand-written resume analysis is in [RESUMES.md](RESUMES.md).",
    "",
]
"""The first lines of ``results/TRAINER.md``: what renders it and where the hand-written analysis lives."""


def report_main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.trainer_report OUT.md RESULT.json ...``: the tables of saved results."""
    import argparse

    parser = argparse.ArgumentParser(description=report_main.__doc__)
    parser.add_argument("out")
    parser.add_argument("results", nargs="+")
    args = parser.parse_args(argv)
    results = []
    for name in args.results:
        with open(name) as f:
            results.append(json.load(f))
    with open(args.out, "w") as f:
        f.write("\n".join([*REPORT_HEADER, *trainer_table(results)]) + "\n")
    return 0


def trainer_main(args: Any, stamped: dict[str, str], *, log: Any = print) -> int:
    """Run every mix (``args.mixes``) at every world size (``args.world_sizes``); write TRAINER.md, trainer.json."""
    out = args.out or "benchmarks/results"
    os.makedirs(out, exist_ok=True)
    mixes = (args.mixes or ",".join(MIXES)).split(",")
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    results = []
    workdir = tempfile.mkdtemp(prefix="lightning_dcp_trainer_", dir=os.path.abspath("."))
    try:
        for mix in mixes:
            for ws in world_sizes:
                log(f"trainer: {mix} at world size {ws} ({args.repeats} repeats)")
                others = tuple(w for w in (2, 1) if w != ws)[:1]
                results.append(
                    bench_trainer.run(
                        mix,
                        os.path.join(workdir, f"{mix}-{ws}"),
                        world_size=ws,
                        repeats=args.repeats,
                        scale=args.scale,
                        load_world_sizes=(ws, *others),
                    )
                )
                shutil.rmtree(os.path.join(workdir, f"{mix}-{ws}"), ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    with open(os.path.join(out, "trainer.json"), "w") as f:
        json.dump({**stamped, "results": results}, f, indent=2)
    lines = [
        "# Trainer-path benchmark",
        "",
        f"Commit: {stamped['commit']}. Date: {stamped['date']}. Machine: {stamped['machine']}.",
        f"Command: `{stamped['command']}` (medians of {args.repeats} runs; min-max in parentheses; seconds).",
        "Ratios are speed ratios against the yardstick named in benchmarks/trainer_report.py.",
        "",
        *trainer_table(results),
    ]
    with open(os.path.join(out, "TRAINER.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log(f"wrote {out}/TRAINER.md and trainer.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(report_main())
