"""``python -m lightning_dcp [COMMAND] [ARGS]``: the command lines of lightning_dcp, listed, or one of them run.

``python -m lightning_dcp`` (or ``--help``) lists the commands; ``python -m lightning_dcp verify CKPT`` is
``python -m lightning_dcp.verify CKPT``, and likewise for every command.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "consolidate": "a checkpoint as one Lightning .ckpt (or safetensors) file, streamed tensor by tensor",
    "inspect": "what a checkpoint holds (names, shapes, dtypes, bytes, world size, step) without reading tensor data",
    "verify": "every byte of a checkpoint against the checksums recorded at save",
    "upgrade": "Lightning's checkpoint upgrade, for checkpoint directories too",
}
"""The commands, each ``python -m lightning_dcp.<name>`` with a ``main(argv) -> int``."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m lightning_dcp COMMAND [ARGS]   (COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:{width}}  {what}" for name, what in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``COMMAND`` with the remaining arguments; without one (or with ``-h``/``--help``) list the commands.

    Returns the command's exit code; 0 for the list; 2 for an unknown command (the list goes to stderr).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        return importlib.import_module(f"lightning_dcp.{args[0]}").main(args[1:])
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    print(f"{usage()}\n\nerror: unknown command {args[0]!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
