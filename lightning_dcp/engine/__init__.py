"""The checkpoint engine: DCP checkpoints of any state dict, knowing nothing of the Trainer or Fabric.

Storage (fsspec paths, staging, commit, pointers), the checksumming DCP writer and verifying reader, the ``.commit``
marker, integrity checks, the on-disk layout, async saves and their staging, per-rank RNG states and streaming reads.
The front ends (:mod:`lightning_dcp.trainer`, :mod:`lightning_dcp.fabric`) and the tools (:mod:`lightning_dcp.tools`)
build on it; nothing here imports them.
"""
