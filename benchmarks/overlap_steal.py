"""What a write costs the training beside it when the guest spends no CPU on it: the machine's share (issue 53).

Two processes (one per core here) each train ``mixes``' ``huge`` model by hand (forward, backward, AdamW; one
thread each) for ``--steps`` steps. With ``--write direct`` a thread of each process writes that process's share of the
state (parameters and AdamW state split by size, as a 2-rank DDP save splits it) every ``--every`` steps with
``O_DIRECT`` straight from the training tensors (their page-aligned spans): no copy, no checksum, almost no CPU
in the guest. Reported per mode, medians over ``--rounds``: the loop's wall time, each write's seconds and its thread's
CPU seconds, and the machine's CPU time from ``/proc/stat`` over the run (``steal``: time the hypervisor ran something
else on these vCPUs; ``busy``, ``idle``, ``iowait``), in seconds. A write whose thread used ~0 CPU but grows the loop's
wall time and the steal time is paid for by the machine's I/O path, which no checkpoint design inside the guest avoids.

    python -m benchmarks.overlap_steal --rounds 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time

import torch

try:
    from benchmarks.bench_trainer import _direct_write
    from benchmarks.mixes import make_module
    from benchmarks.provenance import stamp
except ImportError:  # run as a script
    from bench_trainer import _direct_write
    from mixes import make_module
    from provenance import stamp

MODES = ("none", "direct")


def _cpu_times() -> dict[str, float]:
    """Machine-wide CPU seconds from ``/proc/stat``: busy (user + nice + system), idle, iowait, steal."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return {
        "busy": sum(fields[:3]) / tick,
        "idle": fields[3] / tick,
        "iowait": fields[4] / tick,
        "steal": fields[7] / tick,
    }


def _loop(rank: int, mode: str, steps: int, every: int, workdir: str, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    module = make_module("huge", scale=1.0, steps=steps)
    net, batch = module.net, next(iter(module.train_dataloader()))[0]
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step() -> None:
        net(batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()  # AdamW state exists
    state = [p.detach() for p in net.parameters()]
    state += [v for s in optimizer.state.values() for v in s.values() if v.dim()]
    state.sort(key=lambda t: -t.numel() * t.element_size())
    mine = state[rank::2]
    writes: list[tuple[float, float]] = []

    def write(path: str) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        _direct_write(path, mine)
        writes.append((time.perf_counter() - start, time.thread_time() - cpu))

    thread = None
    start = time.perf_counter()
    for i in range(steps):
        step()
        if mode == "direct" and (i + 1) % every == 0:
            if thread is not None:
                thread.join()
            thread = threading.Thread(target=write, args=(os.path.join(workdir, f"{rank}.bin"),))
            thread.start()
    if thread is not None:
        thread.join()
    queue.put((rank, time.perf_counter() - start, sum(t.numel() * t.element_size() for t in mine), writes))


def run(workdir: str, *, rounds: int = 3, steps: int = 12, every: int = 3) -> dict:
    """``rounds`` rounds of every mode (interleaved); medians (min-max) per mode."""
    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            queue = ctx.Queue()
            before = _cpu_times()
            procs = [ctx.Process(target=_loop, args=(r, mode, steps, every, workdir, queue)) for r in range(2)]
            for p in procs:
                p.start()
            results = sorted(queue.get() for _ in procs)
            for p in procs:
                p.join()
            after = _cpu_times()
            runs[mode].append(
                {
                    "wall": max(r[1] for r in results),
                    "bytes": [r[2] for r in results],
                    "write_s": [w[0] for r in results for w in r[3]],
                    "write_cpu_s": [w[1] for r in results for w in r[3]],
                    **{k: after[k] - before[k] for k in after},
                }
            )

    def summary(values: list[float]) -> dict[str, float] | None:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None

    out: dict = {"steps": steps, "every": every, "rounds": rounds}
    for mode, rows in runs.items():
        out[mode] = {k: summary([r[k] for r in rows]) for k in ("wall", "busy", "idle", "iowait", "steal")}
        out[mode]["bytes_per_process"] = rows[0]["bytes"]
        out[mode]["write_s"] = summary([w for r in rows for w in r["write_s"]])
        out[mode]["write_cpu_s"] = summary([w for r in rows for w in r["write_cpu_s"]])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--workdir", default=os.path.abspath("."), help="where the written files go (removed after)")
    args = parser.parse_args(argv)
    stamped = stamp(argv)
    try:
        result = run(args.workdir, rounds=args.rounds, steps=args.steps, every=args.every)
    finally:
        for rank in range(2):
            path = os.path.join(args.workdir, f"{rank}.bin")
            if os.path.exists(path):
                os.unlink(path)
    print(json.dumps({**stamped, **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
