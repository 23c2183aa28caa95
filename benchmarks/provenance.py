"""Where a result comes from: the commit, the date, the machine and the command, stamped into every results file.

Every script that prints or writes results calls :func:`stamp` once, before it measures (files edited while it runs
do not count), and puts its fields at the top of its JSON object; the Markdown reports quote them.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

__all__ = ["command_line", "commit", "machine", "stamp"]


def commit() -> str:
    """The short commit of the working tree, ``" (with uncommitted changes)"`` appended when tracked files differ."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def machine() -> str:
    """CPU model, cores, memory, the filesystem of the working directory, Python, torch and Lightning versions."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    disk = subprocess.run(["df", "-h", "."], capture_output=True, text=True).stdout.splitlines()[-1].split()[0]
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GB RAM, disk {disk}; Python {platform.python_version()},"
        f" torch {torch.__version__}, lightning {lightning.__version__}"
    )


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: ``python -m benchmarks.<script>`` and its arguments (``argv``, else ``sys.argv[1:]``)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    script = f"-m {spec.name}" if spec is not None else shlex.quote(sys.argv[0])
    return f"python {script} " + shlex.join(sys.argv[1:] if argv is None else argv)


def stamp(argv: list[str] | None = None) -> dict[str, str]:
    """``{"commit", "date", "machine", "command"}`` of a run about to start (the date in UTC, to the minute)."""
    return {
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "command": command_line(argv),
    }
