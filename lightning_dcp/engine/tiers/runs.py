"""Which run a memory area's checkpoints belong to: a token kept in the run's durable directory and in every part.

A memory area (``memory_dir``) outlives the processes that wrote it, and nothing stops two jobs from naming the same
one (both write ``memory-step=N.ckpt``). A *run* is what resumes its own state across restarts: its durable
directory (``dirpath``, where the memory tier persists). At its first memory save a run makes a random token the
file :data:`RUN_FILE` of that directory, unless the file is there already (a restarted job finds its own token
there), and every part it commits in a memory area records the token (``.part``). A restore reads the token of the
directory it resumes from and takes only the parts that carry it: parts of another run (another ``dirpath``, or the
same path emptied and started afresh), and parts written before tokens existed, are ignored, with a warning naming
them and the area. They are never deleted (another live job may own them);
:meth:`~lightning_dcp.engine.tiers.memory.MemoryTier.close` with ``free_at_end`` frees this run's own parts only.

A directory whose token cannot be read or written (a store that is down) gives a run without a token: its saves
still work; its restores then ignore every memory part (they resume from the durable tiers), with the warning.

Rank 0 reads and writes the file; its answer is given to every rank by the caller.
"""

from __future__ import annotations

import logging

from lightning_dcp.engine.storage.localfs import new_token
from lightning_dcp.engine.storage.location import Location

__all__ = ["RUN_FILE", "claim", "read"]

log = logging.getLogger(__name__)

RUN_FILE = ".lightning_dcp-memory-run"
"""In a durable directory the memory tier persists into: the token of the run that saves there (a few bytes)."""
_MAX = 256


def read(directory: Location) -> str | None:
    """The run token kept in ``directory``, or ``None`` (no memory save there yet, or unreadable). Rank 0."""
    try:
        with directory.open(RUN_FILE) as f:
            token = f.read(_MAX).decode("ascii").strip()
    except FileNotFoundError:
        return None
    except Exception as err:  # a store that is down, a file that is not ours: no token, the restore says so
        log.warning("lightning_dcp: cannot read the memory tier's run token in %s: %s", directory.url, err)
        return None
    return token if token.isalnum() else None


def claim(directory: Location) -> str | None:
    """The run token of ``directory``, made (and written there) when it has none. Rank 0.

    Returns ``None`` where it can be neither read nor written (logged): saves go on without a token.
    """
    token = read(directory)
    if token is not None:
        return token
    token = new_token()
    try:
        with directory.open(RUN_FILE, "wb") as f:
            f.write(token.encode("ascii"))
    except Exception as err:
        log.warning("lightning_dcp: cannot write the memory tier's run token in %s: %s", directory.url, err)
        return None
    return token
