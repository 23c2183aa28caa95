"""The tier stack: where a checkpoint lives between the training processes and durable storage.

Nearest the GPUs first; each tier commits with the same ``.commit`` marker and checksums as every checkpoint, and a
load of ``last`` takes the newest committed checkpoint across all of them (order recorded at save, never a clock):

- **memory** (:mod:`~lightning_dcp.engine.tiers.memory`): each node's part of a checkpoint in host shared memory
  (``/dev/shm`` or a tmpfs), outliving the training processes; :mod:`~lightning_dcp.engine.tiers.parts` is the
  on-disk format of a node's part, :mod:`~lightning_dcp.engine.tiers.shm_writer` writes it straight from the
  tensors, :mod:`~lightning_dcp.engine.tiers.nodes` maps ranks to nodes;
- **replication** (:mod:`~lightning_dcp.engine.tiers.replication`): each node's part copied to K other nodes over a
  gloo group, and the parts a node lacks fetched from its peers at restore;
- **persistence** (:mod:`~lightning_dcp.engine.tiers.persist`): every Mth memory checkpoint (or on a time schedule,
  and at SIGTERM) copied to the durable tiers below, or kept by each node on its own disk and uploaded by every node
  (:mod:`~lightning_dcp.engine.tiers.node_disks`);
- **local** (:mod:`~lightning_dcp.engine.tiers.local`): ``local_dir``, a local disk in front of a remote directory,
  with its journal (:mod:`~lightning_dcp.engine.tiers.journal`) and reads (:mod:`~lightning_dcp.engine.tiers.reads`);
- **remote** (:mod:`~lightning_dcp.engine.tiers.upload`, :mod:`~lightning_dcp.engine.tiers.uploader`): the object
  store, reached by the local tier's background uploader (and by the memory tier's background thread).
"""

from lightning_dcp.engine.tiers.durable import DurableCatalog
from lightning_dcp.engine.tiers.local import MANIFEST_FILE, Retry, Tiers

__all__ = ["MANIFEST_FILE", "DurableCatalog", "Retry", "Tiers"]
