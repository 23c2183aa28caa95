"""Per-rank random number generator states (torch, CUDA, numpy, python) for checkpoints.

Every rank saves its own states. At the same world size each rank gets its own states back exactly, so random
streams (dropout, augmentation) continue as if the run had never stopped. At another world size the saved streams
cannot map one-to-one onto the new ranks: each rank's states are re-derived deterministically from rank 0's saved
torch state and the new rank, and a warning says so.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import torch

try:  # numpy is optional for lightning_dcp
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with Lightning's dependencies
    np = None

__all__ = ["collect_rng_states", "derive_rng_states", "resume_rng_states", "restore_rng_states"]


def collect_rng_states() -> dict[str, Any]:
    """Return the generator states of this process, in types ``torch.load(weights_only=True)`` accepts."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        states["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back states from :func:`collect_rng_states` (entries this process cannot use are skipped)."""
    torch.set_rng_state(states["torch"])
    random.setstate(_as_tuples(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"][: torch.cuda.device_count()])
    if "numpy" in states and np is not None:
        kind, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def derive_rng_states(rank0_states: dict[str, Any], *, rank: int) -> int:
    """Seed every generator from rank 0's saved torch state and ``rank``; returns the seed used.

    Deterministic: the same checkpoint resumed at the same (new) world size gives the same streams every time.
    """
    seed = (zlib.crc32(rank0_states["torch"].numpy().tobytes()) + 1_000_003 * rank) % 2**32
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)
    return seed


def resume_rng_states(saved: dict[str, Any], *, exact: bool, rank: int) -> bool:
    """Restore this rank's saved states (``exact``: saved at the current world size), else derive them from rank 0's.

    Returns:
        ``exact``: whether the random streams continue exactly (callers warn when they do not).
    """
    if exact:
        restore_rng_states(saved)
    else:
        derive_rng_states(saved, rank=rank)
    return exact


def _as_tuples(value: Any) -> Any:
    # random.setstate needs tuples; a state that travelled through pickling keeps them, lists are converted
    if isinstance(value, list):
        return tuple(_as_tuples(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_as_tuples(v) for v in value)
    return value
