"""Whether transparent huge pages would speed up filling a fresh optimizer's state from the page cache.

A DDP resume reads the optimizer's state into memory the process has never touched; the kernel maps and zeroes it
4 KB page by page (most of :mod:`benchmarks.resume_floor`'s floor). With the kernel's transparent huge pages in
``madvise`` mode (``/sys/kernel/mm/transparent_hugepage/enabled``), ``madvise(MADV_HUGEPAGE)`` on an allocation
makes it fault 2 MB pages instead. Each round starts a fresh interpreter, which fills ``--gb`` of bytes from a file
already in the page cache (``preadv``, 8 MiB at a time) into, in this order: a fresh ``torch.empty`` buffer
(``plain``), a fresh one advised for huge pages (``huge``), the same two again (``plain_again``, ``huge_again``),
and a buffer zeroed first (``touched``: the copy alone). The first huge-page region of a process is timed apart from
the second because the kernel may compact memory to find 2 MB pages the first time.

    python -m benchmarks.huge_pages --gb 0.88 --rounds 3   # BERT-base's AdamW state
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import ctypes, json, os, sys, time
import torch

path, size = sys.argv[1], int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE, HUGE = 14, 2 << 20


def fill(buffer):
    view = memoryview(buffer.numpy()).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            done += os.preadv(fd, [view[done : done + (8 << 20)]], done)
    finally:
        os.close(fd)


out = {}
for name in ("plain", "huge", "plain_again", "huge_again", "touched"):
    buffer = torch.empty(size, dtype=torch.uint8)
    if name.startswith("huge"):
        start = (buffer.data_ptr() + HUGE - 1) & ~(HUGE - 1)
        if libc.madvise(start, (buffer.data_ptr() + size - start) & ~(HUGE - 1), MADV_HUGEPAGE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    if name == "touched":
        buffer.zero_()
    began = time.perf_counter()
    fill(buffer)
    out[name] = time.perf_counter() - began
    del buffer
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=0.88, help="bytes to fill, in GB (10^9)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    size = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory(dir=os.path.abspath(".")) as workdir:
        path = os.path.join(workdir, "state.bin")
        with open(path, "wb") as f:
            for _ in range(0, size, 64 << 20):
                f.write(os.urandom(min(64 << 20, size - f.tell())))
        rounds = []
        for _ in range(args.rounds):
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, path, str(size)], capture_output=True, text=True, check=True
            )
            rounds.append(json.loads(done.stdout))
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().strip()
    except OSError:
        mode = "unknown"
    summary = {
        name: {
            "median": statistics.median(r[name] for r in rounds),
            "min": min(r[name] for r in rounds),
            "max": max(r[name] for r in rounds),
        }
        for name in rounds[0]
    }
    print(json.dumps({"bytes": size, "thp": mode, "seconds": summary, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
