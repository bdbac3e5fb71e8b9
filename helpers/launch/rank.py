"""The rank's side: one launch in a process freshly forked from the server.

A rank takes the caller's environment, joins a new process group, seeds
every generator, runs ``fn`` once, sends back its result (or its exception
with the traceback) and exits. Its ``print`` reaches the caller line by line
as ``[rank 1] ...``. It dies with the server (``PR_SET_PDEATHSIG`` on Linux),
so no rank outlives the notebook that started it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import io
import linecache
import multiprocessing.connection as mpc
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

import cloudpickle

from helpers.launch import hooks, info, nccl_rules, stacks
from helpers.launch.arguments import group_backend
from helpers.launch.shipping import LaunchSpec

# The launcher's own files: their frames are left out of a rank's traceback.
LAUNCHER_DIR = os.path.dirname(os.path.realpath(__file__)) + os.sep


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np
        np.random.seed(seed % 2**32)


def to_cpu(obj: Any) -> Any:
    """Move tensors in a (nested) result to CPU, detached, so the caller never
    touches CUDA or a rank's autograd graph.

    Looks inside lists, tuples, dicts, NamedTuples (rebuilt as their own type)
    and dataclass instances (a shallow copy with each field converted; the
    original is left as it was); any other object is returned as it is."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj.detach()
    if type(obj) in (list, tuple):
        return type(obj)(to_cpu(o) for o in obj)
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):     # a NamedTuple
        return type(obj)(*(to_cpu(o) for o in obj))
    if type(obj) is dict:
        return {k: to_cpu(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for field in dataclasses.fields(obj):
            if hasattr(obj, field.name):  # (an init=False field may never have been set)
                # object.__setattr__: frozen dataclasses too; no __init__ or __post_init__ rerun
                object.__setattr__(out, field.name, to_cpu(getattr(obj, field.name)))
        return out
    return obj


class _PipeWriter(io.TextIOBase):
    """sys.stdout replacement: sends complete lines to the caller, prefixed."""

    def __init__(self, send: Callable[[tuple], None], rank: int, stream: str):
        self._send, self._prefix, self._stream = send, f"[rank {rank}] ", stream
        self._buf = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self._lock:
            self._buf += s
            if "\n" in self._buf:
                *lines, self._buf = self._buf.split("\n")
                text = "".join(self._prefix + line + "\n" for line in lines)
                self._send(("out", self._stream, text))
        return len(s)

    def flush(self) -> None:
        with self._lock:
            if self._buf:
                self._send(("out", self._stream, self._prefix + self._buf + "\n"))
                self._buf = ""


def _die_with_server(server_pid: int) -> None:
    """A rank must not outlive its server (which dies with the caller).

    PR_SET_PDEATHSIG fires when the *thread* that forked us ends; the server
    forks from its only thread, so that is the server's death."""
    try:  # Linux
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # elsewhere (macOS): poll for a new parent
        def watch():
            while os.getppid() == server_pid:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != server_pid:  # the server died before prctl took effect
        os._exit(1)


def set_process_name(name: str) -> None:
    """What ``ps``/``pgrep`` show (Linux, 15 characters): course-server,
    course-spare (forked ahead, never ran anything), course-rank."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _become_fresh(spec: LaunchSpec) -> None:
    """Take the caller's environment, directory and import path, as a rank
    started now by the caller would have them."""
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(spec.environ)
    os.environ["_COURSE_POOL_WORKER"] = "1"  # launch() inside a rank is refused
    os.chdir(spec.cwd)
    sys.path[:] = spec.sys_path  # so functions pickled by reference import
    # torch.distributed read TORCH_DISTRIBUTED_DEBUG when the server imported
    # it; read it again, from the caller's environment.
    dist.set_debug_level_from_env()
    if "OMP_NUM_THREADS" not in spec.environ:
        # N ranks on C cores: C // N intra-op threads each, as torchrun does with
        # OMP_NUM_THREADS. More threads than cores makes every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))


def _user_frames(exc: BaseException) -> list[tuple[str, int, str, str]]:
    """The rank's traceback without the launcher's frames: the learner's code first."""
    return [(f.filename, f.lineno or 0, f.name, f.line or "")
            for f in traceback.extract_tb(exc.__traceback__)
            if not os.path.realpath(f.filename).startswith(LAUNCHER_DIR)]


def spare_main(link: socket.socket, server_pid: int) -> None:
    """A rank forked ahead of time, before its launch: it sets up what does not
    depend on the launch (death with the server), then waits for its orders: its
    rank, the launch, and the socket to the caller."""
    set_process_name("course-spare")
    _die_with_server(server_pid)
    orders = mpc.Connection(os.dup(link.fileno()))
    try:
        spec = cloudpickle.loads(orders.recv_bytes())
        rank = int(orders.recv_bytes())
        _, fds, _, _ = socket.recv_fds(link, 1, 1)
    except Exception:  # the server went away before using us
        os._exit(0)
    orders.close()
    link.close()
    set_process_name("course-rank")
    _rank_main(mpc.Connection(fds[0]), rank, spec)


def launch_store(spec: LaunchSpec):
    """The store this launch's ranks meet in: a file of its own in the caller's
    private folder (see helpers.launch.pool), opened by all ``world_size`` ranks."""
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(spec.rundir, f"launch{spec.generation}.store"),
                           spec.world_size)
    store.set_timeout(datetime.timedelta(seconds=spec.pg_timeout))
    return store


def _rank_main(conn: mpc.Connection, rank: int, spec: LaunchSpec) -> None:
    """One rank of one launch: join the group, run fn, report, exit. Never returns."""
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        data = cloudpickle.dumps(msg)
        with send_lock:
            conn.send_bytes(data)

    try:
        import torch
        import torch.distributed as dist

        _become_fresh(spec)
        hooks.set_record_path(hooks.record_path(spec.rundir, spec.generation, rank))
        stacks.arm(spec.rundir, spec.generation, rank)  # where it is, if it outlives the timeout
        device = "cpu"
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        info.set_rank_info(info.RankInfo(rank, spec.world_size, rank, spec.backend, device,
                                         spec.nccl_rules))
        sys.stdout = _PipeWriter(send, rank, "stdout")
        sys.stderr = _PipeWriter(send, rank, "stderr")
        store = launch_store(spec)
        dist.init_process_group(
            group_backend(spec.backend), store=store, rank=rank, world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.pg_timeout))
        if spec.nccl_rules:
            nccl_rules.install(dist.PrefixStore("nccl_rules", store), spec.pg_timeout)
        linecache.cache.update(spec.sources)  # the cells' lines, for tracebacks
        fn, args, kwargs = cloudpickle.loads(spec.payload)
        seed_everything(spec.seed + rank if spec.seed_per_rank else spec.seed)
        result = to_cpu(fn(*args, **kwargs))
        sys.stdout.flush(); sys.stderr.flush()
        try:
            send(("result", result))
        except Exception as exc:  # unpicklable result
            send(("error", "TypeError", f"result of rank {rank} could not be sent back: {exc}",
                  traceback.format_exc(), [], None))
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: report, don't die
        with contextlib.suppress(Exception):
            sys.stdout.flush(); sys.stderr.flush()
        try:
            original = cloudpickle.dumps(exc)
        except Exception:
            original = None
        with contextlib.suppress(Exception):
            send(("error", type(exc).__name__, str(exc), traceback.format_exc(),
                  _user_frames(exc), original))
    # Stay until the caller has every rank's answer ("bye", or the socket
    # closes): a rank that exits early would break a peer still finishing
    # its last collective with it.
    with contextlib.suppress(BaseException):
        conn.recv_bytes()
    os._exit(0)
