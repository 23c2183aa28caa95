"""Processes and stores for the tests and the benchmarks, none of it shipped with the package.

- :mod:`harness.ranks`: run a function on N real processes joined in a gloo group (``spawn``), free loopback ports.
- :mod:`harness.zygote`: the process those ranks are forked from, with torch and Lightning imported once.
- :mod:`harness.s3`, :mod:`harness.stores`: real object stores on loopback (SeaweedFS, fake-gcs-server, Azurite).

The pytest fixtures over them stay in ``tests/``; nothing here imports ``tests`` or the engine's internals.
"""
