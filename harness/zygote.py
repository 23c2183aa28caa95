"""A process that has imported torch and Lightning once and forks the ranks of the tests and benchmarks from there.

Importing torch and Lightning takes ~3.5 s of CPU per process on a 2-core CI machine, and the tests start a few hundred
ranks: most of the suite's time went into imports. ``python -m harness.zygote SOCKET`` imports them once, then serves
requests on the Unix socket ``SOCKET``: each request carries a pickled task (unpickled in the child only, so no test
module is ever imported here) and the requester's stdout and stderr descriptors; the zygote forks one child for it and
reports the child's pid, then its wait status.

A child is a real process that ends the way a user's script does: it leaves the zygote's loop, returns to this
module's top level, runs its task there and exits through ``sys.exit``, so the interpreter's whole exit runs
(atexit handlers, thread shutdown, module teardown; an abort there is its exit status). It gets the requester's
environment, working directory, ``sys.path`` and output, and fresh ``random`` / NumPy seeds, as a new process would.
One zygote serves one rank index (harness/ranks.py starts one per rank), so the ranks of a run come from different
interpreters and hash strings differently, as separately started processes do.

The zygote stays single-threaded in Python (it never starts a thread), so forking it is safe; it exits when its
parent (the pytest process) goes away.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import sys
import traceback

_HEADER = struct.Struct("!Q")


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send_message(conn: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    """Send ``obj`` pickled, length-prefixed; ``fds`` ride along with the first bytes (``SCM_RIGHTS``)."""
    data = pickle.dumps(obj)
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(conn, [payload[: _HEADER.size]], fds)
        conn.sendall(payload[sent:])
    else:
        conn.sendall(payload)


def recv_message(conn: socket.socket, *, max_fds: int = 0) -> tuple[object, list[int]]:
    """The next message sent by :func:`send_message` and the descriptors that came with it."""
    fds: list[int] = []
    if max_fds:
        head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, max_fds)
        if not head:
            raise EOFError
        if len(head) < _HEADER.size:
            head += _recv_exactly(conn, _HEADER.size - len(head))
    else:
        head = _recv_exactly(conn, _HEADER.size)
    (length,) = _HEADER.unpack(head)
    return pickle.loads(_recv_exactly(conn, length)), fds


def _serve(path: str) -> tuple[dict, int, int] | None:
    """Serve requests until the parent goes away (returns None), or, in a forked child, return its request."""
    import signal

    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)  # the path appears once connections are accepted
    owners: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    conns: list[socket.socket] = []
    while True:
        if os.getppid() != parent:
            for pid in owners:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return None
        ready, _, _ = select.select([listener, *conns], [], [], 0.02)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                conns.append(conn)
                continue
            try:
                request, fds = recv_message(sock, max_fds=2)
            except (EOFError, OSError):
                conns.remove(sock)
                sock.close()
                continue
            pid = os.fork()
            if pid == 0:  # the child: drop the zygote's sockets, take the requester's output, leave the loop
                listener.close()
                for other in conns:
                    other.close()
                return request, fds[0], fds[1]
            for fd in fds:
                os.close(fd)
            owners[pid] = sock
            send_message(sock, ("started", pid))
        while owners:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = owners.pop(pid, None)
            if conn is not None:
                try:
                    send_message(conn, ("exited", pid, status))
                except OSError:  # the requester went away
                    pass


def _adopt_main(main: tuple[str, str] | None) -> None:
    """Make the requester's ``__main__`` importable as ``__main__`` here, as multiprocessing's spawn does.

    Its module is run under the name ``__mp_main__`` (its ``if __name__ == "__main__"`` block stays unrun).
    """
    import importlib.util
    import runpy
    import types

    if main is None:
        return
    kind, where = main
    if kind == "module":
        spec = importlib.util.find_spec(where)
        path = spec.origin if spec is not None else None
    else:
        path = where
    if path is None:
        return
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _run(request: dict, stdout: int, stderr: int) -> int:
    """In a forked child: become the process the requester asked for, run its task; the exit code."""
    import random

    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    os.close(stdout)
    os.close(stderr)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = request["sys_path"]
    sys.argv[:] = ["-c"]
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        _adopt_main(request.get("main"))
        fn, args = pickle.loads(request["task"])
        fn(*args)
    except BaseException:  # noqa: BLE001 - the requester gets the traceback and the exit code
        text = traceback.format_exc()
        try:
            with open(request["error_file"], "w") as f:
                f.write(text)
        finally:
            sys.stderr.write(text)
            sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    import lightning.pytorch  # noqa: F401
    import numpy  # noqa: F401 - what torch imports; listed to make the preload explicit
    import torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    served = _serve(sys.argv[1])
    if served is not None:
        sys.exit(_run(*served))
