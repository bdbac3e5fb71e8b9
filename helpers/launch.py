"""Run one Python function on N ranks, from a notebook cell, and never hang.

Every chapter of the course ends up calling::

    from helpers import launch, rank_info

    def step():
        info = rank_info()
        t = torch.ones(1) * info.rank
        dist.all_reduce(t)
        return t.item()

    launch(step, 4)          # -> [6.0, 6.0, 6.0, 6.0], one value per rank

How it works
------------
* ``launch`` ships ``fn`` *by value* with cloudpickle, so a function defined in
  a notebook cell (and everything it closes over) reaches the ranks.
* **Fresh ranks for every launch, from a rank server.** Starting a Python
  process that imports torch costs about 2 s on a laptop core. So the first
  launch starts one helper process, the *rank server*, that imports torch once
  and then waits. Every launch asks it to ``fork()`` ``world_size`` new ranks:
  a fork copies the server's memory lazily (copy-on-write), so a rank with
  torch already imported exists in a few milliseconds. Each rank runs ``fn``
  once, inside a new process group, and exits. This is what Python's
  ``forkserver`` start method does, and what Android's "zygote" does for apps.
  To keep forking off a launch's path, the server forks the next launch's
  ranks ahead of time ("spares", which run nothing until their launch).
  ``ps`` shows them as course-server, course-spare and course-rank.
* What a launch carries over from the caller (the notebook), read at the time
  of the call: the environment variables (``os.environ``; so
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` set in a cell takes effect at the next
  launch), the working directory and ``sys.path``. What it does *not* carry
  over: anything an earlier launch did in its ranks (default dtype, grad
  mode, imported or reloaded modules, global hooks, threads, random state),
  because those ranks are gone; and anything the notebook did to its own
  torch (``torch.set_default_dtype`` in the notebook does not reach the
  ranks: set it inside ``fn``). Modules that ``fn`` uses by reference
  (``from mymodule import f``) are imported afresh by each rank, so an edited
  file runs its new code. The server itself has imported torch and
  ``helpers.launch``; if one of the course's files it imported changes on
  disk, or an environment variable that is read only when torch is imported
  (``OMP_*``, ``MKL_*``, ``TORCH_LOGS``, ``PYTHON*``, ...) changes, the next
  launch restarts the server and says so.
* Cost: the first launch pays the server's start (importing torch, once);
  every later launch, of any world size, costs forking the ranks (or taking
  the spares), one rendezvous and one round trip, and a fresh process runs
  its first collective slower than a warm one: about a tenth of a second
  for 4 ranks on a quiet 2-core laptop, several times more on a busy one,
  against tens of milliseconds when ranks were reused and seconds for
  ``torch.multiprocessing.spawn`` (``benchmarks/bench_launch.py`` measures
  all three).
* Rendezvous: the caller owns a ``TCPStore`` listening on 127.0.0.1 on a port
  the operating system picks (port 0). Nothing is chosen then released, so two
  launches at once, or another program, cannot steal the port. Each launch
  uses its own key prefix in it.
* The caller waits on every rank's socket at once, with a deadline (a rank
  that dies closes its socket, so a death is seen at once). Three ways a
  launch can fail, and what you get:

  - a rank raises: ``RankError`` naming the rank, the exception type, message
    and the rank's own traceback. In a notebook it shows only the rank, the
    exception and the frames of your code (``err.rank_traceback`` has all).
  - a rank dies (``os._exit``, SIGKILL, a segfault): ``RankError`` naming the
    rank and how it died (exit code or signal).
  - a deadlock: ``RankTimeout`` after ``timeout`` seconds naming the ranks that
    did not finish. The process group's own timeout is set a little longer, so
    the launcher, not gloo, reports it.

  In every case, and on Ctrl-C (Jupyter's "interrupt"), all of the launch's
  ranks are gone when the exception reaches you, and the kernel is untouched.
  The server stays: it never runs your code, so nothing can go wrong in it.
* Lifetime: the server and its ranks run in their own process group, so the
  SIGINT that Jupyter sends to the kernel's group for an unrelated cell does
  not touch them; they watch the socket to the caller instead, and die when
  the caller's process ends (whichever thread started them). A server that
  did die is replaced by the next launch, silently.
* ``print`` inside a rank reaches the caller line by line as ``[rank 1] ...``.
* Under ``torchrun`` (RANK and WORLD_SIZE set in the environment) ``launch``
  does not spawn anything: it runs ``fn`` in the current process's group and
  returns every rank's result (gathered with ``all_gather_object``), so the same
  chapter code runs multi-node unchanged.

Seeding: before ``fn`` runs, every rank calls ``torch.manual_seed(seed)``
(and seeds ``random`` and numpy) with the *same* ``seed`` (default 0), so a
rank's random numbers equal a single-process reference's. Pass
``seed_per_rank=True`` to seed rank r with ``seed + r`` instead.

How the production tools differ: ``torchrun``/``torch.multiprocessing.spawn``
start fresh interpreters for every job (each imports torch) and rely on the
job being a script; an elastic agent restarts failed workers. A notebook
needs cheap repeated launches of small functions and a clean error instead of
a restart. Forking needs a POSIX system (Linux, macOS) and a server that has
not initialized CUDA: ours only imports (as a DataLoader's forked workers,
it relies on OpenBLAS, which numpy loads, being safe to fork).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import io
import itertools
import linecache
import marshal
import multiprocessing.connection as mpc
import os
import pickle
import random
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import types
from typing import Any, Callable

import cloudpickle

__all__ = ["launch", "rank_info", "RankInfo", "RankError", "RankTimeout", "shutdown"]

# Extra seconds the process group waits beyond the launch timeout, so that the
# launcher's deadline (which names the stuck ranks) fires before gloo's own.
_PG_TIMEOUT_MARGIN = 30.0
# After a rank raised an error of its own or died (a root cause), how long
# to keep listening for the other ranks' errors, for the "(then: ...)" line.
# A connection error alone never ends the wait: see _collect.
_GRACE = 1.0
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
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Who am I? Available inside ``fn`` through ``rank_info()``."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str  # "cpu" or "cuda:<local_rank>"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class RankError(RuntimeError):
    """A rank raised an exception or died. ``.rank`` is the root-cause rank.

    ``str(err)`` has everything (summary and the rank's full traceback);
    ``err.frames`` holds the rank's frames without the launcher's own, as
    ``(filename, lineno, function, source line)``. In IPython/Jupyter the error
    is shown by ``_render_traceback_``: the summary, then those frames, with
    frames inside installed libraries (torch, the standard library) folded.
    """

    def __init__(self, message: str, rank: int, exc_type: str | None = None,
                 rank_traceback: str | None = None,
                 frames: list[tuple[str, int, str, str]] | None = None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.rank_traceback = rank_traceback
        self.frames = frames or []
        # Set when the ranks recorded their collectives (helpers.debug):
        # rank -> [CallRecord], and the cross-rank diff that ends the message.
        self.records: dict[int, list] | None = None
        self.diff: str | None = None

    def _render_traceback_(self) -> list[str]:
        """What IPython prints instead of the caller-side traceback (which would
        show only the launcher's internals): the rank, the exception, your lines."""
        summary = str(self).split("\n\n--- traceback of rank")[0]
        lines = [f"{type(self).__name__}: {summary}"]
        if self.frames:
            lines.append(f"Traceback of rank {self.rank} (most recent call last):")
            lines += _format_frames(self.frames)
        if self.rank_traceback:
            lines.append(f"(all of rank {self.rank}'s frames: sys.last_value.rank_traceback)")
        if self.diff and self.rank_traceback:  # (a timeout's summary has it already)
            lines += ["", self.diff]
        return lines


class RankTimeout(RankError):
    """Some ranks did not finish before the deadline (usually a deadlock)."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message, rank=ranks[0] if ranks else -1, exc_type="timeout")
        self.ranks = ranks


def _library_dirs() -> tuple[str, ...]:
    """Where installed code lives (stdlib, site-packages), as real paths."""
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep
                  for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def _format_frames(frames: list[tuple[str, int, str, str]]) -> list[str]:
    """Traceback lines for a rank's frames: the course's and the learner's in
    full, each run of library frames folded into one line. A notebook cell's
    source exists only in the kernel, so a line the rank could not read is
    looked up here, where IPython has cached every cell."""
    lib = _library_dirs()
    out: list[str] = []
    folded: list[str] = []

    def flush():
        if folded:
            home = max((d for d in lib if folded[0].startswith(d)), key=len)  # site-packages
            where = os.path.relpath(folded[0], home)                          # inside stdlib
            out.append(f"  ... {len(folded)} frame(s) inside {where.split(os.sep)[0]}")
            folded.clear()

    for filename, lineno, name, line in frames:
        real = os.path.realpath(filename)
        if real.startswith(lib):
            folded.append(real)
            continue
        flush()
        line = line or linecache.getline(filename, lineno).strip()
        out.append(f'  {_cell_name(filename, lineno)}, in {name}')
        if line:
            out.append(f"    {line}")
    flush()
    return out


def _cell_name(filename: str, lineno: int) -> str:
    """``Cell In[3], line 5`` for a notebook cell (as IPython names it), else the file."""
    with contextlib.suppress(Exception):
        from IPython import get_ipython
        count = get_ipython().compile._filename_map[filename]
        return f"Cell In[{count}], line {lineno}"
    return f'File "{filename}", line {lineno}'


_RANK_INFO: RankInfo | None = None
# Inside a rank: the file its collective recorder appends to (see _record_path).
_RECORD_PATH: str | None = None


def _record_path(store_port: int, generation: int, rank: int) -> str:
    """Where a rank's collective record goes: a file per rank, in memory
    (/dev/shm) where there is one. Appending costs a write() per call, and
    unlike a message on the rank's socket it wakes nobody: the caller reads the
    files only when a launch fails, including when the rank hangs or is killed
    (what was written before is there). The store's port (held by this caller)
    and the launch's number make the name unique."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"course-record-{store_port}-{generation}-{rank}")


def _caller_channel() -> Callable[[tuple], None] | None:
    """Inside a launch's rank: a function that appends an event to this rank's
    record file, for the caller (None outside a launch). Each event is one
    length-prefixed pickle, written with one write() call."""
    if _RECORD_PATH is None:
        return None
    fd = os.open(_RECORD_PATH, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def append(event: tuple) -> None:
        data = pickle.dumps(event)
        os.write(fd, len(data).to_bytes(8, "little") + data)
    return append


def _read_records(store_port: int, generation: int, n: int) -> dict[int, list[tuple]]:
    """Every rank's recorded events; a frame cut short (a rank killed while
    writing it) is dropped. (``launch`` removes the files when the ranks are gone.)"""
    out: dict[int, list[tuple]] = {}
    for rank in range(n):
        path = _record_path(store_port, generation, rank)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            continue
        events, at = [], 0
        while at + 8 <= len(blob):
            size = int.from_bytes(blob[at:at + 8], "little")
            if at + 8 + size > len(blob):
                break
            events.append(pickle.loads(blob[at + 8:at + 8 + size]))
            at += 8 + size
        out[rank] = events
    return out


def rank_info() -> RankInfo:
    """Rank, world size, backend and device of the calling rank.

    Outside ``launch`` (and outside torchrun) this is rank 0 of a world of 1.
    """
    if _RANK_INFO is not None:
        return _RANK_INFO
    if _under_torchrun():
        return _torchrun_info()
    return RankInfo(0, 1, 0, "none", "cpu")


# --------------------------------------------------------------------------
# Backend choice and argument checks: all happen before any rank starts.
# --------------------------------------------------------------------------

def _resolve_backend(backend: str, world_size: int) -> str:
    import torch
    import torch.distributed as dist

    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', not {backend!r}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        # One GPU per rank or none at all: sharing a GPU between nccl ranks
        # is not supported by nccl, so fall back to gloo on CPU.
        return "nccl" if n_gpus >= world_size and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("backend='nccl' asked for, but this torch build has no nccl "
                               "(a CPU build?). Use backend='gloo' or 'auto'.")
        if n_gpus < world_size:
            raise RuntimeError(f"backend='nccl' needs one GPU per rank: {world_size} ranks asked "
                               f"for, {n_gpus} GPU(s) visible. Use fewer ranks or backend='gloo'.")
    return backend


def _group_backend(backend: str) -> str:
    """What init_process_group gets. An nccl job also gets gloo for CPU
    tensors: nccl moves only CUDA tensors, and a rank function that keeps the
    tiny model (or a counter, or a list of results) on the CPU should still run
    on a GPU node rather than fail with "no backend for device cpu"."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def _check_args(fn: Callable, world_size: Any, timeout: Any) -> None:
    if not callable(fn):
        raise TypeError(f"launch needs a function to run on every rank, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    cores = os.cpu_count() or 1
    if world_size > max(64, 8 * cores):
        raise ValueError(f"world_size={world_size} local ranks on {cores} cores would thrash; "
                         f"use at most {max(64, 8 * cores)} (or torchrun across machines)")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


# --------------------------------------------------------------------------
# torchrun mode: run in the existing group, gather every rank's result.
# --------------------------------------------------------------------------

def _under_torchrun() -> bool:
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ
            and os.environ.get("_COURSE_POOL_WORKER") != "1")


def _torchrun_info() -> RankInfo:
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = dist.get_backend() if dist.is_initialized() else "none"
    backend = "nccl" if "nccl" in backend else backend  # "cpu:gloo,cuda:nccl" is an nccl job
    device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
    return RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank,
                    backend, device if torch.cuda.is_available() or device == "cpu" else "cpu")


def _destroy_group_at_exit() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()  # no rank tears down while a peer still talks to it
        dist.destroy_process_group()


def _launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout, seed, seed_per_rank):
    import torch
    import torch.distributed as dist

    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"launch(..., world_size={world_size}) under torchrun with "
                         f"WORLD_SIZE={env_world}: pass the job's world size")
    if not dist.is_initialized():
        # Every process must pick the same backend, so decide on what they all
        # see alike (GPUs per node vs processes per node), never on this
        # process's own LOCAL_RANK: with 1 GPU and 2 processes that would give
        # rank 0 nccl and rank 1 gloo, and the job fails at the first collective.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        backend = _resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(_group_backend(backend),
                                timeout=datetime.timedelta(seconds=timeout))
        # We made the group, so we take it down: a group still alive when the
        # interpreter exits can abort the process ("terminate called without an
        # active exception" from a gloo thread), failing a job that succeeded.
        atexit.register(_destroy_group_at_exit)
    rank = dist.get_rank()
    _seed_everything(seed + rank if seed_per_rank else seed)
    result = _to_cpu(fn(*args, **kwargs))
    results: list[Any] = [None] * env_world
    dist.all_gather_object(results, result)
    return results


# --------------------------------------------------------------------------
# The rank side: one launch in a process freshly forked from the server.
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _LaunchSpec:
    """Everything a rank of one launch needs, sent once to the server (the
    forked ranks inherit it in memory)."""

    generation: int          # this launch's number: key prefix in the store
    world_size: int
    backend: str             # "gloo" or "nccl" (already resolved)
    store_port: int
    pg_timeout: float        # seconds, launch timeout + margin
    seed: int
    seed_per_rank: bool
    environ: dict[str, str]  # the caller's os.environ at the call
    cwd: str
    sys_path: list[str]
    payload: bytes           # (fn, args, kwargs), by _ship
    sources: dict[str, tuple]  # linecache entries of the shipped code's cells


class _ShipPickler(cloudpickle.Pickler):
    """cloudpickle, except that code objects keep their file name.

    cloudpickle pickles a notebook function by value, code object included,
    but (from cloudpickle 3.1.3 on) renames the code's file to
    ``<dynamic-code>`` to make pickles deterministic. A rank's traceback and
    the collective recorder then cannot say ``Cell In[4], line 10``. So code
    objects travel here as ``marshal`` bytes, the format of a ``.pyc`` file,
    which keeps every field; caller and ranks run the same interpreter, the
    one condition marshal needs. The pickler also notes which files the code
    came from, so that the cells' source can travel too (see ``_ship``)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.filenames: set[str] = set()

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            self.filenames.add(obj.co_filename)
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)


def _ship(obj: Any) -> tuple[bytes, dict[str, tuple]]:
    """``obj`` pickled for a rank, and the source of every notebook cell its
    code came from. A cell's source exists only in the kernel (IPython keeps
    it in ``linecache`` under a made-up file name); a rank that has it can
    print the learner's line in its traceback like any file's."""
    buffer = io.BytesIO()
    pickler = _ShipPickler(buffer)
    pickler.dump(obj)
    sources = {name: linecache.cache[name] for name in pickler.filenames
               if name in linecache.cache and not os.path.exists(name)}
    return buffer.getvalue(), sources


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np
        np.random.seed(seed % 2**32)


def _to_cpu(obj: Any) -> Any:
    """Move tensors in a (nested) result to CPU so the caller never touches CUDA."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu() if obj.device.type != "cpu" else obj.detach()
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
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


def _set_process_name(name: str) -> None:
    """What ``ps``/``pgrep`` show (Linux, 15 characters): course-server,
    course-spare (forked ahead, never ran anything), course-rank."""
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _become_fresh(spec: _LaunchSpec) -> None:
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
    """The rank's traceback without this module's frames: the learner's code first."""
    here = os.path.realpath(__file__)
    return [(f.filename, f.lineno or 0, f.name, f.line or "")
            for f in traceback.extract_tb(exc.__traceback__)
            if os.path.realpath(f.filename) != here]


def _spare_main(link: socket.socket, server_pid: int, store_port: int) -> None:
    """A rank forked ahead of time, before its launch: it sets up what does not
    depend on the launch (death with the server, a connection to the store),
    then waits for its orders: its rank, the launch, and the socket to the caller."""
    _set_process_name("course-spare")
    _die_with_server(server_pid)
    import torch.distributed as dist

    store = None
    with contextlib.suppress(Exception):  # if this fails, the rank retries and reports it
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=60))
    orders = mpc.Connection(os.dup(link.fileno()))
    try:
        spec = cloudpickle.loads(orders.recv_bytes())
        rank = int(orders.recv_bytes())
        _, fds, _, _ = socket.recv_fds(link, 1, 1)
    except Exception:  # the server went away before using us
        os._exit(0)
    orders.close()
    link.close()
    _set_process_name("course-rank")
    _rank_main(mpc.Connection(fds[0]), rank, spec, store)


def _rank_main(conn: mpc.Connection, rank: int, spec: _LaunchSpec, store: Any) -> None:
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
        global _RANK_INFO, _RECORD_PATH
        _RECORD_PATH = _record_path(spec.store_port, spec.generation, rank)
        device = "cpu"
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        _RANK_INFO = RankInfo(rank, spec.world_size, rank, spec.backend, device)
        sys.stdout = _PipeWriter(send, rank, "stdout")
        sys.stderr = _PipeWriter(send, rank, "stderr")
        if store is None:
            store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False,
                                  timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(
            _group_backend(spec.backend), store=dist.PrefixStore(f"launch{spec.generation}", store),
            rank=rank, world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.pg_timeout))
        linecache.cache.update(spec.sources)  # the cells' lines, for tracebacks
        fn, args, kwargs = cloudpickle.loads(spec.payload)
        _seed_everything(spec.seed + rank if spec.seed_per_rank else spec.seed)
        result = _to_cpu(fn(*args, **kwargs))
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


# --------------------------------------------------------------------------
# The server: imports torch once, forks the ranks of every launch.
# --------------------------------------------------------------------------

def _module_stamps() -> dict[str, int]:
    """Files of the project's modules this process imported (not torch, not the
    standard library), with their modification times: if one changes, forks of
    this process would run stale code."""
    lib = _library_dirs()
    stamps = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path and not os.path.realpath(path).startswith(lib):
            with contextlib.suppress(OSError):
                stamps[path] = os.stat(path).st_mtime_ns
    return stamps


def _server_entry() -> None:
    """``python -c`` entry of the rank server."""
    fd = int(os.environ.pop("_COURSE_POOL_FD"))
    store_port = int(os.environ.pop("_COURSE_STORE_PORT"))
    _set_process_name("course-server")
    # Own process group already (start_new_session); ignoring SIGINT as well
    # means even a signal to our group cannot kill an idle server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    _seed_everything(0)
    _serve(mpc.Connection(fd), socket.socket(fileno=os.dup(fd)), store_port)


def _serve(ctrl: mpc.Connection, sock: socket.socket, store_port: int) -> None:
    """The server's loop. Messages from the caller on ``ctrl``:
    ("launch", spec) followed by world_size socket fds -> hand each to a
    spare rank, reply ("started", generation, pids); ("kill", generation) ->
    SIGKILL that launch's ranks; ("stop",). To the caller, for every rank that
    ends: ("exit", generation, rank, returncode), returncode < 0 for a signal.

    Spares: after a launch the server forks as many ranks as it had, ahead of
    the next launch, so that forking (and connecting to the store) is not on
    that launch's path. They never run anything before their launch."""
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
                _spare_main(theirs, os.getppid(), store_port)
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
        send(("ready", os.getpid(), _module_stamps()))
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
    # started, us.
    os.killpg(0, signal.SIGKILL)


# --------------------------------------------------------------------------
# The caller side: the server's handle, the launch, the wait loop.
# --------------------------------------------------------------------------

def _describe_exit(code: int | None) -> str:
    if code is None:
        return "died (its exit status was lost with the rank server)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        extra = " (a segmentation fault)" if name == "SIGSEGV" else ""
        return f"was killed by {name}{extra}"
    return f"exited with code {code} (os._exit or a crash inside the rank)"


def _import_time_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_IMPORT_TIME_ENV)}


class _ServerGone(Exception):
    """The server closed its socket (it died) before a reply."""


class _Pool:
    """The caller's handle on the rank server: its process, the socket to it,
    and the TCPStore every launch's ranks meet in.

    The server is started with subprocess rather than multiprocessing, which
    would re-import the caller's __main__ (a notebook has none to import, and
    a script without a ``__main__`` guard would recurse); fn travels by value.
    """

    def __init__(self):
        import subprocess

        import torch.distributed as dist

        # The caller hosts the store; port 0 -> the OS picks a free port and we keep it.
        self.store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True,
                                   timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        self.env_at_start = _import_time_env()
        self.stamps: dict[str, int] = {}  # filled by the server's "ready"
        self.exits: dict[tuple[int, int], int] = {}  # (generation, rank) -> returncode
        self.sock, theirs = socket.socketpair()
        path = os.environ.get("PYTHONPATH")
        env = dict(os.environ, _COURSE_POOL_WORKER="1", _COURSE_POOL_FD=str(theirs.fileno()),
                   _COURSE_STORE_PORT=str(self.store.port),
                   PYTHONPATH=_ROOT + (os.pathsep + path if path else ""))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from helpers.launch import _server_entry; _server_entry()"],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                start_new_session=True)  # its own process group: see _serve
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
            raise _ServerGone from None
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

    def start_ranks(self, spec: _LaunchSpec) -> list[mpc.Connection]:
        """Ask the server to fork the launch's ranks; one socket to each."""
        pairs = [socket.socketpair() for _ in range(spec.world_size)]
        try:
            self.conn.send_bytes(cloudpickle.dumps(("launch", spec)))
            socket.send_fds(self.sock, [b"F"], [theirs.fileno() for _, theirs in pairs])
            if self._reply("started", _SERVER_REPLY_TIMEOUT) is None:
                raise _ServerGone
        except OSError:  # broken pipe: the server died just now
            raise _ServerGone from None
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
        with contextlib.suppress(_ServerGone):
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
        except (_ServerGone, OSError):
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
        now = _import_time_env()
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
        self.store = None  # the TCPStore closes its listening socket when released

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send_bytes(cloudpickle.dumps(("stop",)))
            self.proc.wait(timeout=3)
        self.kill()


_POOL: _Pool | None = None
_POOL_LOCK = threading.RLock()
_GENERATIONS = itertools.count(1)


def shutdown() -> None:
    """Stop the rank server (also done automatically when the kernel exits)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.stop()
            _POOL = None


atexit.register(shutdown)


def _kill_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.kill()
        _POOL = None


def _get_pool(world_size: int) -> _Pool:
    """The running rank server, or a new one (saying so: it takes seconds)."""
    global _POOL
    if _POOL is not None:
        why = "the rank server died" if not _POOL.alive() else _POOL.stale()
        if why is None:
            return _POOL
        _kill_pool()
        sys.stderr.write(f"[launch] {why}: restarting the rank server ... ")
    else:
        sys.stderr.write(f"[launch] starting {world_size} ranks. First launch only: a rank "
                         f"server imports torch once (a few seconds); later launches fork "
                         f"fresh ranks from it ... ")
    sys.stderr.flush()
    start = time.monotonic()
    _POOL = _Pool()  # set first, so that an interrupt from here on kills it
    _POOL.wait_ready(start + _START_TIMEOUT)
    sys.stderr.write(f"ready in {time.monotonic() - start:.1f} s\n")
    sys.stderr.flush()
    return _POOL


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
           timeout: float = 60.0, seed: int = 0, seed_per_rank: bool = False,
           record: bool = False, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return results in rank order.

    backend: "auto" (nccl with one GPU per rank if there are enough GPUs, else
        gloo on CPU), "gloo" or "nccl".
    timeout: seconds for the whole call once the ranks are forked (starting
        the rank server on the first launch gets its own allowance). A rank
        still running at the deadline raises ``RankTimeout`` naming it.
    seed / seed_per_rank: every rank is seeded with ``seed`` (or ``seed + rank``).
    record: run ``fn`` inside ``helpers.debug.record_collectives()``. Either
        way, if the ranks recorded their collectives and the launch fails, the
        error ends with the cross-rank diff (``err.diff``, ``err.records``).
    Keyword arguments other than these go to ``fn``.
    """
    _check_args(fn, world_size, timeout)
    if record:
        from helpers.debug.recorder import recorded
        fn = recorded(fn)
    if _under_torchrun():
        return _launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout,
                                      seed, seed_per_rank)
    if os.environ.get("_COURSE_POOL_WORKER") == "1":
        raise RuntimeError("launch() called inside a rank: nested launches are not supported")
    backend = _resolve_backend(backend, world_size)
    try:
        payload, sources = _ship((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"could not ship {getattr(fn, '__name__', fn)!r} and its arguments to "
                        f"the ranks (they must be picklable): {exc}") from exc

    with _POOL_LOCK:
        pool, conns, generation = _start_ranks(world_size, backend, timeout, seed,
                                               seed_per_rank, payload, sources)
        port = pool.store.port  # (names the launch's record files)
        ended = False  # are all of this launch's ranks gone or going?
        try:
            results = _collect(pool, conns, generation, time.monotonic() + timeout)
            for c in conns:  # every rank answered: let them exit (in a few ms;
                with contextlib.suppress(OSError):  # no need to wait for it)
                    c.send_bytes(b"bye")
            ended = True
        except RankError:  # a rank raised, died or hung: kill the others
            ended = pool.kill_ranks(generation, world_size)
            raise
        except BaseException:  # Ctrl-C while the ranks run: same, if we can
            with contextlib.suppress(BaseException):
                ended = pool.kill_ranks(generation, world_size)
            raise
        finally:
            for c in conns:
                c.close()
            for r in range(world_size):  # the collective records, if any rank wrote one
                with contextlib.suppress(OSError):
                    os.unlink(_record_path(port, generation, r))
            if not ended:  # the server did not answer: replace it
                _kill_pool()
        return results


def _start_ranks(world_size, backend, timeout, seed, seed_per_rank, payload, sources):
    """Fork the launch's ranks; a server found dead is replaced, not reported."""
    for attempt in range(2):
        try:
            pool = _get_pool(world_size)
            pool.exits.clear()  # reports of earlier launches: nobody asks for them
            generation = next(_GENERATIONS)
            spec = _LaunchSpec(generation, world_size, backend, pool.store.port,
                               float(timeout) + _PG_TIMEOUT_MARGIN, seed, seed_per_rank,
                               dict(os.environ), os.getcwd(), list(sys.path), payload,
                               sources)
            return pool, pool.start_ranks(spec), generation
        except _ServerGone:
            # It died while idle (killed by hand, out of memory) and we only saw
            # it now: that is not this launch's failure. Start a new one, once.
            _kill_pool()
            if attempt == 1:
                raise RankError("the rank server died twice while forking ranks "
                                "(out of memory?)", rank=-1, exc_type="died") from None
        except BaseException:  # Ctrl-C or a timeout while starting: leave nothing behind
            _kill_pool()
            raise


def _collect(pool: _Pool, conns: list[mpc.Connection], generation: int,
             deadline: float) -> list[Any]:
    """Every rank's result, or the error that names the rank that started a failure.

    Which rank to name is decided from facts, not from which message came first.
    A rank that dies makes its peers fail with "connection closed", and their
    messages can arrive before its death is seen. So a connection error alone
    never ends the wait while some rank's fate is unknown: the launch goes on
    listening (until the deadline) for that rank's result, error or exit. A
    death is known two ways: the rank's socket closes, or the rank server,
    which reaps every rank, reports its exit status (the socket may stay open
    if the rank forked a child that inherited it, a DataLoader worker say).
    """
    n = len(conns)
    results: dict[int, Any] = {}
    failures: list[tuple[int, str, tuple]] = []  # (rank, kind, details), in arrival order
    rank_of = {c: r for r, c in enumerate(conns)}
    give_up_at = None  # set when a root cause (a death, an error of its own) arrives
    server = [pool.conn]  # emptied if the server goes away (then sockets alone tell)

    def died(rank: int, code: int | None) -> None:
        failures.append((rank, "died", (code,)))
        results[rank] = None
        for conn in [c for c, r in rank_of.items() if r == rank]:
            del rank_of[conn]

    while len(results) < n:
        now = time.monotonic()
        limit = deadline if give_up_at is None else min(deadline, give_up_at)
        if now >= limit:
            break
        watch = [c for c, r in rank_of.items() if r not in results]
        for conn in mpc.wait(watch + server, timeout=limit - now):
            if conn is pool.conn:  # an exit report from the server
                try:
                    pool._recv(0)
                except _ServerGone:
                    server.clear()
                for (gen, rank), code in list(pool.exits.items()):
                    if gen == generation and rank not in results:
                        died(rank, code)  # it exited before answering
                continue
            rank = rank_of.get(conn)
            if rank is None or rank in results:
                continue
            try:
                msg = cloudpickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                # The socket closed without a result: the rank's process died.
                died(rank, pool.exit_code(generation, rank))
                continue
            if msg[0] == "out":
                stream = sys.stdout if msg[1] == "stdout" else sys.stderr
                stream.write(msg[2])
                stream.flush()
            elif msg[0] == "result":
                results[rank] = msg[1]
            elif msg[0] == "error":
                failures.append((rank, "error", msg[1:]))
                results[rank] = None  # this rank is done, but failed
        if give_up_at is None and any(_is_root_cause(kind, details)
                                      for _, kind, details in failures):
            give_up_at = time.monotonic() + _GRACE

    if not failures and len(results) == n:
        return [results[r] for r in range(n)]
    try:
        if failures:
            _raise_root_cause(failures, unknown=sorted(set(range(n)) - set(results)))
        unfinished = sorted(set(range(n)) - set(results))
        done = sorted(results)
        raise RankTimeout(
            f"rank(s) {unfinished} did not finish within the timeout"
            f"{f' (rank(s) {done} did)' if done else ''}. This is usually a deadlock: a "
            f"collective or send/recv that not every rank called, or called in a different "
            f"order. All ranks were stopped.", unfinished)
    except RankError as err:
        # The ranks still run (they are killed after this): what they wrote so far.
        recorded = _read_records(pool.store.port, generation, n)
        if any(recorded.values()):
            _add_diff(err, recorded, _rank_status(n, results, failures))
        raise


def _rank_status(n: int, results: dict, failures: list) -> dict[int, str]:
    """What became of each rank, in words, for the collective diff."""
    status = {r: "returned from the rank function" for r in results}
    running = "had not finished when the launch was stopped" if failures else \
        "was still running at the timeout"
    status.update({r: running for r in range(n) if r not in results})
    for rank, kind, details in failures:
        status[rank] = _describe_exit(details[0]) if kind == "died" else f"raised {details[0]}"
    return status


def _add_diff(err: RankError, events: dict[int, list[tuple]], status: dict[int, str]) -> None:
    """End the error's message with the cross-rank diff of the recorded calls."""
    from helpers.debug.diff import assemble, explain

    err.records = assemble(events)
    err.diff = explain(err.records, status)
    err.args = (f"{err.args[0]}\n\n{err.diff}",) + err.args[1:]


_COMM_WORDS = ("connection closed", "connection reset", "timed out", "timeout",
               "broken pipe", "gloo", "nccl")


def _is_comm_error(details: tuple) -> bool:
    text = f"{details[0]} {details[1]}".lower()
    return any(w in text for w in _COMM_WORDS)


def _is_root_cause(kind: str, details: tuple) -> bool:
    """A death or an error of the rank's own; a connection error is a symptom."""
    return kind == "died" or not _is_comm_error(details)


def _raise_root_cause(failures: list[tuple[int, str, tuple]], unknown: list[int] = ()) -> None:
    """Name the rank that started it: a death first, then a non-communication
    error; a connection error only when nothing else is known, saying so."""
    def priority(item):
        index, (rank, kind, details) = item
        if kind == "died":
            return (0, index)
        return (2 if _is_comm_error(details) else 1, index)

    _, (rank, kind, details) = min(enumerate(failures), key=priority)
    others = [f"rank {r} {'died' if k == 'died' else 'raised ' + d[0]}"
              for r, k, d in failures if r != rank]
    if unknown and not _is_root_cause(kind, details):
        others.append(f"rank(s) {list(unknown)} neither answered nor exited before the "
                      f"timeout: one of them is the likely cause")
    tail = f"\n(then: {'; '.join(others)})" if others else ""
    if kind == "died":
        raise RankError(f"rank {rank} {_describe_exit(details[0])}{tail}",
                        rank=rank, exc_type="died")
    exc_type, message, tb, frames, original = details
    err = RankError(f"rank {rank} raised {exc_type}: {message}{tail}\n\n"
                    f"--- traceback of rank {rank} ---\n{tb}",
                    rank=rank, exc_type=exc_type, rank_traceback=tb, frames=frames)
    cause = None
    if original is not None:
        with contextlib.suppress(Exception):
            cause = cloudpickle.loads(original)
    raise err from cause
