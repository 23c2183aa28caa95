"""A forked writer's copy-on-write snapshot against a staging copy, in one process holding a mix and AdamW state.

The design question of issue 23: an async save can snapshot CPU tensors by forking a writer process (the child sees
the memory as it was at the fork; the parent's next writes copy pages on demand) instead of copying them into
staging buffers. Per round, after two warm-up steps: a training step alone (``plain``), the staging copy of the
parameters and AdamW state into reused buffers (``copy``, what lightning_dcp's background thread does), ``fork()``
itself, and the training step right after a fork while the child is alive (``cow``: every page the step writes is
copied first), then the step after that.

    python -m benchmarks.fork_cow --mix huge --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch

try:
    from benchmarks.mixes import MIXES, make_module
except ImportError:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.mixes import MIXES, make_module


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(mix: str, *, scale: float, rounds: int) -> dict:
    torch.set_num_threads(1)
    module = make_module(mix, scale=scale)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    batch = module.train_dataloader().dataset[0][None]

    def step() -> None:
        optimizer.zero_grad()
        module.training_step(batch, 0).backward()
        optimizer.step()

    step()
    step()
    state = [p.detach() for p in module.parameters()]
    state += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    buffers = [torch.empty_like(t) for t in state]
    rows = []
    for _ in range(rounds):
        row = {
            "plain": _seconds(step),
            "copy": _seconds(lambda: [b.copy_(s) for b, s in zip(buffers, state, strict=True)]),
        }
        start = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the writer would write the snapshot here; it only has to outlive the parent's next steps
            time.sleep(60)
            os._exit(0)
        row["fork"] = time.perf_counter() - start
        row["cow"] = _seconds(step)
        row["cow_next"] = _seconds(step)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        rows.append(row)
    nbytes = sum(t.nbytes for t in state)
    median = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
    return {"mix": mix, "scale": scale, "bytes": nbytes, "rounds": rows, "median": median}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mix", choices=MIXES, default="huge")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.mix, scale=args.scale, rounds=args.rounds), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
