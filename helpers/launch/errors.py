"""How a failed launch is reported: the errors, the rank's frames, the root cause.

``RankError`` names the rank, the exception and the learner's own lines;
``RankTimeout`` the ranks that did not finish. In IPython the error is shown
by ``_render_traceback_`` (IPython's hook for exceptions that draw themselves):
the rank, the exception, then the rank's frames with library frames folded.
A notebook cell's source exists only in the kernel, so a line is looked up
in the caller's ``linecache``, where IPython keeps every cell.

Which rank to name when several failed is ``raise_root_cause``: a death
first, then an error of the rank's own, and a connection error ("closed by
peer": a symptom of another rank's death) only when nothing else is known.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import signal
import sysconfig

import cloudpickle


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
        # Set by a failure report (helpers.launch.hooks) when the ranks
        # recorded their collectives (helpers.debug): rank -> [CallRecord],
        # and the cross-rank diff that ends the message.
        self.records: dict[int, list] | None = None
        self.diff: str | None = None

    def _render_traceback_(self) -> list[str]:
        """What IPython prints instead of the caller-side traceback (which would
        show only the launcher's internals): the rank, the exception, your lines."""
        summary = str(self).split("\n\n--- traceback of rank")[0]
        lines = [f"{type(self).__name__}: {summary}"]
        if self.frames:
            lines.append(f"Traceback of rank {self.rank} (most recent call last):")
            lines += format_frames(self.frames)
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


def library_dirs() -> tuple[str, ...]:
    """Where installed code lives (stdlib, site-packages), as real paths."""
    paths = sysconfig.get_paths()
    return tuple({os.path.realpath(paths[k]) + os.sep
                  for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


def format_frames(frames: list[tuple[str, int, str, str]]) -> list[str]:
    """Traceback lines for a rank's frames: the course's and the learner's in
    full, each run of library frames folded into one line. A notebook cell's
    source exists only in the kernel, so a line the rank could not read is
    looked up here, where IPython has cached every cell."""
    lib = library_dirs()
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
        out.append(f'  {cell_name(filename, lineno)}, in {name}')
        if line:
            out.append(f"    {line}")
    flush()
    return out


def cell_name(filename: str, lineno: int) -> str:
    """``Cell In[3], line 5`` for a notebook cell (as IPython names it), else the file."""
    with contextlib.suppress(Exception):
        from IPython import get_ipython
        count = get_ipython().compile._filename_map[filename]
        return f"Cell In[{count}], line {lineno}"
    return f'File "{filename}", line {lineno}'


def describe_exit(code: int | None) -> str:
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


_COMM_WORDS = ("connection closed", "connection reset", "timed out", "timeout",
               "broken pipe", "gloo", "nccl")
# What a backend raises when a peer went away (torch.distributed's DistError family,
# and the OS's): a TypeError or ValueError naming nccl is the rank's own mistake.
_COMM_TYPES = ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError",
               "DistStoreError", "TimeoutError", "OSError", "ConnectionError",
               "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError")


def _is_comm_error(details: tuple) -> bool:
    text = f"{details[0]} {details[1]}".lower()
    return details[0] in _COMM_TYPES and any(w in text for w in _COMM_WORDS)


def is_root_cause(kind: str, details: tuple) -> bool:
    """A death or an error of the rank's own; a connection error is a symptom."""
    return kind == "died" or not _is_comm_error(details)


def raise_root_cause(failures: list[tuple[int, str, tuple]], unknown: list[int] = ()) -> None:
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
    if unknown and not is_root_cause(kind, details):
        others.append(f"rank(s) {list(unknown)} neither answered nor exited before the "
                      f"timeout: one of them is the likely cause")
    tail = f"\n(then: {'; '.join(others)})" if others else ""
    if kind == "died":
        raise RankError(f"rank {rank} {describe_exit(details[0])}{tail}",
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
