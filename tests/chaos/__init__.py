"""The fault-injection campaign (``nox -s chaos``): kill -9 of 2-rank training runs during saves, and fuzzing of every
reader of a checkpoint. ``python -m tests.chaos --help`` for its options; tests/integration/test_chaos.py and
tests/unit/test_fuzz.py run a small slice of both with fixed seeds."""
