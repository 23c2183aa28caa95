"""The GPU tier's marks, process settings and its one-process-per-module runner.

``pytest -m gpu`` (or ``nox -s gpu``) selects the tier; without a CUDA device each test is skipped with the reason
"needs a CUDA device", so CI (``nox -s tests``) collects and skips it. Workers run in new interpreters
(``harness.ranks.spawn(..., fresh=True)``: never forked from a process that may have touched CUDA) so each gets its own
CUDA context and NCCL group.

Starting a worker (Python, torch, Lightning, a CUDA context, NCCL) costs more than most scenarios, so a module's
scenarios share one worker (:func:`scenarios_fixture`): the worker runs them one after the other, each in its own
directory, and records each one's result or traceback; each test then checks its own scenario. A scenario that
fails is reported by its test, with the worker's traceback, and the others still run.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from harness.ranks import spawn
from tests._trainer import load_result, save_result

__all__ = ["CUDA", "GPU", "GPU_ENV", "Scenario", "scenarios_fixture"]

CUDA = torch.cuda.is_available()

GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
"""``pytestmark = GPU`` in every module of this tier."""

GPU_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Set before cuBLAS starts in a worker: with ``Trainer(deterministic=True)`` reruns are bitwise equal."""

Scenario = tuple[str, Callable[..., Any], tuple]
"""``(name, fn, args)``: the worker calls ``fn(rank, world_size, directory, *args)`` and keeps what it returns."""


def _scenarios_worker(rank: int, world_size: int, tmp: str, scenarios: list[Scenario]) -> None:
    for name, fn, args in scenarios:
        directory = os.path.join(tmp, name)
        os.makedirs(directory, exist_ok=True)
        try:
            outcome = ("passed", fn(rank, world_size, directory, *args))
        except Exception:
            outcome = ("failed", traceback.format_exc())
        save_result(tmp, f"outcome-{name}", rank, outcome)


class Outcomes:
    """The recorded outcome of each scenario of one worker run (see :func:`scenarios_fixture`)."""

    def __init__(self, tmp: str, error: BaseException | None) -> None:
        self.tmp, self.error = tmp, error

    def __call__(self, name: str, rank: int = 0) -> Any:
        """What scenario ``name`` returned; fails the calling test with the worker's traceback if it failed."""
        if not os.path.exists(os.path.join(self.tmp, f"outcome-{name}.rank{rank}.pt")):
            pytest.fail(f"the GPU worker ended before scenario {name!r} finished: {self.error!r}", pytrace=False)
        status, value = load_result(self.tmp, f"outcome-{name}", rank)
        if status == "failed":
            pytest.fail(f"scenario {name!r} failed in the GPU worker:\n{value}", pytrace=False)
        return value

    def directory(self, name: str) -> str:
        return os.path.join(self.tmp, name)


def scenarios_fixture(scenarios: list[Scenario], *, world_size: int = 1, timeout: float = 300.0) -> Any:
    """A module-scoped fixture running ``scenarios`` in one worker per module, once; it yields :class:`Outcomes`.

    The worker's own failure (a crash, or ``timeout`` seconds passed) is reported by the tests whose scenarios did not
    finish. Without CUDA nothing runs (every test of the tier is skipped before it asks for the fixture).
    """

    @pytest.fixture(scope="module")
    def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Outcomes:
        tmp = str(tmp_path_factory.mktemp("gpu"))
        error: BaseException | None = None
        try:
            spawn(_scenarios_worker, world_size, tmp, scenarios, env=GPU_ENV, timeout=timeout, fresh=True)
        except Exception as exc:  # reported by the tests whose scenarios have no outcome
            error = exc
        return Outcomes(tmp, error)

    return outcomes
