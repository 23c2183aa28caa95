"""Every benchmark module imports: a name the engine no longer exports fails here, not in a benchmark run."""

from __future__ import annotations

import importlib
import os

import pytest

import benchmarks

MODULES = sorted(
    name[:-3]
    for name in os.listdir(os.path.dirname(benchmarks.__file__))
    if name.endswith(".py") and name != "__init__.py"
)


@pytest.mark.parametrize("name", MODULES)
def test_the_benchmark_module_imports(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__name__ == f"benchmarks.{name}"
