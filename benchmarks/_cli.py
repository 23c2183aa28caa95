"""The command line every ``bench_*.py`` script shares: size, repeats and a work directory, JSON on stdout."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

try:
    from benchmarks.provenance import stamp
except ImportError:  # run as a script
    from provenance import stamp


def bench_main(
    run: Callable[..., dict],
    argv: list[str] | None,
    *,
    doc: str | None,
    default_size_gb: float,
    prefix: str,
    world_size: bool = False,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> int:
    """Parse ``--size-gb --repeats --workdir [--world-size]``, call ``run(size_gb, workdir, repeats=...)``, print JSON.

    ``options`` adds a script's own flags (``{"--smoke": {"action": "store_true"}}``), passed to ``run`` as keywords
    (``smoke=...``). Without ``--workdir`` a temporary directory is used and removed afterwards.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=default_size_gb)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="default: a temporary directory, removed afterwards")
    if world_size:
        parser.add_argument("--world-size", type=int, default=2)
    for flag, spec in (options or {}).items():
        parser.add_argument(flag, **spec)
    args = parser.parse_args(argv)
    stamped = stamp(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix=prefix)
    kwargs = {"repeats": args.repeats, **({"world_size": args.world_size} if world_size else {})}
    for flag in options or {}:
        name = flag.lstrip("-").replace("-", "_")
        kwargs[name] = getattr(args, name)
    try:
        print(json.dumps({**stamped, **run(args.size_gb, workdir, **kwargs)}, indent=2))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0
