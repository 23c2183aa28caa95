"""``python -m lightning_dcp.consolidate CKPT_DIR``: one ``.ckpt`` or safetensors export of a sharded checkpoint.

Run with ``--help`` for the options and examples. The function is ``lightning_dcp.consolidate``.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Sequence

from lightning_dcp._cli import parse_storage_options, run_cli
from lightning_dcp.tools.consolidate import DTYPES, FORMATS, SUFFIX, consolidate

__all__ = ["consolidate", "main"]

_EXAMPLES = f"""\
examples:
  python -m lightning_dcp.consolidate checkpoints/last.ckpt
      full Lightning checkpoint (weights, optimizer, loops, ...) -> checkpoints-<the checkpoint last.ckpt
      designates>{SUFFIX}, beside the checkpoints directory
  python -m lightning_dcp.consolidate checkpoints/last.ckpt -o model.safetensors --dtype bf16
      model weights only, cast to bfloat16, one safetensors file
  python -m lightning_dcp.consolidate checkpoints/last.ckpt -o hf_model --max-shard-size 5GB
      hf_model/model-00001-of-0000N.safetensors + hf_model/model.safetensors.index.json
  python -m lightning_dcp.consolidate s3://bucket/run/step=100.ckpt -o weights.ckpt --weights-only \\
      --exclude 'head.*' --storage-options '{{"anon": false}}'
  python -m lightning_dcp.consolidate fabric_ckpts/step-000100 -o step-100.pt
      a Fabric checkpoint -> the dict fabric.save was given, in one file (fabric.load reads it)
  python -m lightning_dcp.inspect checkpoints/last.ckpt
      list what a checkpoint holds without reading tensor data

Inputs: lightning_dcp checkpoints (Trainer or Fabric), Lightning's own sharded checkpoints (a DCP directory with
meta.pt) and plain DCP directories. Memory stays near one read batch plus the largest tensor, whatever the
checkpoint size.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dcp.consolidate",
        description="Stream a sharded DCP checkpoint directory into one Lightning .ckpt file or safetensors.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("checkpoint", help="checkpoint directory (local path or fsspec URL)")
    parser.add_argument(
        "--output",
        "-o",
        default=None,
        help=f"output path (default: DIRPATH-NAME{SUFFIX}, beside the directory of checkpoints)",
    )
    parser.add_argument("--format", choices=FORMATS, default=None, help="default: from --output's suffix")
    parser.add_argument("--weights-only", action="store_true", default=None, help="model weights only")
    parser.add_argument("--full", dest="weights_only", action="store_false", help="everything (default for ckpt)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast floating-point tensors")
    parser.add_argument("--include", action="append", default=[], metavar="GLOB", help="keep matching FQNs")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB", help="drop matching FQNs")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE", help="sharded safetensors, e.g. 5GB")
    parser.add_argument("--storage-options", default=None, metavar="JSON", help="fsspec options as a JSON object")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=None, help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point. Returns the exit code: 0 on success, 1 on failure (``error: ...`` on stderr)."""
    args = _parser().parse_args(argv)

    def run() -> int:
        dst = consolidate(
            args.checkpoint,
            dst=args.output,
            storage_options=parse_storage_options(args.storage_options),
            overwrite=args.overwrite,
            format=args.format,
            weights_only=args.weights_only,
            dtype=args.dtype,
            include=args.include,
            exclude=args.exclude,
            max_shard_size=args.max_shard_size,
            progress=args.progress,
        )
        print(dst)
        return 0

    return run_cli(run)


class _CallableModule(types.ModuleType):
    # Importing this module binds ``lightning_dcp.consolidate`` to the module, shadowing the function of the same
    # name that ``lightning_dcp`` exports; calling the module calls the function, so both spellings keep working.
    def __call__(self, *args, **kwargs):  # noqa: D102
        return consolidate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
