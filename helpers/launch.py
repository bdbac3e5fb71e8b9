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
  a notebook cell (and everything it closes over) reaches the ranks. Ranks are
  started with the *spawn* method (a fresh interpreter, so CUDA is safe).
* Starting a rank re-imports torch, about 2 s each on a small laptop. So the
  ranks are kept in a **pool** after a successful launch: the next launch with
  the same world size and backend reuses the processes (with a fresh process
  group) and costs a few tens of milliseconds.
  After any failure the pool is killed and the next launch builds a new one:
  a rank that raised may have left threads, pending sends or half-built state
  behind, and a clean slate costs only the start-up time again.
* Rendezvous: the caller owns a ``TCPStore`` listening on 127.0.0.1 on a port
  the operating system picks (port 0). Nothing is chosen then released, so two
  launches at once, or another program, cannot steal the port.
* The caller waits on every rank's socket at once, with a deadline (a rank
  that dies closes its socket, so a death is seen at once). Three ways a launch can fail, and what you get:

  - a rank raises: ``RankError`` naming the rank, the exception type, message
    and the rank's own traceback. The other ranks are killed.
  - a rank dies (``os._exit``, SIGKILL, a segfault): ``RankError`` naming the
    rank and how it died (exit code or signal).
  - a deadlock: ``RankTimeout`` after ``timeout`` seconds naming the ranks that
    did not finish. The process group's own timeout is set a little longer, so
    the launcher, not gloo, reports it.

  In every case all ranks are gone when the exception reaches you, and the
  notebook kernel is untouched.
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
start fresh processes for every job and rely on the job being a script; an
elastic agent restarts failed workers. A notebook needs the opposite: cheap
repeated launches of small functions and a clean error instead of a restart.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import io
import multiprocessing.connection as mpc
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import cloudpickle

__all__ = ["launch", "rank_info", "RankInfo", "RankError", "RankTimeout", "shutdown"]

# Extra seconds the process group waits beyond the launch timeout, so that the
# launcher's deadline (which names the stuck ranks) fires before gloo's own.
_PG_TIMEOUT_MARGIN = 30.0
# After the first failure, how long to keep listening for the root cause
# (a rank that died makes its peers fail with "connection closed" first).
_GRACE = 1.0


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
    """A rank raised an exception or died. ``.rank`` is the root-cause rank."""

    def __init__(self, message: str, rank: int, exc_type: str | None = None,
                 rank_traceback: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.rank_traceback = rank_traceback


class RankTimeout(RankError):
    """Some ranks did not finish before the deadline (usually a deadlock)."""

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message, rank=ranks[0] if ranks else -1, exc_type="timeout")
        self.ranks = ranks


_RANK_INFO: RankInfo | None = None


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
# The rank side: a worker loop that runs tasks sent by the caller.
# --------------------------------------------------------------------------

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


def _die_with_parent() -> None:
    """If the notebook kernel is killed, its ranks must not live on."""
    parent = os.getppid()
    with contextlib.suppress(Exception):  # Linux: the kernel delivers SIGKILL for us
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch():  # portable fallback
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker_entry() -> None:
    """``python -c`` entry of a pooled rank: arguments come over the socket."""
    conn = mpc.Connection(int(os.environ["_COURSE_POOL_FD"]))
    rank, world_size, backend, store_port, sys_path = cloudpickle.loads(conn.recv_bytes())
    sys.path[:] = sys_path  # so functions pickled by reference (tests) import
    _worker_main(rank, world_size, backend, store_port, conn)


def _worker_main(rank: int, world_size: int, backend: str, store_port: int,
                 conn: mpc.Connection) -> None:
    """A pooled rank: runs tasks until told to stop."""
    _die_with_parent()
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        data = cloudpickle.dumps(msg)
        with send_lock:
            conn.send_bytes(data)

    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in os.environ:
        # N ranks on C cores: C // N intra-op threads each, as torchrun does with
        # OMP_NUM_THREADS. More threads than cores makes every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    global _RANK_INFO
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    _RANK_INFO = RankInfo(rank, world_size, rank, backend, device)
    store = dist.TCPStore("127.0.0.1", store_port, world_size + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    sys.stdout = _PipeWriter(send, rank, "stdout")
    sys.stderr = _PipeWriter(send, rank, "stderr")
    send(("ready",))

    while True:
        try:
            task = cloudpickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the caller went away
        if task[0] == "stop":
            break
        _, generation, pg_timeout, seed, payload = task
        try:
            # A fresh default group for every launch, under its own key prefix on
            # the caller's store: subgroups or a half-finished collective left by
            # one launch cannot leak into the next. On gloo this costs milliseconds.
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group(
                _group_backend(backend), store=dist.PrefixStore(f"launch{generation}", store),
                rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout))
            fn, args, kwargs = cloudpickle.loads(payload)
            base_seed, per_rank = seed
            _seed_everything(base_seed + rank if per_rank else base_seed)
            result = _to_cpu(fn(*args, **kwargs))
            sys.stdout.flush(); sys.stderr.flush()
            try:
                send(("result", result))
            except Exception as exc:  # unpicklable result
                send(("error", "TypeError", f"result of rank {rank} could not be sent back: {exc}",
                      traceback.format_exc(), None))
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: report, don't die
            sys.stdout.flush(); sys.stderr.flush()
            tb = traceback.format_exc()
            try:
                original = cloudpickle.dumps(exc)
            except Exception:
                original = None
            send(("error", type(exc).__name__, str(exc), tb, original))
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(0)


# --------------------------------------------------------------------------
# The caller side: a pool of ranks and the wait loop.
# --------------------------------------------------------------------------

def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        extra = " (a segmentation fault)" if name == "SIGSEGV" else ""
        return f"was killed by {name}{extra}"
    return f"exited with code {code} (os._exit or a crash inside the rank)"


class _Pool:
    """world_size ranks, each a fresh interpreter with a socket to the caller.

    We start ranks with subprocess rather than multiprocessing's spawn, which
    would re-import the caller's __main__ (a notebook has none to import, and
    a script without a ``__main__`` guard would recurse); fn travels by value.
    """

    _generation = 0

    def __init__(self, world_size: int, backend: str):
        import socket
        import subprocess

        import torch.distributed as dist

        self.world_size, self.backend = world_size, backend
        # The caller hosts the store; port 0 -> the OS picks a free port and we keep it.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                   timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
        self.procs, self.conns = [], []
        for rank in range(world_size):
            ours, theirs = socket.socketpair()
            env = dict(os.environ, _COURSE_POOL_WORKER="1", _COURSE_POOL_FD=str(theirs.fileno()))
            proc = subprocess.Popen(
                [sys.executable, "-c", "from helpers.launch import _worker_entry; _worker_entry()"],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
            theirs.close()
            conn = mpc.Connection(ours.detach())
            conn.send_bytes(cloudpickle.dumps((rank, world_size, backend, self.store.port,
                                               list(sys.path))))
            self.procs.append(proc)
            self.conns.append(conn)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def exitcode(self, rank: int) -> int | None:
        """Exit code of a rank whose socket closed (it may take a moment to be reaped)."""
        try:
            return self.procs[rank].wait(timeout=2)
        except Exception:
            return self.procs[rank].poll()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(Exception):
                    p.kill()
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.close()
        self.procs, self.conns = [], []

    def stop(self) -> None:
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.send_bytes(cloudpickle.dumps(("stop",)))
        deadline = time.monotonic() + 3
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=max(0.01, deadline - time.monotonic()))
        self.kill()


_POOL: _Pool | None = None
_POOL_LOCK = threading.RLock()


def shutdown() -> None:
    """Stop the pooled ranks (also done automatically when the kernel exits)."""
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


def _get_pool(world_size: int, backend: str, deadline: float) -> _Pool:
    """A pool of ready ranks of this size and backend, started if needed."""
    global _POOL
    if _POOL is not None and (_POOL.world_size, _POOL.backend) == (world_size, backend) \
            and _POOL.alive():
        return _POOL
    shutdown()
    pool = _Pool(world_size, backend)
    _POOL = pool
    # Wait for every rank to import torch and say "ready".
    pending = {c: r for r, c in enumerate(pool.conns)}
    while pending:
        left = deadline - time.monotonic()
        ready = mpc.wait(list(pending), timeout=max(0.0, left))
        if not ready and left <= 0:
            stuck = sorted(pending.values())
            _kill_pool()
            raise RankTimeout(f"ranks {stuck} did not start within the timeout "
                              "(is the machine overloaded?)", stuck)
        for conn in ready:
            rank = pending[conn]
            try:
                msg = cloudpickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                code = pool.exitcode(rank)
                _kill_pool()
                raise RankError(f"rank {rank} {_describe_exit(code)} while starting up "
                                "(importing torch/helpers failed?)", rank=rank, exc_type="died")
            if msg[0] == "ready":
                del pending[conn]
    return pool


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
           timeout: float = 60.0, seed: int = 0, seed_per_rank: bool = False,
           **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return results in rank order.

    backend: "auto" (nccl with one GPU per rank if there are enough GPUs, else
        gloo on CPU), "gloo" or "nccl".
    timeout: seconds for the whole call once the ranks are up (starting a new
        pool gets its own extra allowance). A rank still running at the
        deadline raises ``RankTimeout`` naming it.
    seed / seed_per_rank: every rank is seeded with ``seed`` (or ``seed + rank``).
    Keyword arguments other than these go to ``fn``.
    """
    _check_args(fn, world_size, timeout)
    if _under_torchrun():
        return _launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout,
                                      seed, seed_per_rank)
    if os.environ.get("_COURSE_POOL_WORKER") == "1":
        raise RuntimeError("launch() called inside a rank: nested launches are not supported")
    backend = _resolve_backend(backend, world_size)
    try:
        payload = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"could not ship {getattr(fn, '__name__', fn)!r} and its arguments to "
                        f"the ranks (they must be picklable): {exc}") from exc

    with _POOL_LOCK:
        start_deadline = time.monotonic() + 120.0  # importing torch on a busy laptop
        pool = _get_pool(world_size, backend, start_deadline)
        _Pool._generation += 1
        task = _make_task(_Pool._generation, timeout, seed, seed_per_rank, payload)
        try:
            for c in pool.conns:
                c.send_bytes(task)
            return _collect(pool, time.monotonic() + timeout)
        except BaseException:
            _kill_pool()  # any failure (or Ctrl-C): no rank outlives it
            raise


def _make_task(generation: int, timeout: float, seed: int, seed_per_rank: bool,
               payload: bytes) -> bytes:
    # The worker seeds rank r with ``seed + r`` if seed_per_rank, else ``seed``.
    return cloudpickle.dumps(("run", generation, float(timeout) + _PG_TIMEOUT_MARGIN,
                              (seed, seed_per_rank), payload))


def _collect(pool: _Pool, deadline: float) -> list[Any]:
    n = pool.world_size
    results: dict[int, Any] = {}
    failures: list[tuple[int, str, tuple]] = []  # (rank, kind, details), in arrival order
    rank_of = {c: r for r, c in enumerate(pool.conns)}
    give_up_at = None  # set when the first failure arrives

    while len(results) < n:
        now = time.monotonic()
        limit = deadline if give_up_at is None else min(deadline, give_up_at)
        if now >= limit:
            break
        watch = [c for c, r in rank_of.items() if r not in results]
        if not watch:
            break
        for conn in mpc.wait(watch, timeout=limit - now):
            rank = rank_of[conn]
            try:
                msg = cloudpickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                # The socket closed without a result: the rank's process died.
                del rank_of[conn]
                failures.append((rank, "died", (pool.exitcode(rank),)))
                results[rank] = None
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
        if failures and give_up_at is None:
            give_up_at = time.monotonic() + _GRACE

    if failures:
        _raise_root_cause(failures)
    if len(results) == n:
        return [results[r] for r in range(n)]
    unfinished = sorted(set(range(n)) - set(results))
    done = sorted(results)
    raise RankTimeout(
        f"rank(s) {unfinished} did not finish within the timeout"
        f"{f' (rank(s) {done} did)' if done else ''}. This is usually a deadlock: a "
        f"collective or send/recv that not every rank called, or called in a different "
        f"order. All ranks were stopped.", unfinished)


_COMM_WORDS = ("connection closed", "connection reset", "timed out", "timeout",
               "broken pipe", "gloo", "nccl")


def _is_comm_error(details: tuple) -> bool:
    text = f"{details[0]} {details[1]}".lower()
    return any(w in text for w in _COMM_WORDS)


def _raise_root_cause(failures: list[tuple[int, str, tuple]]) -> None:
    """Name the rank that started it: a death first, then a non-communication error."""
    def priority(item):
        index, (rank, kind, details) = item
        if kind == "died":
            return (0, index)
        return (2 if _is_comm_error(details) else 1, index)

    _, (rank, kind, details) = min(enumerate(failures), key=priority)
    others = [f"rank {r} {'died' if k == 'died' else 'raised ' + d[0]}"
              for r, k, d in failures if r != rank]
    tail = f"\n(then: {'; '.join(others)})" if others else ""
    if kind == "died":
        raise RankError(f"rank {rank} {_describe_exit(details[0])}{tail}",
                        rank=rank, exc_type="died")
    exc_type, message, tb, original = details
    err = RankError(f"rank {rank} raised {exc_type}: {message}{tail}\n\n"
                    f"--- traceback of rank {rank} ---\n{tb}",
                    rank=rank, exc_type=exc_type, rank_traceback=tb)
    cause = None
    if original is not None:
        with contextlib.suppress(Exception):
            cause = cloudpickle.loads(original)
    raise err from cause
