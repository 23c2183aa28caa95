"""What a replicated (DDP) resume cannot go below on this machine: every rank's bytes read into fresh memory.

``bench_trainer --tasks load`` compares a resume with one cold sequential read of the checkpoint's bytes. A DDP
resume at world size W does more than that read, whatever the library: each of the W ranks needs every byte of the
state in its own memory, and the optimizer's state lands in memory the process has never touched (a fresh optimizer
holds none), which the kernel must map and zero page by page. The model's weights land in memory the model's
constructor already touched.

Each round writes ``--weights-gb`` + ``--optimizer-gb`` of bytes into one file and evicts it from the page cache
(``posix_fadvise(DONTNEED)``), then measures, alternating:

- ``read``: one fresh process reads the file sequentially in 64 MiB blocks into one reused buffer (what
  ``bench_trainer`` calls the cold read);
- ``floor``: ``--world-size`` fresh processes, started together, each with the weights' bytes already allocated and
  touched, read the whole file into those bytes and into a fresh, untouched buffer for the optimizer's bytes,
  64 MiB per ``readinto`` (no parsing, no planning, no Python objects per tensor): the time from the first start to
  the last finish, less the processes' start-up (each reports when it began reading);
- ``fresh``: the same ranks, file already in the page cache: the copy and the fresh memory without the disk.

``read / floor`` is the highest "resume vs cold read" ratio any replicated resume could reach here.

    python -m benchmarks.resume_floor --weights-gb 0.44 --optimizer-gb 0.88 --rounds 3   # BERT-base's shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

BLOCK = 64 << 20

_RANK = """
import json, mmap, os, sys, time
path, weights, optimizer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
model = mmap.mmap(-1, weights)
for offset in range(0, weights, mmap.PAGESIZE):  # the model's constructor has touched its weights
    model[offset] = 1
fresh = mmap.mmap(-1, optimizer)  # a fresh optimizer's state: nothing mapped yet
began = time.time()
with open(path, "rb", buffering=0) as f:
    for target, size in ((model, weights), (fresh, optimizer)):
        view = memoryview(target)
        done = 0
        while done < size:
            n = f.readinto(view[done:done + min(64 << 20, size - done)])
            assert n, "short file"
            done += n
        view.release()
print(json.dumps({"began": began, "ended": time.time()}))
"""

_READ = """
import json, sys, time
buffer = bytearray(64 << 20)
began = time.time()
with open(sys.argv[1], "rb", buffering=0) as f:
    while f.readinto(buffer):
        pass
print(json.dumps({"began": began, "ended": time.time()}))
"""


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write(path: str, size: int) -> None:
    block = os.urandom(BLOCK)
    with open(path, "wb", buffering=0) as f:
        left = size
        while left:
            left -= f.write(block[: min(BLOCK, left)])
        os.fsync(f.fileno())


def _ranks(code: str, args: list[str], world_size: int) -> float:
    """Seconds from the first rank's start of reading to the last rank's end."""
    procs = [subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE) for _ in range(world_size)]
    times = [json.loads(p.communicate()[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("a rank failed")
    return max(t["ended"] for t in times) - min(t["began"] for t in times)


def floor_file(directory: str, weights: int, optimizer: int) -> str:
    """Write the ``weights + optimizer`` bytes :func:`floor_seconds` reads into ``directory``; its path."""
    path = os.path.join(directory, "floor-state.bin")
    _write(path, weights + optimizer)
    return path


def floor_seconds(path: str, weights: int, optimizer: int, world_size: int) -> float:
    """One ``floor`` round (module docstring) over the file of :func:`floor_file`, evicted from the page cache first."""
    _evict(path)
    return _ranks(_RANK, [path, str(weights), str(optimizer)], world_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights-gb", type=float, default=0.44)
    parser.add_argument("--optimizer-gb", type=float, default=0.88)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the file goes (the disk the checkpoints use)")
    args = parser.parse_args(argv)
    weights, optimizer = int(args.weights_gb * 1e9), int(args.optimizer_gb * 1e9)
    results: dict[str, list[float]] = {"read": [], "floor": [], "fresh": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = floor_file(tmp, weights, optimizer)
        rank_args = [path, str(weights), str(optimizer)]
        for _ in range(args.rounds):
            _evict(path)
            results["read"].append(_ranks(_READ, [path], 1))
            results["floor"].append(floor_seconds(path, weights, optimizer, args.world_size))
            results["fresh"].append(_ranks(_RANK, rank_args, args.world_size))  # in the page cache now
    ratios = [r / f for r, f in zip(results["read"], results["floor"], strict=True)]
    print(
        json.dumps(
            {
                "bytes": weights + optimizer,
                "world_size": args.world_size,
                **{k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in results.items()},
                "read_over_floor": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
