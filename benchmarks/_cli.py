"""The command line every ``bench_*.py`` script shares: size, repeats and a work directory, JSON on stdout."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Callable


def bench_main(
    run: Callable[..., dict],
    argv: list[str] | None,
    *,
    doc: str | None,
    default_size_gb: float,
    prefix: str,
    world_size: bool = False,
) -> int:
    """Parse ``--size-gb --repeats --workdir [--world-size]``, call ``run(size_gb, workdir, repeats=...)``, print JSON.

    Without ``--workdir`` a temporary directory is used and removed afterwards.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=default_size_gb)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="default: a temporary directory, removed afterwards")
    if world_size:
        parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix=prefix)
    kwargs = {"repeats": args.repeats, **({"world_size": args.world_size} if world_size else {})}
    try:
        print(json.dumps(run(args.size_gb, workdir, **kwargs), indent=2))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0
