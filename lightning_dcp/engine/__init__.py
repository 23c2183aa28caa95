"""The checkpoint engine: DCP checkpoints of any state dict, knowing nothing of the Trainer or Fabric.

This module is the engine's face: the names the front ends (:mod:`lightning_dcp.trainer`,
:mod:`lightning_dcp.fabric`) and the tools (:mod:`lightning_dcp.tools`) use, re-exported from the rooms below;
they import only these, :mod:`lightning_dcp.engine.state` and :mod:`lightning_dcp.engine.tiers`. Nothing here
imports them. The rooms, each importing only the ones below it:

- :mod:`~lightning_dcp.engine.checkpointer`: the verbs (save, load, remove, wait), made from
  :mod:`~lightning_dcp.engine.config` (:class:`~lightning_dcp.engine.config.CheckpointerConfig`, every option), over
  its save :mod:`~lightning_dcp.engine.transaction`, over
- :mod:`~lightning_dcp.engine.tiers`: memory, local and remote tiers, over
- :mod:`~lightning_dcp.engine.save` and :mod:`~lightning_dcp.engine.load` (which never import each other), over
- :mod:`~lightning_dcp.engine.catalog`: which checkpoints exist, which one a path means, whether they are whole, over
- :mod:`~lightning_dcp.engine.storage`: locations, paths, stores, local files, outputs, remote reads, over
- :mod:`~lightning_dcp.engine.format` and :mod:`~lightning_dcp.engine.state`: bytes and names on disk (no I/O);
  module, optimizer, RNG and loader state;
- at the bottom, imported by any room: :mod:`~lightning_dcp.engine.dist` (who takes part in a call),
  :mod:`~lightning_dcp.engine.agreement` (one failure raised on every rank), :mod:`~lightning_dcp.engine.elastic`,
  :mod:`~lightning_dcp.engine.gc_pause`, :mod:`~lightning_dcp.engine.save_log` and
  :mod:`~lightning_dcp.engine.signal_watch` (a rank stuck in a C call when a signal comes).
"""

from lightning_dcp.engine.catalog.integrity import committed_checkpoints
from lightning_dcp.engine.catalog.lookup import designated, designates_last, source_of, verify_checkpoint
from lightning_dcp.engine.catalog.metadata import parsed_meanwhile_forgotten
from lightning_dcp.engine.checkpointer import Checkpointer
from lightning_dcp.engine.config import CheckpointerConfig
from lightning_dcp.engine.dist import distributed, on_rank0, rank_and_world, single_process_ok
from lightning_dcp.engine.elastic import init_strategy_attempt_group
from lightning_dcp.engine.format import layout
from lightning_dcp.engine.format.allowlist import add_safe_globals
from lightning_dcp.engine.format.marker import is_marker_path
from lightning_dcp.engine.load.loading import (
    Probe,
    foreign_file_at,
    guarded_load,
    not_a_checkpoint_file,
    probe,
    read_torch_file,
)
from lightning_dcp.engine.load.restore import Loaded
from lightning_dcp.engine.load.source import Source, TensorEntry
from lightning_dcp.engine.save.dcp_io import storage_writer
from lightning_dcp.engine.save.step_gate import STEP_GATE
from lightning_dcp.engine.save_log import RestoreRecord, save_metrics
from lightning_dcp.engine.signal_watch import SignalWatch
from lightning_dcp.engine.storage.location import Location, fsync_dir
from lightning_dcp.engine.storage.paths import canonical_url
from lightning_dcp.engine.storage.stores import check_storage_options, is_missing_credentials

__all__ = [
    "Checkpointer",
    "CheckpointerConfig",
    "Loaded",
    "Location",
    "Probe",
    "RestoreRecord",
    "STEP_GATE",
    "SignalWatch",
    "Source",
    "TensorEntry",
    "add_safe_globals",
    "canonical_url",
    "check_storage_options",
    "committed_checkpoints",
    "designated",
    "designates_last",
    "distributed",
    "foreign_file_at",
    "fsync_dir",
    "init_strategy_attempt_group",
    "is_marker_path",
    "is_missing_credentials",
    "layout",
    "guarded_load",
    "not_a_checkpoint_file",
    "on_rank0",
    "parsed_meanwhile_forgotten",
    "probe",
    "rank_and_world",
    "read_torch_file",
    "save_metrics",
    "single_process_ok",
    "source_of",
    "storage_writer",
    "verify_checkpoint",
]
