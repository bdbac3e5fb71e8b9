"""``launch``: the caller's side of one launch.

Ship ``fn``, have the server fork the ranks, then wait on every rank's
socket at once, with a deadline, and either return the results in rank
order or raise the error that names the rank that started the failure.

What a rank prints is streamed to the caller line by line, up to a limit per
rank and launch (``SHOWN_LINES``, ``SHOWN_BYTES``): a rank printing in a loop can
produce more than a browser can show (a notebook output of 200,000 lines
freezes the tab). The rest is kept whole in a file, and the launch ends with a
note saying how much was held back and where it is (``output_file``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing.connection as mpc
import os
import shutil
import sys
import time
from typing import Any, Callable

import cloudpickle

from helpers.launch import hooks, stacks
from helpers.launch import nccl_rules as nccl_rules_mode
from helpers.launch.arguments import check_args, resolve_backend
from helpers.launch.errors import RankError, RankTimeout, describe_exit, is_root_cause, raise_root_cause
from helpers.launch.info import under_torchrun
from helpers.launch.pool import POOL_LOCK, Pool, ServerGone, get_pool, kill_pool, private_dir
from helpers.launch.shipping import LaunchSpec, ship
from helpers.launch.torchrun import launch_under_torchrun


# Extra seconds the process group waits beyond the launch timeout, so that the
# launcher's deadline (which names the stuck ranks) fires before gloo's own.
_PG_TIMEOUT_MARGIN = 30.0


# After a rank raised an error of its own or died (a root cause), how long
# to keep listening for the other ranks' errors, for the "(then: ...)" line.
# A connection error alone never ends the wait: see _collect.
_GRACE = 1.0


# Once some ranks returned and others still run, how often the watches read the
# ranks' records (hooks.register_watch) for a rank waiting on one that is gone.
_WATCH_EVERY = 0.25


_GENERATIONS = itertools.count(1)


# What a launch streams of each rank's output, at most; the rest goes to a file.
SHOWN_LINES = 1000
SHOWN_BYTES = 200_000


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "auto",
           timeout: float = 60.0, seed: int = 0, seed_per_rank: bool = False,
           record: bool = False, nccl_rules: bool | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks; return results in rank order.

    backend: "auto" (nccl with one GPU per rank if there are enough GPUs, else
        gloo on CPU), "gloo" or "nccl".
    timeout: seconds for the whole call once the ranks are forked (starting
        the rank server on the first launch gets its own allowance). A rank
        still running at the deadline raises ``RankTimeout`` naming it.
    seed / seed_per_rank: every rank is seeded with ``seed`` (or ``seed + rank``).
    record: run ``fn`` inside ``helpers.debug.record_collectives()`` (an
        option helpers.debug registers, see helpers.launch.hooks). Either
        way, if the ranks recorded their collectives and the launch fails, the
        error ends with the cross-rank diff (``err.diff``, ``err.records``).
    nccl_rules: on gloo ranks, behave as nccl would where that changes the
        outcome (helpers.launch.nccl_rules): a hang or an error a GPU node would
        show appears here. None: on if ``COURSE_NCCL_RULES=1`` is in the environment.
        (Under torchrun too, on a gloo job: once on, they stay on in that process.)
    Keyword arguments other than these go to ``fn``.
    """
    check_args(fn, world_size, timeout, local=not under_torchrun())
    fn = hooks.apply_options(fn, {"record": record})
    if under_torchrun():
        return launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout,
                                     seed, seed_per_rank, nccl_rules)
    if os.environ.get("_COURSE_POOL_WORKER") == "1":
        raise RuntimeError("launch() called inside a rank: nested launches are not supported")
    asked, backend = backend, resolve_backend(backend, world_size)
    # The rules make gloo behave as nccl; on nccl itself there is nothing to emulate.
    rules = nccl_rules_mode.requested(nccl_rules, asked) and backend == "gloo"
    _log_launch(backend, world_size, rules, asked)
    try:
        payload, sources = ship((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(f"could not ship {getattr(fn, '__name__', fn)!r} and its arguments to "
                        f"the ranks (they must be picklable): {exc}") from exc

    with POOL_LOCK:
        pool, conns, generation = _start_ranks(world_size, backend, timeout, seed,
                                               seed_per_rank, payload, sources, rules)
        rundir = pool.rundir  # (kept: a failed launch may replace the pool)
        outputs = [RankOutput(generation, r) for r in range(world_size)]
        ended = False  # are all of this launch's ranks gone or going?
        try:
            results = _collect(pool, conns, generation, time.monotonic() + timeout, outputs)
            recorded = hooks.read_records(rundir, generation, world_size)
            if any(recorded.values()):  # every rank returned; a recorder may still object
                err = hooks.check_success(recorded)
                if err is not None:
                    raise err
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
            hooks.remove_records(rundir, generation, world_size)  # if any rank wrote one
            stacks.remove(rundir, generation, world_size)
            pool.pids.pop(generation, None)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(rundir, f"launch{generation}.store"))
            for out in outputs:
                out.close()
            if not ended:  # the server did not answer: replace it
                kill_pool()
        return results


LOG_ENV = "COURSE_LAUNCH_LOG"


def _log_launch(backend: str, world_size: int, rules: bool, asked: str = "auto") -> None:
    """With ``COURSE_LAUNCH_LOG=<file>`` in the environment, one line per launch
    ("nccl 4 auto <test>" / "gloo 3 rules gloo <test>": the backend it got, its size,
    the rules, the backend asked for, the pytest test running it): ``make test-gpu``
    reads them to say how many launches of each size really ran on nccl, and
    ``tools/launch_log.py --gpus N`` replays a CPU run for a node of N GPUs."""
    path = os.environ.get(LOG_ENV)
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" (")[0].replace(" ", "_")
        with open(path, "a") as f:
            f.write(f"{backend} {world_size}{' rules' if rules else ''} asked={asked}"
                    f"{' test=' + test if test else ''}\n")


def _start_ranks(world_size, backend, timeout, seed, seed_per_rank, payload, sources, rules):
    """Fork the launch's ranks; a server found dead is replaced, not reported."""
    for attempt in range(2):
        try:
            pool = get_pool(world_size)
            pool.exits.clear()  # reports of earlier launches: nobody asks for them
            generation = next(_GENERATIONS)
            spec = LaunchSpec(generation, world_size, backend, pool.rundir,
                              float(timeout) + _PG_TIMEOUT_MARGIN, seed, seed_per_rank,
                              dict(os.environ), os.getcwd(), list(sys.path), payload,
                              sources, rules)
            return pool, pool.start_ranks(spec), generation
        except ServerGone:
            # It died while idle (killed by hand, out of memory) and we only saw
            # it now: that is not this launch's failure. Start a new one, once.
            kill_pool()
            if attempt == 1:
                raise RankError("the rank server died twice while forking ranks "
                                "(out of memory?)", rank=-1, exc_type="died") from None
        except BaseException:  # Ctrl-C or a timeout while starting: leave nothing behind
            kill_pool()
            raise


class RankOutput:
    """What one rank of a launch printed: streamed to the caller up to ``SHOWN_LINES``
    lines or ``SHOWN_BYTES`` characters, all of it in ``output_file(generation,
    rank)`` once it ran past that (the file holds the shown part too)."""

    def __init__(self, generation: int, rank: int):
        self.generation, self.rank = generation, rank
        self.lines = self.chars = 0
        self.shown_lines = self.shown_chars = 0  # what reached the caller's screen
        self.shown: list[str] = []  # what was streamed, until a file takes over
        self.file = None
        self.path: str | None = None

    def write(self, stream_name: str, text: str) -> None:
        self.lines += text.count("\n")
        self.chars += len(text)
        if self.file is None and self.lines <= SHOWN_LINES and self.chars <= SHOWN_BYTES:
            self.shown.append(text)
            self.shown_lines, self.shown_chars = self.lines, self.chars
            stream = sys.stdout if stream_name == "stdout" else sys.stderr
            stream.write(text)
            stream.flush()
            return
        if self.file is None:
            self.path = output_file(self.generation, self.rank)
            self.file = open(self.path, "w")
            self.file.write("".join(self.shown))
            self.shown = []
        self.file.write(text)

    def close(self) -> None:
        """Close the file, and say what was held back (after the rank's last line)."""
        if self.file is None:
            return
        self.file.close()
        self.file = None
        if self.shown_chars:
            shown = (f"only the first {_count(self.shown_lines, 'line')} "
                     f"({self.shown_chars:,} characters) are shown above")
        else:
            shown = (f"none of it is shown above (the screen takes at most {SHOWN_LINES:,} "
                     f"lines or {SHOWN_BYTES:,} characters)")
        sys.stderr.write(f"[launch] rank {self.rank} printed {_count(self.lines, 'line')} "
                         f"({self.chars:,} characters); {shown}. All of it is in {self.path}\n")
        sys.stderr.flush()


_OUTPUT_DIR: list[str] = []


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def output_file(generation: int, rank: int) -> str:
    """Where a rank's whole output goes once it outgrew the stream: a private folder
    (helpers.launch.pool.private_dir) kept until the caller's process exits."""
    if not _OUTPUT_DIR:
        _OUTPUT_DIR.append(private_dir("course-output-"))
        atexit.register(shutil.rmtree, _OUTPUT_DIR[0], True)
    return os.path.join(_OUTPUT_DIR[0], f"launch{generation}-rank{rank}.txt")


def _collect(pool: Pool, conns: list[mpc.Connection], generation: int,
             deadline: float, outputs: list[RankOutput]) -> list[Any]:
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
    returned: set[int] = set()  # ranks whose result arrived
    watch_at = 0.0  # when the watches may look next
    seen_stuck = 0  # consecutive looks at which a watch found the launch stuck for good

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
        wait = min(limit - now, _WATCH_EVERY) if returned and hooks.watching() else limit - now
        for conn in mpc.wait(watch + server, timeout=wait):
            if conn is pool.conn:  # an exit report from the server
                try:
                    pool._recv(0)
                except ServerGone:
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
                outputs[rank].write(msg[1], msg[2])
            elif msg[0] == "result":
                results[rank] = msg[1]
                returned.add(rank)
            elif msg[0] == "error":
                failures.append((rank, "error", msg[1:]))
                results[rank] = None  # this rank is done, but failed
        if give_up_at is None and any(is_root_cause(kind, details)
                                      for _, kind, details in failures):
            give_up_at = time.monotonic() + _GRACE
        if returned and not failures and len(results) < n and hooks.watching() \
                and time.monotonic() >= watch_at:
            watch_at = time.monotonic() + _WATCH_EVERY
            recorded = hooks.read_records(pool.rundir, generation, n)
            err = hooks.check_progress(recorded, set(returned)) if any(recorded.values()) else None
            seen_stuck = seen_stuck + 1 if err is not None else 0
            if seen_stuck >= 2:  # twice in a row, a look apart: not a passing state
                hooks.report_failure(err, recorded, _rank_status(n, results, failures))
                raise err

    if not failures and len(results) == n:
        return [results[r] for r in range(n)]
    try:
        if failures:
            raise_root_cause(failures, unknown=sorted(set(range(n)) - set(results)))
        unfinished = sorted(set(range(n)) - set(results))
        raise _timeout(pool, generation, unfinished, sorted(results))
    except RankError as err:
        # The ranks still run (they are killed after this): what they wrote so far.
        recorded = hooks.read_records(pool.rundir, generation, n)
        if any(recorded.values()):
            hooks.report_failure(err, recorded, _rank_status(n, results, failures))
        raise


def _timeout(pool: Pool, generation: int, unfinished: list[int], done: list[int]) -> RankTimeout:
    """The ranks still running at the deadline, and where each one was: a rank
    that is somewhere the others are not is usually the one to look at."""
    pids = pool.pids.get(generation, {})
    found = stacks.where({r: pids[r] for r in unfinished if r in pids}, pool.rundir, generation)
    places, odd = stacks.summarise(found, unfinished)
    text = (f"rank(s) {unfinished} did not finish within the timeout"
            f"{f' (rank(s) {done} did)' if done else ''}.")
    if places:
        text += f" Where they were:\n{places}\n"
        if odd is not None:
            text += (f"Rank {odd} is the only one elsewhere: start there (the others wait "
                     f"for it). ")
    else:
        text += " "
    text += ("This is usually a deadlock: a collective or send/recv that not every rank "
             "called, or called in a different order. All ranks were stopped.")
    err = RankTimeout(text, unfinished)
    if odd is not None:
        err.rank = odd
    return err


def _rank_status(n: int, results: dict, failures: list) -> dict[int, str]:
    """What became of each rank, in words, for the collective diff."""
    status = {r: "returned from the rank function" for r in results}
    running = "had not finished when the launch was stopped" if failures else \
        "was still running at the timeout"
    status.update({r: running for r in range(n) if r not in results})
    for rank, kind, details in failures:
        status[rank] = describe_exit(details[0]) if kind == "died" else f"raised {details[0]}"
    return status
