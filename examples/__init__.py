"""Runnable examples: ByteGPT on the standard library sources (see examples/train.py and examples/cli.py)."""
