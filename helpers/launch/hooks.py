"""The launcher's extension points, so other parts of the course plug in
without the launcher knowing them (helpers.debug's collective recorder uses
all three):

* **a record channel.** Inside a rank, ``rank_channel()`` returns a function
  that appends an event (a picklable tuple) to this rank's record file. The
  file outlives the rank: when a launch fails, even by a hang or a killed
  rank, the caller reads every rank's events (``read_records``).
* **launch options.** ``register_option("record", wrap)`` makes
  ``launch(fn, n, record=True)`` ship ``wrap(fn)`` instead of ``fn``.
* **failure reports.** ``register_failure_report(report)``: when a launch
  fails and some rank wrote events, ``report(err, events, status)`` may add
  to the error (the recorder's cross-rank diff).
* **watches.** ``register_watch(watch)``: while a launch runs and some of its ranks
  have already returned, ``watch(events, returned)`` may decide that the others can
  never finish (they wait for a rank that has returned: the recorder's) and return
  the error to raise now rather than at the timeout.
* **success checks.** ``register_success_check(check)``: when every rank returned
  and some rank wrote events, ``check(events)`` may still find the launch wrong
  and return an error to raise instead (the recorder's: ranks whose calls
  disagree, which nccl can complete with wrong data).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Callable

# Inside a rank: the file its record channel appends to (see record_path).
_RECORD_PATH: str | None = None
# launch(fn, n, name=True) ships _OPTIONS[name](fn); see register_option.
_OPTIONS: dict[str, Callable[[Callable], Callable]] = {}
_REPORTS: list[Callable[[Any, dict, dict], None]] = []
_SUCCESS_CHECKS: list[Callable[[dict], Any]] = []
_WATCHES: list[Callable[[dict, set], Any]] = []


def set_record_path(path: str) -> None:
    """Called once in each rank, before ``fn`` runs."""
    global _RECORD_PATH
    _RECORD_PATH = path


def record_path(rundir: str, generation: int, rank: int) -> str:
    """Where a rank's record goes: a file per rank in the launcher's private folder
    (``Pool.rundir``: only its user can read it; in memory, /dev/shm, where there is
    one). Appending costs a write() per call, and unlike a message on the rank's
    socket it wakes nobody: the caller reads the files only when a launch fails,
    including when the rank hangs or is killed (what was written before is there).
    The launch's number makes the name unique."""
    return os.path.join(rundir, f"record-{generation}-{rank}")


def remove_records(rundir: str, generation: int, n: int) -> None:
    for rank in range(n):
        try:
            os.unlink(record_path(rundir, generation, rank))
        except OSError:
            pass


def rank_channel() -> Callable[[tuple], None] | None:
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


def read_records(rundir: str, generation: int, n: int) -> dict[int, list[tuple]]:
    """Every rank's recorded events; a frame cut short (a rank killed while
    writing it) is dropped. (``launch`` removes the files when the ranks are gone.)"""
    out: dict[int, list[tuple]] = {}
    for rank in range(n):
        path = record_path(rundir, generation, rank)
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


def register_option(name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Make ``launch(fn, n, name=True)`` run ``wrap(fn)`` on the ranks instead of ``fn``."""
    _OPTIONS[name] = wrap


def apply_options(fn: Callable, chosen: dict[str, bool]) -> Callable:
    """``fn`` wrapped by every registered option that the launch turned on."""
    for name, on in chosen.items():
        if on:
            if name not in _OPTIONS:
                raise ValueError(f"launch(..., {name}=True): no part of the course provides "
                                 f"that option (helpers.debug provides 'record')")
            fn = _OPTIONS[name](fn)
    return fn


def register_failure_report(report: Callable[[Any, dict, dict], None]) -> None:
    """When a launch fails and some rank wrote to its record channel,
    ``report(err, events, status)`` is called before the error is raised:
    ``events`` maps rank -> the events it wrote, ``status`` rank -> what
    became of it in words ("raised ValueError", "was still running at the
    timeout"). It may change ``err`` (add to its message, set attributes)."""
    if report not in _REPORTS:
        _REPORTS.append(report)


def report_failure(err: Any, events: dict[int, list[tuple]], status: dict[int, str]) -> None:
    for report in _REPORTS:
        report(err, events, status)


def register_success_check(check: Callable[[dict], Any]) -> None:
    """When every rank of a launch returned and some wrote to their record channel,
    ``check(events)`` is called: it returns None, or an exception for ``launch`` to
    raise instead of returning the results."""
    if check not in _SUCCESS_CHECKS:
        _SUCCESS_CHECKS.append(check)


def check_success(events: dict[int, list[tuple]]) -> Any:
    """The first error a success check finds in a launch that returned, or None."""
    for check in _SUCCESS_CHECKS:
        err = check(events)
        if err is not None:
            return err
    return None


def register_watch(watch: Callable[[dict, set], Any]) -> None:
    """While a launch runs and some ranks have returned, ``watch(events, returned)`` is
    called now and then (``returned``: the ranks that did); it returns None, or an
    exception for ``launch`` to raise now, the ranks still running being stuck for good."""
    if watch not in _WATCHES:
        _WATCHES.append(watch)


def watching() -> bool:
    return bool(_WATCHES)


def check_progress(events: dict[int, list[tuple]], returned: set[int]) -> Any:
    """The first error a watch finds, or None."""
    for watch in _WATCHES:
        err = watch(events, returned)
        if err is not None:
            return err
    return None
