"""``python -m lightning_dcp.consolidate CKPT_DIR [--output FILE]``: one Lightning ``.ckpt`` from a checkpoint.

Run with ``--help`` for the options. The function is :func:`lightning_dcp.consolidate`.
"""

from __future__ import annotations

import sys
import types

from lightning_dcp._consolidate import consolidate, main

__all__ = ["consolidate", "main"]


class _CallableModule(types.ModuleType):
    # Importing this module binds ``lightning_dcp.consolidate`` to the module, shadowing the function of the same
    # name that ``lightning_dcp`` exports; calling the module calls the function, so both spellings keep working.
    def __call__(self, *args, **kwargs):  # noqa: D102
        return consolidate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
