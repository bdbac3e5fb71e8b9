"""A zygote of rank servers: one process that imported torch once, forking a server per kernel.

Why
---
Every kernel starts its own rank server (``pool``), and a server's start is an import
of torch and torch._dynamo: about 2 s of CPU, on the same two cores as the kernel's own
imports, and part of it is still in the way when the notebook's first launch comes. A
learner pays that once per kernel. A run that executes dozens of notebooks one after
another (the notebook half of ``make test``, ``make check-labs``) pays it dozens of
times for the same imports.

So such a run starts one zygote first (the repository's ``conftest.py`` does it for
nbval, ``tools/check_labs.py`` for a room, both through ``tools/zygote.py``, from the
directory above ``helpers`` and with the environment their notebooks will have):
``python -c "from helpers.launch.zygote import zygote_entry; zygote_entry()"``, a
process that imports what a server imports, listens on a socket in a private folder
and prints the socket's path. A kernel that finds ``_COURSE_ZYGOTE`` in its
environment asks it for a server (``pool.zygote_server``): the zygote forks, and the
child becomes that kernel's server, exactly as one it had started itself: its own
session (process group), its socket to the kernel, its ranks, dying with the kernel
and taking its ranks with it (``server``). The fork costs milliseconds. The zygote
runs no launch and no learner's code.

When a kernel gets its own server anyway: no zygote in its environment, the zygote gone,
or a difference that a fork would carry over: an environment variable read when torch
is imported (``pool._IMPORT_TIME_ENV``) set differently in the kernel, or a file of the
course changed since the zygote imported it. The zygote refuses those requests and the
kernel starts a server as usual.

How production differs: this is the zygote Android starts apps from, and Python's
``forkserver`` start method, one level up: a forkserver of forkservers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys

__all__ = ["zygote_entry"]



def _reap(*_) -> None:
    """Every server that ended, reaped now: its pid must stop existing at once."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def zygote_entry() -> None:
    """``python -c`` entry: import what a server imports, listen, print the socket's
    path on stdout, then fork a server per request."""
    import cloudpickle

    from helpers.launch.pool import REFUSED, import_time_env, private_dir, server_env
    from helpers.launch.rank import set_process_name
    from helpers.launch.server import module_stamps, serve, preload

    set_process_name("course-zygote")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):                 # die with the caller (Linux)
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)        # PR_SET_PDEATHSIG
    env = import_time_env(server_env())                 # what a server of ours would get
    os.environ.update(server_env())
    preload()
    stamps = module_stamps()
    signal.signal(signal.SIGCHLD, _reap)
    path = os.path.join(private_dir("course-zygote-"), "zygote.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    sys.stdout.write(path + "\n")
    sys.stdout.close()
    while True:
        conn, _ = listener.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 1)
            rundir, their_env = cloudpickle.loads(msg)
            if their_env != env or module_stamps() != stamps or len(fds) != 1:
                conn.sendall(REFUSED)                   # the kernel starts its own
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:                                 # the kernel's server
                try:
                    listener.close()
                    conn.close()
                    os.setsid()                          # its own group, as if started alone
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    set_process_name("course-server")
                    import multiprocessing.connection as mpc

                    serve(mpc.Connection(fds[0]), socket.socket(fileno=os.dup(fds[0])), rundir)
                finally:
                    os._exit(0)
            os.close(fds[0])
            conn.sendall(str(pid).encode())
