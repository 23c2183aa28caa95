"""``python -m tests.chaos``: the fault-injection campaign (``nox -s chaos``): kills, fuzzing, the doors (clocks, path
strings), then store outages under a local tier; one summary.

Bounded in count and time; every seed is printed and recorded. The summary table is printed and the whole summary
(every kill, every finding) written as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from tests.chaos import remote
from tests.chaos.campaign import Setup, format_table, run_campaign
from tests.chaos.doors import clock_pass, path_pass
from tests.chaos.fuzz import READERS, fuzz_reader


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--sync-kills", type=int, default=30, help="kills during synchronous saves (default 30)")
    parser.add_argument("--async-kills", type=int, default=30, help="kills during asynchronous saves (default 30)")
    parser.add_argument("--kills-per-trial", type=int, default=5, help="chained kills per checkpoint directory")
    parser.add_argument("--width", type=int, default=2048, help="Linear width (checkpoint: 12*layers*width^2 bytes)")
    parser.add_argument("--layers", type=int, default=3, help="Linear layers (default 3: ~151 MB checkpoints)")
    parser.add_argument("--every", type=int, default=2, help="every_n_train_steps (default 2)")
    parser.add_argument("--kill-time-limit", type=float, default=7200, help="seconds for the kills (default 7200)")
    parser.add_argument("--fuzz-examples", type=int, default=2000, help="hypothesis examples per reader")
    parser.add_argument("--fuzz-readers", nargs="*", default=list(READERS), choices=READERS)
    parser.add_argument(
        "--setups",
        nargs="*",
        default=None,
        help="setups to draw from, as strategy/callback/save_last (default: all 8, e.g. ddp/lightning/link)",
    )
    parser.add_argument("--seed", type=int, default=None, help="campaign seed (default: random, printed)")
    parser.add_argument("--workdir", default="outputs/chaos/work", help="scratch space (~1 GB per trial)")
    parser.add_argument("--out", default="outputs/chaos/summary.json", help="where the JSON summary goes")
    parser.add_argument("--clock-trials", type=int, default=8, help="clock pass: trials (chained runs each)")
    parser.add_argument("--clock-runs", type=int, default=4, help="clock pass: runs per trial (default 4)")
    parser.add_argument("--path-examples", type=int, default=300, help="path pass: hypothesis examples per store")
    parser.add_argument("--skip-kills", action="store_true")
    parser.add_argument("--skip-fuzz", action="store_true")
    parser.add_argument("--remote-outages", type=int, default=20, help="remote-fault pass: outages of 5-60 s")
    parser.add_argument("--skip-doors", action="store_true", help="skip the clock and path passes")
    parser.add_argument("--skip-remote", action="store_true", help="skip the remote-fault pass")
    parser.add_argument("--keep", action="store_true", help="keep each trial's directory (checkpoints, logs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"chaos campaign seed {seed} (rerun with --seed {seed})", flush=True)
    summary: dict = {"seed": seed, "argv": sys.argv[1:] if argv is None else argv}
    started = time.monotonic()
    if not args.skip_kills:
        summary["kills"] = run_campaign(
            workdir=os.path.abspath(args.workdir),
            sync_kills=args.sync_kills,
            async_kills=args.async_kills,
            kills_per_trial=args.kills_per_trial,
            seed=seed,
            time_limit_s=args.kill_time_limit,
            width=args.width,
            layers=args.layers,
            every=args.every,
            keep=args.keep,
            setups=[Setup(*s.split("/")) for s in args.setups] if args.setups else None,
            log=lambda line: print(line, flush=True),
        )
    if not args.skip_fuzz:
        summary["fuzz"] = {}
        for i, reader in enumerate(args.fuzz_readers):
            stats = fuzz_reader(
                reader,
                root=os.path.abspath(os.path.join(args.workdir, "fuzz")),
                examples=args.fuzz_examples,
                seed=seed + i,
                keep_going=True,
                artifacts=os.path.abspath(os.path.join(os.path.dirname(args.out) or ".", "fuzz-findings")),
            )
            summary["fuzz"][reader] = {"seed": seed + i, **stats.as_dict()}
            print(
                f"fuzz {reader}: {stats.examples} examples in {stats.seconds:.0f} s, outcomes {dict(stats.outcomes)},"
                f" findings {len(stats.findings)}",
                flush=True,
            )
    if not args.skip_doors:
        summary["clock"] = clock_pass(
            workdir=os.path.abspath(args.workdir),
            trials=args.clock_trials,
            runs_per_trial=args.clock_runs,
            seed=seed,
            keep=args.keep,
            log=lambda line: print(line, flush=True),
        )
        report_path = os.path.abspath(os.path.join(os.path.dirname(args.out) or ".", "paths.json"))
        summary["paths"] = path_pass(examples=args.path_examples, report=report_path)
    if not args.skip_remote:
        summary["remote"] = remote.run_remote_faults(
            workdir=os.path.abspath(os.path.join(args.workdir, "remote")),
            outages=args.remote_outages,
            seed=seed,
            log=lambda line: print(line, flush=True),
        )
    summary["seconds"] = round(time.monotonic() - started)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(report(summary))
    print(f"summary written to {args.out}")
    return 1 if failed(summary) else 0


def failed(summary: dict) -> bool:
    kills = summary.get("kills", {})
    fuzz = summary.get("fuzz", {})
    return bool(
        any(kills.get("failures", {}).values())
        or kills.get("committed_but_not_verifying")
        or kills.get("problems")
        or any(r["findings_by_kind"] for r in fuzz.values())
        or any(v for k, v in summary.get("clock", {}).get("verdicts", {}).items() if k != "ok")
        or summary.get("paths", {}).get("pytest_exit_code", 0) != 0
        or any(summary.get("remote", {}).get(key) for key in remote.FAILURES)
    )


def report(summary: dict) -> str:
    lines = [f"\n== chaos campaign, seed {summary['seed']}, {summary['seconds']} s"]
    kills = summary.get("kills")
    if kills:
        lines += [
            f"kills: {kills['kills']} ({kills['checkpoint_mb']} MB checkpoints, {kills['seconds']} s); failures"
            f" {kills['failures']}; committed checkpoints that do not verify: {kills['committed_but_not_verifying']};"
            f" other problems: {len(kills['problems'])}",
            format_table(kills),
        ]
    for reader, stats in summary.get("fuzz", {}).items():
        lines.append(
            f"fuzz {reader:9} {stats['examples']:>6} examples (seed {stats['seed']}): non-CheckpointError"
            f" {stats['non_checkpoint_errors']}, findings {stats['findings_by_kind'] or 0},"
            f" outcomes {stats['outcomes']}"
        )
    clock = summary.get("clock")
    if clock:
        lines.append(f"clock pass: {clock['runs']} runs ({clock['seconds']} s), verdicts {clock['verdicts']}")
    paths = summary.get("paths")
    if paths:
        lines.append(
            f"path pass: {paths['examples_per_store']} examples per store ({paths['seconds']} s), pytest exit"
            f" {paths['pytest_exit_code']}, outcomes {paths['counts']}"
        )
    if summary.get("remote"):
        lines.append(remote.report(summary["remote"]))
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
