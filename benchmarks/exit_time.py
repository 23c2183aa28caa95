"""How long a process takes to end once its ``atexit`` handlers begin: the interpreter's finalization.

A failed worker under an elastic agent is restarted once the agent sees it end; what the interpreter does once exit
begins (``atexit`` handlers, tearing modules down, collecting the heap) is part of every restart. Each round starts a
fresh interpreter that imports ``--imports`` (by default torch, Lightning and lightning_dcp), registers an ``atexit``
handler that prints the time, and exits; the parent times the rest from that print to the process's end. ``frozen``
rounds call :func:`lightning_dcp.engine.freeze_heap_at_exit` first (what the ``dcp_*`` multi-process strategies do when
a run fails); ``plain`` rounds do not. The two kinds alternate, so a slow spell of the machine hits both.

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
for name in sys.argv[2].split(","):
    __import__(name)
if sys.argv[1] == "frozen":
    from lightning_dcp.engine import freeze_heap_at_exit
    freeze_heap_at_exit()
atexit.register(lambda: print(f"ATEXIT {time.time():.6f}", flush=True))  # registered last: runs first
"""


def exit_seconds(kind: str, imports: str) -> float:
    """One fresh interpreter's seconds from its first ``atexit`` handler to its end (``kind``: plain or frozen)."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, kind, imports], stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate()
    ended = time.time()
    if child.returncode != 0:
        raise RuntimeError(f"the child exited with {child.returncode}")
    return ended - float(out.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--imports", default="torch,lightning.pytorch,lightning_dcp", help="comma-separated modules")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"plain": [], "frozen": []}
    for _ in range(args.rounds):
        for kind in times:
            times[kind].append(exit_seconds(kind, args.imports))
    print(f"imports {args.imports}, {args.rounds} rounds each, seconds from the first atexit handler to the end:")
    for kind, values in times.items():
        print(f"  {kind:6s} median {statistics.median(values):.3f}  range {min(values):.3f}-{max(values):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
