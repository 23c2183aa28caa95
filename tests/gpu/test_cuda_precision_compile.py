"""``precision="bf16-mixed"`` and ``torch.compile`` (inductor) on CUDA: exact resumes, no ``_orig_mod.`` in FQNs.

The same scenarios run on CPU in CI (tests/integration/test_mixed_precision.py, test_compile.py).
"""

from __future__ import annotations

from tests._scenarios import check_mixed_state, compiled_module_checkpoints, mixed_state_runs
from tests._spawn import spawn
from tests._trainer import load_result, save_result
from tests.gpu._cuda import GPU, GPU_ENV

pytestmark = GPU


def _bf16_worker(rank: int, world_size: int, tmp: str) -> None:
    results = mixed_state_runs(tmp, accelerator="cuda", precision="bf16-mixed", deterministic=True)
    save_result(tmp, "results", rank, results)


def test_bf16_mixed_on_cuda_resumes_exactly_with_sync_and_async_saves(tmp_path):
    spawn(_bf16_worker, 1, str(tmp_path), env=GPU_ENV)
    check_mixed_state(load_result(str(tmp_path), "results"))


def _compile_worker(rank: int, world_size: int, tmp: str) -> None:
    compiled_module_checkpoints(tmp, accelerator="cuda", backend="inductor")


def test_inductor_compiled_modules_keep_plain_fqns_on_cuda(tmp_path):
    spawn(_compile_worker, 1, str(tmp_path), env=GPU_ENV, timeout=600)
