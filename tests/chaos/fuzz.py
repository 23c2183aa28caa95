"""Fuzzing every reader of a checkpoint with hypothesis: ``.commit``, ``.metadata``, pointers, the blob, data records,
the codec's tags inside the blob, the record index of ``.commit``, ElasticResume's saved state.

Each reader gets hostile input of its own kind (tests/chaos/_inputs.py), written into a copy of a real committed
checkpoint with the checksums made consistent where that takes the input deeper (so only validation can catch it).
Then the reader itself and the public entry points that use it run on it. Allowed outcomes: a
``CheckpointError`` subclass, or a successful load of exactly what the files hold. Anything else is a finding:
another exception, a hang (a per-example time limit), a jump of the process's peak memory (or a refusal that says
memory could not be allocated: the reader tried to allocate what a number claimed), a file created by unpickling
(``Payload`` and friends), or a load that returns state that was never saved.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import time
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from tests.chaos._checks import Finding, Stats, address_space_headroom, guard
from tests.chaos.index_reader import IndexReader
from tests.chaos.readers import READER_CLASSES, Template
from tests.chaos.state_reader import ElasticStateReader

READERS = ("commit", "metadata", "pointer", "blob", "record", "codec", "index", "elastic")


def _plain(data: Any) -> Any:
    """``data`` without hypothesis's draw object (record fuzzing draws its bytes inside the test)."""
    if isinstance(data, tuple):
        return tuple(_plain(d) for d in data if not isinstance(d, st.DataObject))
    return data


def fuzz_reader(
    name: str,
    *,
    root: str,
    examples: int,
    seed: int,
    keep_going: bool,
    timeout_s: float = 20.0,
    memory_mb: float = 400.0,
    artifacts: str | None = None,
    tolerate: tuple[str, ...] = (),
) -> Stats:
    """Run ``examples`` hypothesis examples (seeded) against one reader.

    With ``keep_going`` every finding is recorded and the run goes on (the campaign); without, the first finding
    fails (hypothesis shrinks it and reports the smallest input: the CI tests). ``artifacts``: a directory where each
    finding's whole input is pickled. ``tolerate``: kinds of finding that are recorded but never fail the run (known
    and reported elsewhere).
    """
    os.makedirs(root, exist_ok=True)
    template = Template(os.path.join(root, name))
    stats = Stats(name)
    readers = {**READER_CLASSES, IndexReader.name: IndexReader, ElasticStateReader.name: ElasticStateReader}
    reader = readers[name](template, stats)
    phases = [Phase.explicit, Phase.generate] if keep_going else [Phase.explicit, Phase.generate, Phase.shrink]

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis_seed(seed)
    @given(reader.strategy())
    def run(data: Any) -> None:
        stats.examples += 1
        try:
            with guard(timeout_s, memory_mb, stats.interpreter_notes):
                stats.outcomes[reader.check(data)] += 1
            if os.path.exists(template.marker) or os.path.exists("chaos-pwned"):
                raise Finding("code-ran", "unpickling created the payload's marker file")
        except Finding as finding:
            for path in (template.marker, "chaos-pwned"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            record = {"kind": finding.kind, "detail": finding.detail, "input": repr(data)[:400]}
            if artifacts is not None and len(stats.findings) < 50:  # the whole input, to reproduce it
                os.makedirs(artifacts, exist_ok=True)
                record["file"] = os.path.join(artifacts, f"{name}-{len(stats.findings)}.pkl")
                with contextlib.suppress(Exception), open(record["file"], "wb") as f:
                    pickle.dump(_plain(data), f)
            stats.findings.append(record)
            if not keep_going and finding.kind not in tolerate:
                raise

    started = time.perf_counter()
    try:
        with address_space_headroom(3072):
            run()
    finally:
        stats.seconds = time.perf_counter() - started
        shutil.rmtree(template.root, ignore_errors=True)
    return stats
