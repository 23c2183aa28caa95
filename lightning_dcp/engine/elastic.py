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

The attempt's prefix cannot come from ``TORCHELASTIC_RESTART_COUNT``: each agent counts its own restarts, so after a
node is replaced the survivors' workers say 1 and the new node's say 0 (torch's issue #135712 has the same root), and
their process group waits for a peer under another prefix until it times out. The ranks of one start therefore
agree on a token in the store (:func:`agree_attempt`), and :func:`attempt_store` gives the default process group a
view of the agent's store under a prefix of that token; the groups made later (``dist.new_group``, the memory tier's,
async saves') take their keys under the same prefix.

Torch's own rendezvous has a second fault of this kind that no worker can mend: with the shared store (the default),
when the node of group rank 0 survives and another node is replaced, the surviving agent does not publish the
store's address for the new round and the new node's agent waits for it until the rendezvous times out. Running the
agents with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it (``docs/memory-tier.md``).
"""

from __future__ import annotations

import atexit
import os
import time
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "agree_attempt",
    "attempt_prefix",
    "attempt_store",
    "init_attempt_process_group",
    "init_strategy_attempt_group",
    "under_agent_store",
]

_ATTEMPTS = "lightning_dcp/attempts/"
_POLL_S = 0.005  # rank 0's pause between looks at the store while ranks arrive


def under_agent_store() -> bool:
    """Whether this worker's ``env://`` store is the elastic agent's (``TORCHELASTIC_USE_AGENT_STORE=True``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def agree_attempt(store: dist.Store, *, rank: int, world_size: int, timeout: timedelta) -> str:
    """A token (32 hex characters) that every rank of this start of the job gets and no earlier start had.

    Each rank but 0 appends a fresh nonce to one key of ``store`` and waits for the key named by its nonce; rank 0
    makes a token and writes it under every nonce it finds (an earlier start's too: nobody waits for those) until
    ``world_size - 1`` ranks have counted themselves in under its token. Nothing here depends on what an earlier start
    left in the store or on any rank's restart count. Rank 0 looks every 5 ms; the others wait in the store.

    Collective: call on all ranks (with the same ``world_size``), each with a client of the same store.

    Raises:
        TimeoutError: Rank 0, when the other ranks have not all arrived within ``timeout``.
        torch.distributed.DistStoreError: Another rank, when rank 0 has not answered within the store's timeout.
    """
    if world_size == 1:
        return uuid.uuid4().hex
    hellos = f"{_ATTEMPTS}world_{world_size}/hellos"
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.append(hellos, f"{nonce},")
        token = store.get(f"{_ATTEMPTS}token/{nonce}").decode()
        store.add(f"{_ATTEMPTS}joined/{token}", 1)
        return token
    token = uuid.uuid4().hex
    joined = f"{_ATTEMPTS}joined/{token}"
    answered = 0  # characters of ``hellos`` already answered
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        if store.check([hellos]):
            seen = store.get(hellos).decode()
            nonces = [nonce for nonce in seen[answered:].split(",") if nonce]
            if nonces:
                store.multi_set([f"{_ATTEMPTS}token/{nonce}" for nonce in nonces], [token] * len(nonces))
            answered = len(seen)
        if store.add(joined, 0) >= world_size - 1:
            return token
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"lightning_dcp: {store.add(joined, 0)} of the {world_size - 1} other ranks of this elastic attempt"
                f" arrived within {timeout}; the rest did not start or cannot reach the agent's store"
            )
        time.sleep(_POLL_S)


def attempt_prefix(token: str) -> str:
    """The key prefix of the attempt that agreed on ``token`` (:func:`agree_attempt`)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    world_size = os.environ.get("WORLD_SIZE", "?")
    return f"lightning_dcp/{run_id}/attempt_{token}/world_{world_size}/"


def attempt_store(*, host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.Store | None:
    """A client of the elastic agent's store whose keys belong to this attempt; ``None`` when not under an agent.

    Pass it as ``store=`` to ``init_process_group`` (with ``rank`` and ``world_size``).

    Collective: call on all ranks (:func:`agree_attempt`).
    """
    if not under_agent_store() or not dist.is_available():
        return None
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    token = agree_attempt(client, rank=rank, world_size=world_size, timeout=timeout)
    return dist.PrefixStore(attempt_prefix(token), client)


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
    store = attempt_store(host=host, port=port, rank=rank, world_size=world_size, timeout=timeout)
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
