"""Every results file names its commit, date, machine and command (benchmarks/provenance.py)."""

from __future__ import annotations

import datetime
import os
import subprocess

from benchmarks.provenance import command_line, stamp


def test_a_stamp_names_the_commit_the_date_the_machine_and_the_command():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    stamped = stamp(["--mix", "huge", "--fit-methods", "none,limit"])
    assert set(stamped) == {"commit", "date", "machine", "command"}
    if head.returncode == 0:  # a checkout (an unpacked sdist has no commit to name)
        assert stamped["commit"].split(" ")[0] == head.stdout.strip()
    date = datetime.datetime.strptime(stamped["date"], "%Y-%m-%d %H:%M UTC").replace(tzinfo=datetime.timezone.utc)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - date).total_seconds()) < 120
    assert f"{os.cpu_count()} cores" in stamped["machine"] and "torch " in stamped["machine"]
    assert stamped["command"].endswith(" --mix huge --fit-methods none,limit")


def test_the_command_quotes_what_a_shell_would_split():
    assert command_line(["--out", "a b"]).endswith(" --out 'a b'")
