"""Process groups of a restarted torchelastic attempt: keys of their own in the agent's store.

Under ``torchrun`` the workers' ``env://`` rendezvous connects to the store the elastic agent hosts at
``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``). That store lives as long as the agent, across
``--max-restarts`` attempts, and torch 2.13 no longer prefixes the workers' keys by attempt
(``torch.distributed.rendezvous._create_c10d_store``: "We create a new TCPStore for every retry", which neither the
static nor the c10d rendezvous backend does). The keys of a process group are named by the group's name ("0" for the
default group, "1", "2", ... for later ones), the same in every attempt, so a restarted worker can read the address a
peer of the previous attempt published and fail with "Gloo connectFullMesh failed ... Connection refused", or take
an old barrier count and hang. Whether the new value or the stale one is read is a race: some restarts work.

Minimal reproduction, no Lightning (3 failures in 3 tries here; a fresh prefix per attempt fixes it)::

    # torchrun --nproc-per-node 2 --max-restarts 1 repro.py
    import os, signal, time
    import torch.distributed as dist
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")  # attempt 1: Gloo connectFullMesh failed ... Connection refused
    dist.barrier()
    if attempt == 0 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1 if attempt else 30)

:func:`attempt_store` gives the default process group a view of the agent's store under a prefix of this attempt
(``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``, the world size), the scheme torch itself used before; the
groups made later (``dist.new_group``, the memory tier's, async saves') take their keys under the same prefix.
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["attempt_prefix", "attempt_store", "init_attempt_process_group", "init_strategy_attempt_group"]


def attempt_prefix() -> str | None:
    """The key prefix of this torchelastic attempt, or ``None`` when not under an elastic agent's store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    world_size = os.environ.get("WORLD_SIZE", "?")
    return f"lightning_dcp/{run_id}/attempt_{attempt}/world_{world_size}/"


def attempt_store(*, host: str, port: int, timeout: timedelta) -> dist.Store | None:
    """A client of the elastic agent's store whose keys belong to this attempt; ``None`` when not under an agent.

    Pass it as ``store=`` to ``init_process_group`` (with ``rank`` and ``world_size``). Every rank of one attempt
    gets the same prefix: torchelastic restarts all workers together and counts the restarts on every agent.
    """
    prefix = attempt_prefix()
    if prefix is None or not dist.is_available():
        return None
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    return dist.PrefixStore(prefix, client)


def init_attempt_process_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout: timedelta | None,
    device: torch.device | None = None,
) -> bool:
    """Under an elastic agent: join the default process group through :func:`attempt_store`; else do nothing.

    What Lightning's ``_init_dist_connection`` does (``init_process_group(backend, rank, world_size, timeout,
    device_id)``, NCCL groups destroyed at exit) with the store of this attempt; Lightning's own call then finds the
    group made and returns. Returns whether it made the group.

    Collective: call on all ranks.
    """
    if not dist.is_available() or dist.is_initialized():
        return False
    timeout = timeout if timeout is not None else timedelta(minutes=30)
    store = attempt_store(host=host, port=port, timeout=timeout)
    if store is None:
        return False
    kwargs = {"device_id": device} if device is not None and device.type != "cpu" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    if "nccl" in backend:
        atexit.register(_destroy)
    return True


def init_strategy_attempt_group(strategy: Any) -> bool:
    """:func:`init_attempt_process_group` with what a Lightning strategy (Trainer's or Fabric's) knows of the run.

    Reads its ``cluster_environment`` (ranks, main address and port), process-group backend, timeout and root device;
    the caller has set the strategy's world ranks first (Lightning names that step differently in the Trainer and in
    Fabric). Returns whether it made the group; ``False`` without a cluster environment or outside an elastic agent.

    Collective: call on all ranks.
    """
    environment = strategy.cluster_environment
    if environment is None:
        return False
    return init_attempt_process_group(
        strategy._get_process_group_backend(),
        rank=environment.global_rank(),
        world_size=environment.world_size(),
        host=environment.main_address,
        port=environment.main_port,
        timeout=strategy._timeout,
        device=strategy.root_device,
    )


def _destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
