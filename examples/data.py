"""``StdlibTextDataModule``: byte-level language-modelling data from the Python standard library's source files.

Every ``.py`` file under the standard library directory (``sysconfig.get_paths()["stdlib"]``, recursively, in
sorted order, ``site-packages`` excluded) is concatenated as raw bytes: roughly 30 MB of real code that ships with
every Python. The bytes are cached as one ``torch.uint8`` tensor file so that repeated runs, and every DDP process,
load one file instead of re-reading thousands.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_DEFAULT_CACHE = "~/.cache/lightning_dcp_example"


def find_source_files(root: str | os.PathLike) -> list[Path]:
    """All ``.py`` files below ``root`` in sorted order, skipping ``site-packages`` and ``__pycache__``.

    Args:
        root: Directory to search.

    Returns:
        Sorted absolute paths.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found)


def _cache_key(root: Path, files: list[Path]) -> str:
    """A digest of the file listing (path, size, mtime) so a changed tree gets a fresh cache file."""
    h = hashlib.sha256(str(root).encode())
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        h.update(f"{f.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def build_corpus(files: list[Path]) -> torch.Tensor:
    """Concatenate the raw bytes of ``files`` (unreadable ones skipped) into a ``torch.uint8`` tensor."""
    chunks = []
    for f in files:
        try:
            chunks.append(f.read_bytes())
        except OSError:
            continue
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def _save_atomic(tensor: torch.Tensor, path: Path) -> None:
    """``torch.save`` to a temporary file in ``path``'s directory, then ``os.replace`` it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(tensor, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ByteWindows(Dataset):
    """Non-overlapping windows over a byte tensor: item ``i`` is ``(x, y)`` with ``y`` ``x`` shifted by one.

    Args:
        data: 1-D ``torch.uint8`` tensor.
        block_size: Window length.
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


class StdlibTextDataModule(pl.LightningDataModule):
    """The standard library's Python sources as a byte-level next-token dataset.

    The last ``val_fraction`` of the bytes is the validation split. Under DDP, ``prepare_data`` (rank 0 of each
    node) writes the cache file once and ``setup`` (every rank) loads it.

    Args:
        block_size: Sequence length of each example.
        batch_size: Examples per batch (per process).
        num_workers: DataLoader worker processes.
        val_fraction: Fraction of the bytes (taken from the end) held out for validation.
        root: Directory whose ``.py`` files form the corpus; defaults to the standard library directory.
        cache_dir: Where the cached tensor goes; defaults to ``~/.cache/lightning_dcp_example``.
    """

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 16,
        num_workers: int = 0,
        val_fraction: float = 0.01,
        root: str | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.save_hyperparameters()
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.root = Path(root or sysconfig.get_paths()["stdlib"]).expanduser().resolve()
        self.cache_dir = Path(cache_dir or _DEFAULT_CACHE).expanduser()
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    @property
    def cache_file(self) -> Path:
        """The cache file for the current contents of ``root``."""
        return self.cache_dir / f"stdlib-{_cache_key(self.root, find_source_files(self.root))}.pt"

    def prepare_data(self) -> None:
        """Build the byte cache unless it already exists (runs once per node, on local rank 0)."""
        files = find_source_files(self.root)
        target = self.cache_dir / f"stdlib-{_cache_key(self.root, files)}.pt"
        if target.exists():
            return
        if not files:
            raise FileNotFoundError(f"No .py files under {self.root}.")
        corpus = build_corpus(files)
        _save_atomic(corpus, target)
        rank_zero_info(f"Cached {len(corpus) / 1e6:.1f} MB from {len(files)} files under {self.root} -> {target}")

    def setup(self, stage: str | None = None) -> None:
        """Load the cached bytes and split them into train and validation windows."""
        if self.train_set is not None:
            return
        path = self.cache_file
        if not path.exists():  # e.g. ``setup`` called directly, without ``prepare_data``
            self.prepare_data()
        data = torch.load(path, weights_only=True)
        split = int(len(data) * (1.0 - self.val_fraction))
        self.train_set = ByteWindows(data[:split], self.block_size)
        self.val_set = ByteWindows(data[split:], self.block_size)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training windows (Lightning swaps in a seeded ``DistributedSampler`` under DDP)."""
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation windows in order."""
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
