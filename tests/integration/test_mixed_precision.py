"""bf16-mixed precision with bf16 and fp32 state, sync and async saves: exact resumes (GPU twin: tests/gpu)."""

from __future__ import annotations

from tests._scenarios import check_mixed_state, mixed_state_runs


def test_bf16_mixed_with_bf16_and_fp32_state_resumes_exactly_sync_and_async(tmp_path):
    check_mixed_state(mixed_state_runs(str(tmp_path), accelerator="cpu", precision="bf16-mixed"))
