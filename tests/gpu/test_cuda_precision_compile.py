"""``precision="bf16-mixed"`` and ``torch.compile`` (inductor) on CUDA: exact resumes, no ``_orig_mod.`` in FQNs.

The same scenarios run on CPU in CI (tests/integration/test_mixed_precision.py, test_compile.py). Both run in one
worker (tests/gpu/_cuda.py).
"""

from __future__ import annotations

from typing import Any

from tests._scenarios import check_mixed_state, compiled_module_checkpoints, mixed_state_runs
from tests.gpu._cuda import GPU, scenarios_fixture

pytestmark = GPU


def _bf16_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    return mixed_state_runs(tmp, accelerator="cuda", precision="bf16-mixed", deterministic=True)


def _compile_worker(rank: int, world_size: int, tmp: str) -> bool:
    compiled_module_checkpoints(tmp, accelerator="cuda", backend="inductor")  # asserts itself
    return True


outcomes = scenarios_fixture([("bf16", _bf16_worker, ()), ("inductor", _compile_worker, ())], timeout=200)


def test_bf16_mixed_on_cuda_resumes_exactly_with_sync_and_async_saves(outcomes):
    check_mixed_state(outcomes("bf16"))


def test_inductor_compiled_modules_keep_plain_fqns_on_cuda(outcomes):
    assert outcomes("inductor") is True
