"""How long a process takes to end once its ``atexit`` handlers begin: the interpreter's finalization.

A failed worker under an elastic agent is restarted once the agent sees it end, and a scheduler waits for every
process of a finished job: what the interpreter does once exit begins is part of each. Each round starts a fresh
interpreter that imports torch and Lightning (``stock``) or those and lightning_dcp (``lightning_dcp``: its exit,
``engine/shutdown.py``, runs too), registers an ``atexit`` handler that prints the time, and exits; the parent times
the rest from that print to the process's end. The two kinds alternate, so a slow spell of the machine hits both.

    python -m benchmarks.exit_time --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_CHILD = """
import atexit, sys, time
for name in sys.argv[1].split(","):
    __import__(name)
atexit.register(lambda: print(f"ATEXIT {time.time():.6f}", flush=True))  # registered last: runs first
"""

KINDS = {"stock": "torch,lightning.pytorch", "lightning_dcp": "torch,lightning.pytorch,lightning_dcp"}


def exit_seconds(imports: str) -> float:
    """One fresh interpreter's seconds from its first ``atexit`` handler to its end."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, imports], stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate()
    ended = time.time()
    if child.returncode != 0:
        raise RuntimeError(f"the child exited with {child.returncode}")
    return ended - float(out.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind, imports in KINDS.items():
            times[kind].append(exit_seconds(imports))
    print(f"{args.rounds} rounds each, seconds from the first atexit handler to the process's end:")
    for kind, values in times.items():
        print(f"  {kind:13s} median {statistics.median(values):.3f}  range {min(values):.3f}-{max(values):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
