"""Which run a memory area's checkpoints belong to: the job where one can be told, else the durable directory's token.

A memory area (``memory_dir``) outlives the processes that wrote it, and nothing stops two jobs from naming the same
one (both write ``memory-step=N.ckpt``). Every part a run commits there records the run's token (``.part``); a
restore takes only the parts that carry this run's token, and leaves the others in place (another live job may own
them) with a warning that names them.

What a run is, in this order:

1. **The job**, where the launcher tells it: the same job restarted is the same run, whatever folder Lightning's
   versioned default (``lightning_logs/version_N``) gives each attempt, and another job is another run, whatever
   folder it names.

   - torchrun: ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; ``--standalone`` makes one per invocation). torchrun's default
     is the literal ``"none"`` for every job: then the agent's own process (its PID and start time, read in
     ``/proc``), which all restarts of one ``torchrun`` invocation share, on rank 0's node.
   - SLURM: ``SLURM_JOB_ID`` (requeued jobs keep it), with ``SLURM_ARRAY_TASK_ID`` where set.

2. **The durable directory** (``dirpath``, where the memory tier persists) otherwise: at its first memory save a run
   makes a random token the file :data:`RUN_FILE` of that directory, unless the file is there already (a restarted
   process finds its own token there). The file is a plain, visible one: emptying the directory (``rm -rf
   dirpath/*``) removes it with the checkpoints, and the next run is a new one.

A directory whose token cannot be read or written (a store that is down) gives a run without a token: its saves
still work; its restores then ignore every memory part (they resume from the durable tiers), with the warning.

Rank 0 reads and writes; its answer is given to every rank by the caller.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from lightning_dcp.engine.storage.localfs import new_token
from lightning_dcp.engine.storage.location import Location

__all__ = ["RUN_FILE", "claim", "job", "read"]

log = logging.getLogger(__name__)

RUN_FILE = "lightning_dcp-memory-run"
"""In a durable directory the memory tier persists into: the token of the run that saves there (a few bytes)."""
_MAX = 256


def job(environ: Mapping[str, str] | None = None) -> str | None:
    """The run token of the job this process belongs to (see the module docstring), or ``None`` where none is told.

    Tokens are letters and digits only (``torchelastic<id>``, ``torchrun<pid>at<start>``, ``slurm<job>[a<task>]``).
    """
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is not None and "TORCHELASTIC_RESTART_COUNT" in env:
        if run_id.strip() and run_id.strip().lower() != "none":
            return "torchelastic" + _alnum(run_id)
        agent = _agent()
        if agent is not None:
            return agent
    slurm = env.get("SLURM_JOB_ID")
    if slurm and slurm.strip():
        task = env.get("SLURM_ARRAY_TASK_ID")
        return "slurm" + _alnum(slurm) + (f"a{_alnum(task)}" if task else "")
    return None


def _alnum(text: str) -> str:
    """``text`` as letters and digits (anything else as its code point in hex), at most 48 characters (hashed)."""
    out = "".join(c if c.isascii() and c.isalnum() else f"x{ord(c):x}" for c in text.strip())
    if len(out) > 48:
        import hashlib

        out = hashlib.sha256(out.encode()).hexdigest()[:48]
    return out


def _agent() -> str | None:
    """The torchelastic agent that started this worker (its parent): PID and start time (clock ticks since boot)."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20 or not re.fullmatch(rb"\d+", fields[19]):
        return None
    return f"torchrun{parent}at{fields[19].decode()}"


def read(directory: Location) -> str | None:
    """The run token (rank 0): the job's, else the one kept in ``directory``.

    ``None``: no memory save there yet, or unreadable.
    """
    told = job()
    if told is not None:
        return told
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
    """The run token (rank 0): the job's, else the one of ``directory``, made (and written there) when it has none.

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
