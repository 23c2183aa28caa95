"""Planning and commit costs at thousands of ranks, simulated in one process: time and bytes against the rank count.

For ``N`` simulated ranks (64 ... 16384) saving a 7B-parameter LLaMA-shaped model (32 blocks of 4096-wide attention
and 11008-wide MLP weights, a 32000-token embedding and head; 291 parameters) with AdamW state, no tensor memory:
the state is meta tensors (DDP: every rank holds all of it) or plan objects (FSDP2: rank ``r`` holds rows
``[r * ceil(rows / N), ...)`` of every parameter and its moments, as ``fully_shard`` shards dim 0; HSDP: FSDP2 over
groups of 64 ranks, replicated across the ``N / 64`` groups). Each row of the output is one ``(layout, N)``:

- ``local_plan_s``: one rank's local save planning (``BalancedSavePlanner``; ranks plan in parallel);
- ``coordinator_s`` / ``plans_in_MB`` / ``plans_out_MB``: the coordinator's global planning as
  :func:`lightning_dcp.engine.save.saving.prepare` runs it (signatures grouped, one plan per group of equal plans,
  :func:`~lightning_dcp.engine.save.global_plan.global_plan`) and the pickled bytes it receives and scatters;
- ``dcp_coordinator_s``: for comparison, DCP's own global planning (``create_global_plan`` over all ``N`` local
  plans, each rank's plan received in full), where it fits in this process;
- ``commit_s`` / ``metadata_MB`` / ``commit_MB``: building ``.metadata`` (pickled) and ``.commit`` from every
  rank's compact write results, as the coordinator's ``finish`` does;
- ``validate_s``: a resume's checks on rank 0 (``committed_checkpoints`` over 3 checkpoints of this size, then
  ``check_checkpoint`` of the newest: ``.commit`` parsed and validated, ``.metadata`` unpickled and validated,
  every data file's size; the data files are sparse);
- ``load_plan_s``: one rank's local load planning of the same checkpoint at the same ``N``
  (:class:`~lightning_dcp.engine.load.local_load.FastLoadPlanner`; DTensor targets through DCP's resharding);
- ``save_plan_commit_s``: ``local_plan_s + coordinator_s + commit_s``, the save-side total the issue's goal bounds.

    python -m benchmarks.bench_scale --ranks 64,256,1024,4096,16384 --layouts ddp,hsdp,fsdp2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from lightning_dcp.engine import Location, committed_checkpoints, layout
from lightning_dcp.engine.catalog.integrity import check_checkpoint
from lightning_dcp.engine.format.keys import flatten
from lightning_dcp.engine.format.marker import COMMIT_FILE, METADATA_FILE, encode_commit
from lightning_dcp.engine.save.dcp_io import metadata_pickle
from lightning_dcp.engine.save.global_plan import Group, global_plan, split_private
from lightning_dcp.engine.save.planning import BalancedSavePlanner, plan_signature

HSDP_SHARD = 64
DCP_LIMIT_ITEMS = 3_000_000
"""DCP's own global planning is timed only while all ranks' plans hold at most this many items (memory)."""


def llama_7b() -> list[tuple[str, tuple[int, ...]]]:
    """FQNs and shapes of a LLaMA-7B-like model's parameters (6.7 B)."""
    d, hidden, vocab = 4096, 11008, 32000
    shapes = [("embed.weight", (vocab, d))]
    for i in range(32):
        p = f"layers.{i}."
        shapes += [(p + n, (d, d)) for n in ("q.weight", "k.weight", "v.weight", "o.weight")]
        shapes += [(p + "gate.weight", (hidden, d)), (p + "up.weight", (hidden, d)), (p + "down.weight", (d, hidden))]
        shapes += [(p + "attn_norm.weight", (d,)), (p + "mlp_norm.weight", (d,))]
    return shapes + [("norm.weight", (d,)), ("head.weight", (vocab, d))]


def ddp_state(rank: int) -> dict[str, Any]:
    """One DDP rank's save state (meta tensors): model, AdamW state, param_groups; blobs on rank 0 / per rank."""
    shapes = llama_7b()
    meta = {n: torch.empty(s, device="meta") for n, s in shapes}
    state = {
        layout.MODEL_KEY: meta,
        layout.OPTIMIZER_KEY: [
            {
                "state": {
                    n: {
                        "step": torch.empty((), device="meta"),
                        "exp_avg": t.new_empty(t.shape),
                        "exp_avg_sq": t.new_empty(t.shape),
                    }
                    for n, t in meta.items()
                },
                "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(meta)}],
            }
        ],
        layout.RANK_KEY: {str(rank): b"rng"},
    }
    if rank == 0:
        state[layout.EXTRA_KEY] = b"trainer state"
    return state


def local_plan(state: dict[str, Any], *, rank: int, writers: int) -> SavePlan:
    planner = BalancedSavePlanner(split=writers > 1)
    planner.set_up_planner(state, is_coordinator=rank == 0)
    return planner.create_local_plan()


_PROPS = TensorProperties(dtype=torch.float32)


def _chunk_item(fqn: str, shape: tuple[int, ...], start: int, rows: int) -> WriteItem:
    offsets = torch.Size([start] + [0] * (len(shape) - 1))
    sizes = torch.Size([rows, *shape[1:]])
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), _PROPS, torch.Size(shape)),
    )


def sharded_plan(rank: int, shards: int, *, coordinator: bool) -> SavePlan:
    """The local plan of rank ``rank`` of ``shards`` FSDP2 shards: its dim-0 chunk of every parameter and moment."""
    items = []
    mappings: dict[str, tuple] = {}
    for name, shape in llama_7b():
        step = math.ceil(shape[0] / shards)
        start = rank * step
        if start >= shape[0]:
            continue
        rows = min(step, shape[0] - start)
        keys = [(f"{layout.MODEL_KEY}.{name}", (layout.MODEL_KEY, name))]
        for moment in ("exp_avg", "exp_avg_sq"):
            path = (layout.OPTIMIZER_KEY, 0, "state", name, moment)
            keys.append((".".join(map(str, path)), path))
        for key, path in keys:
            items.append(_chunk_item(key, shape, start, rows))
            mappings[key] = path
    return SavePlan(items, planner_data=mappings)


def _private(rank: int) -> SavePlan:
    key = f"{layout.RANK_KEY}.{rank}"
    items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)]
    mappings = {key: (layout.RANK_KEY, str(rank))}
    if rank == 0:
        items.append(WriteItem(index=MetadataIndex(layout.EXTRA_KEY), type=WriteItemType.BYTE_IO))
        mappings[layout.EXTRA_KEY] = (layout.EXTRA_KEY,)
    return SavePlan(items, planner_data=mappings)


def simulate(kind: str, ranks: int, workdir: str) -> dict[str, Any]:
    """One row of the table (see the module docstring)."""
    row: dict[str, Any] = {"layout": kind, "ranks": ranks}
    writer = FileSystemWriter(os.path.join(workdir, "unused"))
    shards = {"ddp": 1, "fsdp2": ranks, "hsdp": min(HSDP_SHARD, ranks)}[kind]
    start = time.perf_counter()
    if kind == "ddp":
        plan0 = local_plan(ddp_state(0), rank=0, writers=ranks)
        plan1 = local_plan(ddp_state(1), rank=1, writers=ranks)
        row["local_plan_s"] = (time.perf_counter() - start) / 2
        distinct = {0: plan0, 1: plan1}
        shard_of = [0] + [1] * (ranks - 1)
    else:
        distinct = {s: sharded_plan(s, shards, coordinator=s == 0) for s in range(shards)}
        row["local_plan_s"] = (time.perf_counter() - start) / shards
        shard_of = [r % shards for r in range(ranks)]
    # What every rank sends first: its shared-plan signature and private items (only representatives send plans).
    shared = {s: split_private(p)[0] for s, p in distinct.items()}
    signatures = {s: plan_signature(p) for s, p in shared.items()}
    summaries = [(signatures[shard_of[r]], _private(r)) for r in range(ranks)]
    start = time.perf_counter()
    groups: dict[bytes, list[int]] = {}
    for r, (signature, _) in enumerate(summaries):
        groups.setdefault(signature, []).append(r)
    planner = BalancedSavePlanner(split=ranks > 1)
    planner.set_up_planner({}, is_coordinator=True)
    group_list = [Group(members, shared[shard_of[members[0]]]) for members in groups.values()]
    positions, metadata = global_plan(planner, group_list, [p for _, p in summaries])
    scattered = [pickle.dumps(p) for p in positions]  # what scatter_object_list pickles on the coordinator
    row["coordinator_s"] = time.perf_counter() - start
    row["plans_in_MB"] = (len(pickle.dumps(summaries)) + sum(len(pickle.dumps(g.plan)) for g in group_list)) / 1e6
    row["plans_out_MB"] = sum(len(b) for b in scattered) / 1e6
    start = time.perf_counter()  # each rank (in parallel): its final plan from its own local plan
    own = [*shared[shard_of[1]].items, *_private(1).items]
    writer.prepare_global_plan([SavePlan([])] * ranks)
    [own[p] for p in positions[1]]  # noqa: B018
    row["local_plan_s"] += time.perf_counter() - start
    plans = []
    for r in range(ranks):
        items = [*shared[shard_of[r]].items, *_private(r).items]
        plans.append(SavePlan([items[p] for p in positions[r]]))
    row["items"] = sum(len(p.items) for p in plans)
    total_items = sum(len(distinct[shard_of[r]].items) for r in range(ranks))
    if total_items <= DCP_LIMIT_ITEMS:
        everyone = [
            dataclasses.replace(
                distinct[shard_of[r]],
                items=[*split_private(distinct[shard_of[r]])[0].items, *_private(r).items],
            )
            for r in range(ranks)
        ]
        dcp_planner = BalancedSavePlanner(split=ranks > 1)
        dcp_planner.set_up_planner({}, is_coordinator=True)
        start = time.perf_counter()
        dcp_planner.create_global_plan(everyone)
        row["dcp_coordinator_s"] = time.perf_counter() - start
        row["dcp_plans_in_MB"] = (
            sum(len(pickle.dumps(p)) for p in everyone[: min(ranks, 64)]) * ranks / min(ranks, 64) / 1e6
        )
        del everyone
    # The coordinator's finish: every record's location and checksum -> .metadata and .commit.
    compact = []
    sizes: dict[str, int] = {}
    for r, plan in enumerate(plans):
        offset, results = 0, []
        name = f"__{r}_0.distcp"
        for item in plan.items:
            length = 4096 if item.tensor_data is None else item.tensor_data.chunk.sizes.numel() * 4 + 1024
            offsets = None if item.index.offset is None else tuple(item.index.offset)
            results.append((item.index.fqn, offsets, length, name, offset, length, (offset * 2654435761) % (1 << 64)))
            offset += length
        if results:
            sizes[name] = offset
        compact.append(results)
    start = time.perf_counter()
    metadata_bytes = metadata_pickle(metadata, compact)
    files: dict[str, dict[str, Any]] = {}
    for results in compact:
        for _, _, _, name, offset, length, digest in results:
            entry = files.setdefault(name, {"size": 0, "records": []})
            entry["records"].append([offset, length, digest])
            entry["size"] = max(entry["size"], offset + length)
    commit = encode_commit(metadata_bytes=metadata_bytes, files=files)
    row["commit_s"] = time.perf_counter() - start
    row["metadata_MB"] = len(metadata_bytes) / 1e6
    row["commit_MB"] = len(commit) / 1e6
    row["save_plan_commit_s"] = row["local_plan_s"] + row["coordinator_s"] + row["commit_s"]
    # A resume's checks on rank 0: the newest of 3 committed checkpoints, then that one checked.
    run = os.path.join(workdir, f"{kind}-{ranks}")
    for i in range(3):
        directory = os.path.join(run, f"step-{i}")
        os.makedirs(directory)
        for name, size in sizes.items():
            with open(os.path.join(directory, name), "wb") as f:
                f.truncate(size)  # sparse: no disk space
        with open(os.path.join(directory, METADATA_FILE), "wb") as f:
            f.write(metadata_bytes)
        with open(os.path.join(directory, COMMIT_FILE), "wb") as f:
            f.write(encode_commit(metadata_bytes=metadata_bytes, files=files))
    from lightning_dcp.engine.catalog.metadata import _PARSED

    _PARSED.clear()
    start = time.perf_counter()
    newest = committed_checkpoints(Location(run))[0][1]
    loaded_metadata = check_checkpoint(newest)
    row["validate_s"] = time.perf_counter() - start
    shutil.rmtree(run)
    row["load_plan_s"] = _load_plan_seconds(kind, loaded_metadata, shards, ranks)
    return row


def _load_plan_seconds(kind: str, metadata, shards: int, ranks: int) -> float:
    """One rank's local load planning (rank 1: a full replica under DDP, shard 1 otherwise)."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from lightning_dcp.engine.load.local_load import FastLoadPlanner

    start = time.perf_counter()
    if kind == "ddp":
        target = ddp_state(1)
        target[layout.RANK_KEY] = {"1": b""}
        target = {k: v for k, v in target.items() if k != layout.EXTRA_KEY}
        for group in target[layout.OPTIMIZER_KEY][0]["param_groups"]:
            group.clear()
        target[layout.OPTIMIZER_KEY][0].pop("param_groups")
        planner = FastLoadPlanner(allow_partial_load=True)
        # As set_up_planner does for real tensors (meta tensors would be materialised on a device first).
        planner.original_state_dict, planner.metadata, planner.is_coordinator = target, metadata, False
        planner.state_dict, planner.mappings = flatten(target)
        planner.create_local_plan()
    else:  # DTensor targets: DCP's resharding of the rank's own chunk against every saved chunk
        for item in sharded_plan(1, shards, coordinator=False).items:
            md = metadata.state_dict_metadata[item.index.fqn]
            create_read_items_for_chunk_list(item.index.fqn, md, [item.tensor_data.chunk])
    return time.perf_counter() - start


COLUMNS = (
    "layout",
    "ranks",
    "local_plan_s",
    "coordinator_s",
    "commit_s",
    "save_plan_commit_s",
    "dcp_coordinator_s",
    "plans_in_MB",
    "plans_out_MB",
    "metadata_MB",
    "commit_MB",
    "validate_s",
    "load_plan_s",
)


def markdown(rows: list[dict[str, Any]], command: str) -> list[str]:
    """The rows as a markdown table (seconds and MB; ``-`` where not measured)."""
    lines = [
        "# Planning and commit at scale (simulated ranks, one process)",
        "",
        f"Command: `{command}`. Columns: see `benchmarks/bench_scale.py`.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in rows:
        cells = [f"{row[c]:.3f}" if isinstance(row.get(c), float) else str(row.get(c, "-")) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="64,256,1024,4096,16384")
    parser.add_argument("--layouts", default="ddp,hsdp,fsdp2")
    parser.add_argument("--fsdp2-max-ranks", type=int, default=1024, help="larger FSDP2 plans do not fit in memory")
    parser.add_argument("--out", default=None, help="write SCALE.md and scale.json into this directory")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as workdir:
        for kind in args.layouts.split(","):
            for ranks in (int(n) for n in args.ranks.split(",")):
                if kind == "fsdp2" and ranks > args.fsdp2_max_ranks:
                    continue
                rows.append(simulate(kind, ranks, workdir))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        command = "python -m benchmarks.bench_scale " + " ".join(argv if argv is not None else sys.argv[1:])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scale.json"), "w") as f:
            json.dump({"command": command, "rows": rows}, f, indent=2)
        with open(os.path.join(args.out, "SCALE.md"), "w") as f:
            f.write("\n".join(markdown(rows, command)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
