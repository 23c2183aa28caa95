"""What a resume pays to allocate the optimizer state it reads into, per tensor, in one process.

A resume from the record index gives a fresh optimizer (one that never stepped, so it holds no state) the state the
checkpoint holds by allocating each saved state tensor first, then reading into it
(:func:`~lightning_dcp.engine.state.optimizer_target.fill_pending`). This times that allocation alone for one mix's
model with AdamW: the saved entries are those of the same optimizer after one step (``exp_avg``, ``exp_avg_sq``,
``step`` per parameter), named as a Trainer checkpoint names them (``optimizer_states.0.state.<FQN>.<key>``). Each
round builds a fresh target and fills it; the result is the median and spread of ``--rounds`` rounds, in ms, with
``torch.empty`` of the same shapes and dtypes as a reference (the allocator's own cost).

    python -m benchmarks.state_alloc --mix conv --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.mixes import MIXES, make_module
from benchmarks.provenance import stamp
from lightning_dcp.engine.state.module_state import optimizer_target
from lightning_dcp.engine.state.optimizer_target import fill_pending

PREFIX = "optimizer_states.0."


def saved_entries(module: torch.nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Flat key -> ``(dtype, shape)`` of AdamW's state of ``module`` after one step, as a checkpoint names it."""
    optimizer = torch.optim.AdamW(module.parameters())
    for param in module.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    names = {param: fqn for fqn, param in module.named_parameters()}
    entries = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            entries[f"{PREFIX}state.{names[param]}.{key}"] = (value.dtype, tuple(value.shape))
    module.zero_grad(set_to_none=True)
    return entries


def measure(mix: str, rounds: int) -> dict[str, Any]:
    """Median, min and max (ms) of ``fill_pending`` into a fresh AdamW's target, and of ``torch.empty`` alone."""
    module = make_module(mix)
    entries = saved_entries(module)
    fill, empty = [], []
    for _ in range(rounds):
        tree = {"optimizer_states": [optimizer_target(module, torch.optim.AdamW(module.parameters()))]}
        started = time.perf_counter()
        fill_pending(tree, entries)
        fill.append((time.perf_counter() - started) * 1e3)
        assert len(tree["optimizer_states"][0]["state"]) == len(list(module.parameters()))
        del tree
        started = time.perf_counter()
        made = [torch.empty(shape, dtype=dtype) for dtype, shape in entries.values()]
        empty.append((time.perf_counter() - started) * 1e3)
        del made

    return {
        "mix": mix,
        "tensors": len(entries),
        "rounds": rounds,
        "fill_pending_ms": _spread(fill),
        "torch_empty_ms": _spread(empty),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mix", choices=MIXES, default="conv")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    print(json.dumps({**stamp(argv), **measure(args.mix, args.rounds)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
