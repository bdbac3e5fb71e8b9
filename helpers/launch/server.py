"""The rank server: imports torch once, forks the ranks of every launch.

Starting a Python process that imports torch costs about 2 s on a laptop
core, so the first launch starts one server that imports torch and waits.
Every launch asks it to ``fork()`` fresh ranks: a fork copies the server's
memory lazily (copy-on-write), so a rank with torch imported exists in
milliseconds. This is what Python's ``forkserver`` start method does, and
Android's "zygote" for apps. The server never runs the learner's code.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import os
import signal
import shutil
import socket
import sys

import cloudpickle

from helpers.launch.errors import library_dirs
from helpers.launch.rank import seed_everything, set_process_name, spare_main


def module_stamps() -> dict[str, int]:
    """Files of the project's modules this process imported (not torch, not the
    standard library), with their modification times: if one changes, forks of
    this process would run stale code."""
    lib = library_dirs()
    stamps = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and not os.path.realpath(path).startswith(lib):
            with contextlib.suppress(OSError):
                stamps[path] = os.stat(path).st_mtime_ns
    return stamps


def server_entry() -> None:
    """``python -c`` entry of the rank server."""
    fd = int(os.environ.pop("_COURSE_POOL_FD"))
    rundir = os.environ.pop("_COURSE_POOL_RUNDIR", "")
    set_process_name("course-server")
    # Own process group already (start_new_session); ignoring SIGINT as well
    # means even a signal to our group cannot kill an idle server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    preload()
    serve(mpc.Connection(fd), socket.socket(fileno=os.dup(fd)), rundir)


def preload() -> None:
    """What every fork of the server finds imported (the server's, and a zygote's:
    ``helpers.launch.zygote``)."""
    import torch  # noqa: F401 - the point of the server: every fork has torch imported
    import torch.distributed  # noqa: F401
    # Every optimizer's constructor imports torch._dynamo (for its
    # disable-compile decorator), which imports sympy: 1-2 s of CPU per rank
    # on a quiet core if each rank did it. It starts no thread, so it is safe
    # to import once here and fork.
    import torch._dynamo  # noqa: F401
    import ctypes  # noqa: F401 - each rank uses it (_die_with_server)
    # Work every rank would otherwise repeat: the first seeding imports
    # numpy.random (tens of ms). Nothing here starts a thread or touches CUDA.
    seed_everything(0)


def serve(ctrl: mpc.Connection, sock: socket.socket, rundir: str = "") -> None:
    """The server's loop. Messages from the caller on ``ctrl``:
    ("launch", spec) followed by world_size socket fds -> hand each to a
    spare rank, reply ("started", generation, pids); ("kill", generation) ->
    SIGKILL that launch's ranks; ("stop",). To the caller, for every rank that
    ends: ("exit", generation, rank, returncode), returncode < 0 for a signal.

    Spares: after a launch the server forks as many ranks as it had, ahead of
    the next launch, so that forking is not on that launch's path. They never run anything before their launch."""
    children: dict[int, tuple[int, int]] = {}  # pid -> (generation, rank); 0, -1: a spare
    spares: list[tuple[int, socket.socket]] = []  # (pid, our end of its socket)
    # SIGCHLD wakes the loop through a pipe (Python's set_wakeup_fd), so the
    # server sleeps in one wait() on both the caller and its children.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)

    def send(msg: tuple) -> None:
        ctrl.send_bytes(cloudpickle.dumps(msg))

    # The sockets of the launch being handed out. A spare forked meanwhile
    # must close its copies: a copy held open in another process would hide
    # a rank's death from the caller (its socket would not close).
    handing_out: list[int] = []

    def fork_spare() -> None:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the spare
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                for closable in [ctrl, sock, ours] + [link for _, link in spares]:
                    closable.close()
                for fd in handing_out:
                    os.close(fd)
                os.close(wake_r)
                os.close(wake_w)
                spare_main(theirs, os.getppid())
            finally:
                os._exit(1)
        theirs.close()
        spares.append((pid, ours))
        children[pid] = (0, -1)

    def give_orders(rank: int, blob: bytes, fd: int) -> int:
        """Hand the launch to a spare (forked now if none is left); its pid."""
        while True:
            if not spares:
                fork_spare()
            pid, link = spares.pop(0)
            try:
                orders = mpc.Connection(os.dup(link.fileno()))
                try:
                    orders.send_bytes(blob)
                    orders.send_bytes(str(rank).encode())
                finally:
                    orders.close()
                socket.send_fds(link, [b"F"], [fd])
                return pid
            except OSError:  # that spare died (killed by hand?): take the next
                continue
            finally:
                link.close()

    n_spares = 0  # as many as the last launch had ranks
    with contextlib.suppress(Exception):
        send(("ready", os.getpid(), module_stamps()))
        while True:
            # Refill the spares one at a time, and only while nothing else
            # waits: a launch that arrives meanwhile goes first.
            ready = mpc.wait([ctrl, wake_r], timeout=0 if len(spares) < n_spares else None)
            if not ready:
                fork_spare()
                continue
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            while children:  # reap and report every rank that ended
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                generation, rank = children.pop(pid, (0, -1))
                if generation:
                    send(("exit", generation, rank, os.waitstatus_to_exitcode(status)))
                for spare in [sp for sp in spares if sp[0] == pid]:
                    spares.remove(spare)
                    spare[1].close()
            if ctrl not in ready:
                continue
            msg = cloudpickle.loads(ctrl.recv_bytes())  # EOFError: the caller is gone
            if msg[0] == "launch":
                spec = msg[1]
                while len(spares) < spec.world_size:  # fork before holding the sockets
                    fork_spare()
                _, fds, _, _ = socket.recv_fds(sock, 1, spec.world_size)
                handing_out[:] = fds
                blob = cloudpickle.dumps(spec)
                pids = [give_orders(r, blob, fd) for r, fd in enumerate(fds)]
                for pid, rank in zip(pids, range(spec.world_size)):
                    children[pid] = (spec.generation, rank)
                for fd in fds:
                    os.close(fd)
                handing_out.clear()
                send(("started", spec.generation, pids))
                n_spares = spec.world_size
            elif msg[0] == "kill":
                for pid, (generation, _) in children.items():
                    if generation == msg[1]:
                        os.kill(pid, signal.SIGKILL)
            elif msg[0] == "stop":
                break
    # The caller stopped us or went away: nothing of ours may outlive it. The
    # group is ours alone (start_new_session): ranks, spares, anything they
    # started, us. The caller removes the ranks' meeting folder when it stops us;
    # a caller killed with SIGKILL (an OOM-killed kernel) cannot, so we do.
    if rundir:
        shutil.rmtree(rundir, ignore_errors=True)
    os.killpg(0, signal.SIGKILL)
