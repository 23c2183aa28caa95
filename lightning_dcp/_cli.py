"""What the command lines share: ``--storage-options`` parsing and one way to fail (``error: ...``, exit code 1)."""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from lightning_dcp.engine import check_storage_options, is_missing_credentials
from lightning_dcp.errors import CheckpointError

__all__ = ["parse_storage_options", "run_cli"]

_EXPECTED = (CheckpointError, OSError, ValueError, TypeError, RuntimeError)
"""Failures a user can act on from the message alone: no traceback. (Anything else is a bug: its traceback shows.)"""


def parse_storage_options(text: str | None) -> dict[str, Any] | None:
    """The ``--storage-options`` JSON object as a dict (``None`` when not given).

    Raises:
        ValueError: Not valid JSON, or not a JSON object; the message names the option and shows an example.
    """
    if text is None:
        return None
    example = """--storage-options '{"key": "...", "secret": "...", "client_kwargs": {"endpoint_url": "http://..."}}'"""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--storage-options is not valid JSON ({err}); pass a JSON object, e.g. {example}") from err
    try:
        check_storage_options(options, name="--storage-options")
    except TypeError as err:
        raise ValueError(f"{err} For example {example}") from None
    return options


def run_cli(command: Callable[[], int]) -> int:
    """Run ``command``; a failure a user can act on prints ``error: <message>`` on stderr and returns 1.

    A closed stdout (the output piped into ``head``) ends the command quietly with 0.
    """
    try:
        code = command()
        sys.stdout.flush()  # a reader gone now (`... | head`) is seen here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except _EXPECTED as err:
        return _fail(str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}")
    except Exception as err:
        if not is_missing_credentials(err):
            raise
        return _fail(
            f"no credentials were found for the storage ({type(err).__name__}: {err}); pass them with"
            """ --storage-options '{"key": "...", "secret": "..."}' or set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."""
        )


def _reader_gone() -> int:
    """The reader of stdout closed it (``python -m lightning_dcp.inspect ... | head``): stop quietly, exit code 0.

    What is left in stdout's buffer goes to ``os.devnull``, so the interpreter's final flush raises nothing either.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, io.UnsupportedOperation):  # stdout is no file (an in-process caller's capture)
        pass
    return 0


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1
