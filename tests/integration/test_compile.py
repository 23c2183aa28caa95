"""``torch.compile``d modules under a real Trainer: checkpoint FQNs never carry ``_orig_mod.`` (GPU twin: tests/gpu)."""

from __future__ import annotations

from tests._scenarios import compiled_module_checkpoints


def test_compiled_modules_save_resume_and_load_under_plain_fqns(tmp_path):
    compiled_module_checkpoints(str(tmp_path), accelerator="cpu", backend="eager")
