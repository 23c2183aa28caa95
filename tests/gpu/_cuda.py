"""The GPU tier's marks and process settings: every test in tests/gpu needs CUDA and carries the ``gpu`` marker.

``pytest -m gpu`` (or ``nox -s gpu``) selects the tier; without a CUDA device each test is skipped with the reason
"needs a CUDA device", so CI (``nox -s tests``) collects and skips it. Workers run in fresh spawned processes
(tests/_spawn.py) so each gets its own CUDA context and NCCL group.
"""

from __future__ import annotations

import pytest
import torch

__all__ = ["CUDA", "GPU", "GPU_ENV"]

CUDA = torch.cuda.is_available()

GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
"""``pytestmark = GPU`` in every module of this tier."""

GPU_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Set before cuBLAS starts in a worker: with ``Trainer(deterministic=True)`` reruns are bitwise equal."""
