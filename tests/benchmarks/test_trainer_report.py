"""``results/TRAINER.md`` is generated: exactly what ``trainer_report`` renders from ``results/trainer/*.json``."""

from __future__ import annotations

import glob
import os

from benchmarks.trainer_report import report_main

RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "results"
)


def test_the_committed_tables_are_what_the_committed_results_render(tmp_path):
    out = tmp_path / "TRAINER.md"
    assert report_main([str(out), *sorted(glob.glob(os.path.join(RESULTS, "trainer", "*.json")))]) == 0
    with open(os.path.join(RESULTS, "TRAINER.md")) as f:
        committed = f.read()
    assert out.read_text() == committed
    assert "(RESUMES.md)" in committed and os.path.exists(os.path.join(RESULTS, "RESUMES.md"))
