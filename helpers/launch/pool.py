"""The caller's handle on the rank server: start it, talk to it, replace it.

One server per caller process (the notebook's kernel), started by the first
launch (or, in a notebook, when ``helpers`` is imported: ``prestart``) and
kept: later launches fork their ranks from it. It is replaced when it died, or
when a file it imported or an environment variable read at torch's import
changed (a fork would run stale code). Where a run of many notebooks started a
zygote (``zygote.py``; ``_COURSE_ZYGOTE`` in the environment), the server is forked
by it instead of started: the same server, without its seconds of imports.

Where the ranks meet: a folder only this user can enter (``rundir``, made by
``tempfile.mkdtemp``, mode 0700, in /dev/shm where there is one). Each launch's
ranks rendezvous through a ``FileStore`` there, a file per launch, and write
their collective records next to it. torchrun's rendezvous is a ``TCPStore`` on a
port anyone on the machine can connect to and write keys into; on a shared
workshop node another user could join or disturb a learner's launch that way.
A file in a private folder cannot be opened by another (non-root) user, and no
port is listening for the store at all. (The ranks' gloo connections still use
ports at the address the host name resolves to, 127.0.0.1 on most laptops, or on
the interface ``GLOO_SOCKET_IFNAME`` names, as under torchrun.)
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.connection as mpc
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

import cloudpickle

from helpers.launch.errors import RankTimeout
from helpers.launch.shipping import LaunchSpec


# Starting the server imports torch: seconds on a busy laptop, never minutes.
_START_TIMEOUT = 120.0


# Forking the ranks, exiting them, killing them: milliseconds when all is
# well; past this the server is presumed stuck and replaced.
_SERVER_REPLY_TIMEOUT = 30.0


# Environment variables read only when torch (or Python) starts: a change in
# one of these restarts the server, since a fork would keep the old value.
_IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_",
                    "PYTORCH_", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES")


# The repository root: the server must import helpers.launch wherever the
# notebook runs from (course/, labs/, a test's tmp_path).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_time_env(env: dict[str, str] | None = None) -> dict[str, str]:
    return {k: v for k, v in (os.environ if env is None else env).items()
            if k.startswith(_IMPORT_TIME_ENV)}


def server_env() -> dict[str, str]:
    """The environment a rank server starts with: the caller's, marked as the course's
    worker, with the repository on the import path."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, _COURSE_POOL_WORKER="1",
                PYTHONPATH=_ROOT + (os.pathsep + path if path else ""))


# A zygote of servers (zygote.py), where a run of many notebooks started one: the path of
# its socket, and its answer when a fork would not be faithful.
ZYGOTE_ENV = "_COURSE_ZYGOTE"
REFUSED = b"0"


def zygote_server(fd: int, rundir: str, import_env: dict[str, str]) -> "Forked | None":
    """A server forked by the zygote for the caller, talking on the socket ``fd``; None
    when there is no zygote or it refused (the caller starts one of its own)."""
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            socket.send_fds(s, [cloudpickle.dumps((rundir, import_env))], [fd])
            reply = s.recv(64)
    except OSError:
        return None
    if not reply or reply == REFUSED:
        return None
    return Forked(int(reply))


class Forked:
    """The caller's handle on a server a zygote forked: what ``Pool`` needs of a Popen.
    The zygote reaps its children at once, so a pid that no longer exists is a server
    that ended."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return -signal.SIGKILL
        except PermissionError:
            pass
        return None

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
            time.sleep(0.01)
        return -signal.SIGKILL


class ServerGone(Exception):
    """The server closed its socket (it died) before a reply."""


def private_dir(prefix: str) -> str:
    """A new folder only this user can enter (mkdtemp: mode 0700), in memory
    (/dev/shm) where there is one."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


class Pool:
    """The caller's handle on the rank server: its process, the socket to it,
    and the private folder every launch's ranks meet in (``rundir``).

    The server is started with subprocess rather than multiprocessing, which
    would re-import the caller's __main__ (a notebook has none to import, and
    a script without a ``__main__`` guard would recurse); fn travels by value.
    """

    def __init__(self):
        import subprocess

        self.rundir = private_dir("course-launch-")
        self.env_at_start = import_time_env()
        self.ready = False  # set by wait_ready
        self.stamps: dict[str, int] = {}  # filled by the server's "ready"
        self.exits: dict[tuple[int, int], int] = {}  # (generation, rank) -> returncode
        self.pids: dict[int, dict[int, int]] = {}  # generation -> {rank: pid}, while it runs
        self.sock, theirs = socket.socketpair()
        env = server_env()
        try:
            # a zygote's fork where a run of many notebooks started one (zygote.py)
            self.proc = zygote_server(theirs.fileno(), self.rundir, import_time_env(env)) \
                or subprocess.Popen(
                    [sys.executable, "-c",
                     "from helpers.launch.server import server_entry; server_entry()"],
                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                    env=dict(env, _COURSE_POOL_FD=str(theirs.fileno()),
                             _COURSE_POOL_RUNDIR=self.rundir),
                    start_new_session=True)  # its own process group: see server.serve
        finally:
            theirs.close()
        self.conn = mpc.Connection(os.dup(self.sock.fileno()))

    # -- talking to the server ------------------------------------------------

    def _recv(self, timeout: float) -> tuple | None:
        """The next message (an exit report is also filed in ``self.exits``);
        None if nothing came within ``timeout`` seconds."""
        if not self.conn.poll(max(0.0, timeout)):
            return None
        try:
            msg = cloudpickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise ServerGone from None
        if msg[0] == "exit":
            self.exits[msg[1], msg[2]] = msg[3]
        return msg

    def _reply(self, kind: str, timeout: float) -> tuple | None:
        """The next message of this kind (exit reports on the way are filed)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv(deadline - time.monotonic())
            if msg is None or msg[0] == kind:
                return msg

    def wait_ready(self, deadline: float) -> None:
        msg = self._reply("ready", deadline - time.monotonic())
        if msg is None:
            raise RankTimeout("the rank server did not start within the timeout "
                              "(is the machine overloaded?)", [])
        self.stamps = msg[2]
        self.ready = True

    def start_ranks(self, spec: LaunchSpec) -> list[mpc.Connection]:
        """Ask the server to fork the launch's ranks; one socket to each."""
        pairs = [socket.socketpair() for _ in range(spec.world_size)]
        try:
            self.conn.send_bytes(cloudpickle.dumps(("launch", spec)))
            socket.send_fds(self.sock, [b"F"], [theirs.fileno() for _, theirs in pairs])
            started = self._reply("started", _SERVER_REPLY_TIMEOUT)
            if started is None:
                raise ServerGone
            self.pids[spec.generation] = dict(enumerate(started[2]))  # rank -> pid
        except OSError:  # broken pipe: the server died just now
            raise ServerGone from None
        except BaseException:
            for ours, _ in pairs:
                ours.close()
            raise
        finally:
            for _, theirs in pairs:
                theirs.close()
        return [mpc.Connection(ours.detach()) for ours, _ in pairs]

    def exit_code(self, generation: int, rank: int, timeout: float = 2.0) -> int | None:
        """How a rank whose socket closed ended (the server reports it at once)."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(ServerGone):
            while (generation, rank) not in self.exits and time.monotonic() < deadline:
                self._recv(deadline - time.monotonic())
        return self.exits.get((generation, rank))

    def kill_ranks(self, generation: int, world_size: int) -> bool:
        """SIGKILL every rank of the launch and wait until the server saw them
        exit; False if it did not answer."""
        try:
            self.conn.send_bytes(cloudpickle.dumps(("kill", generation)))
            deadline = time.monotonic() + _SERVER_REPLY_TIMEOUT
            while any((generation, r) not in self.exits for r in range(world_size)):
                if time.monotonic() >= deadline:
                    return False
                self._recv(deadline - time.monotonic())
        except (ServerGone, OSError):
            return False
        return True

    # -- the server's life ------------------------------------------------------

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stale(self) -> str | None:
        """Why forks of this server would not be fresh, or None."""
        for path, stamp in self.stamps.items():
            try:
                if os.stat(path).st_mtime_ns != stamp:
                    return f"{os.path.relpath(path)} changed"
            except OSError:
                return f"{os.path.relpath(path)} is gone"
        now = import_time_env()
        changed = sorted(k for k in now.keys() | self.env_at_start.keys()
                         if now.get(k) != self.env_at_start.get(k))
        if changed:
            return f"${changed[0]} changed (it is read when torch is imported)"
        return None

    def kill(self) -> None:
        """SIGKILL the server's process group (it, and every rank) and free the
        sockets and the store now, not whenever the garbage collector runs: a
        traceback that still refers to this object must not hold them open."""
        with contextlib.suppress(Exception):
            os.killpg(self.proc.pid, signal.SIGKILL)  # unreaped: the pid cannot be reused
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)
        for closable in (self.conn, self.sock):
            with contextlib.suppress(Exception):
                closable.close()
        shutil.rmtree(self.rundir, ignore_errors=True)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send_bytes(cloudpickle.dumps(("stop",)))
            self.proc.wait(timeout=3)
        self.kill()


_POOL: Pool | None = None


POOL_LOCK = threading.RLock()


def shutdown() -> None:
    """Stop the rank server (also done automatically when the kernel exits)."""
    global _POOL
    with POOL_LOCK:
        if _POOL is not None:
            _POOL.stop()
            _POOL = None


atexit.register(shutdown)


def kill_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.kill()
        _POOL = None


def prestart() -> None:
    """Start the rank server now, in the background, without waiting for it: the
    first launch then finds torch already imported there. ``helpers`` calls this
    when a notebook imports it, so that the server's start overlaps the
    notebook's own first cells instead of adding seconds to its first launch."""
    global _POOL
    with POOL_LOCK:
        if _POOL is None:
            _POOL = Pool()


def get_pool(world_size: int) -> Pool:
    """The running rank server, or a new one (saying so: it takes seconds, unless a
    zygote forked it)."""
    global _POOL
    if _POOL is not None and not _POOL.ready:  # started ahead (prestart), or a wait was cut short
        _starting(_POOL, world_size)
        _wait_for(_POOL, time.monotonic(), quiet=_forked(_POOL))
    if _POOL is not None:
        why = "the rank server died" if not _POOL.alive() else _POOL.stale()
        if why is None:
            return _POOL
        kill_pool()
        sys.stderr.write(f"[launch] {why}: restarting the rank server ... ")
        restarting = True
    else:
        restarting = False
    start = time.monotonic()
    _POOL = Pool()  # set first, so that an interrupt from here on kills it
    if not restarting:
        _starting(_POOL, world_size)
    _wait_for(_POOL, start, quiet=_forked(_POOL) and not restarting)
    return _POOL


def _forked(pool: Pool) -> bool:
    """Forked by a zygote: ready in milliseconds, nothing to announce."""
    return isinstance(pool.proc, Forked)


def _starting(pool: Pool, world_size: int) -> None:
    if not _forked(pool):
        sys.stderr.write(f"[launch] starting {world_size} ranks. First launch only: a rank "
                         f"server imports torch once (a few seconds); later launches fork "
                         f"fresh ranks from it ... ")


def _wait_for(pool: Pool, start: float, quiet: bool = False) -> None:
    sys.stderr.flush()
    pool.wait_ready(start + _START_TIMEOUT)
    if not quiet:
        sys.stderr.write(f"ready in {time.monotonic() - start:.1f} s\n")
        sys.stderr.flush()
