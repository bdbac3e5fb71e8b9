"""Check a room's labs: every exercise of every lab notebook in a folder.

    python tools/check_labs.py work                # a learner's `make my-copy` folder
    python tools/check_labs.py submissions/        # one subfolder per learner
    make check-labs DIR=work                       # the same, with the course's Python
    make check-labs DIR=room JOBS=4                # four notebooks at a time (a node)

A lab notebook is any notebook with a check cell (``checks.check_...``); the
course notebooks that `make my-copy` also copies have none and are skipped.
An exercise is the cell that defines it plus the check cell right after it
(AUTHORING.md: an exercise cell only defines, the check call goes in the next
cell). Each notebook runs in its own Python process, top to bottom without
Jupyter: the first code cell (imports), then every cell in order, so that an
exercise sees what the learner's earlier cells defined. A cell that is
neither an exercise nor its check is run and its errors ignored (it is the
learner's playground, not graded). Each check's outcome is one of

* ``pass``          the check printed its ✓ line;
* ``not attempted`` the stub still raises ``NotImplementedError("Exercise: ...")``;
* ``fail: ...``     the check's one-line reason (or the exception the cell raised);
* ``timeout``       the exercise ran past ``--exercise-timeout``, or the notebook
                    past ``--timeout``.

A failing exercise never stops the rest: the check's exception is caught. A
hanging one never does either: the process is killed (its whole process
group, and the rank server's, which ``helpers.launch`` starts in a group of
its own) and a fresh process runs the notebook again from the next exercise,
defining the earlier exercises without checking them again. At the end every
process group the run started is killed, so no rank outlives it.

Prints a table, learner x exercise, and writes every outcome to a CSV
(``--csv``, default ``check_labs.csv`` inside the folder).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import linecache
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (make check-labs): tools/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))
from tools import zygote  # noqa: E402  (standard library only)
CHECK_CALL = re.compile(r"\bcheck_\w+\s*\(")
DEFINES = re.compile(r"^(?:def|class)\s+(\w+)|^(\w+)\s*=", re.M)
TAG = "@@check_labs@@ "  # prefix of the child's report lines on stdout
RUN_MARK = "COURSE_CHECK_LABS_RUN"  # in the environment of every process a run starts


# -- what a notebook holds ----------------------------------------------------

@dataclass
class Exercise:
    name: str
    define: int  # index among the notebook's code cells
    check: int


def code_cells(path: pathlib.Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def exercises(cells: list[str]) -> list[Exercise]:
    """Each check cell and the cell that defines what it checks (the first cell is
    imports only)."""
    found = []
    for i, src in enumerate(cells):
        if i >= 2 and CHECK_CALL.search(src) and not CHECK_CALL.search(cells[i - 1]):
            found.append(Exercise(*_graded(cells, i), i))
    return found


CHECK_ARGS = re.compile(r"\bcheck_\w+\s*\(([^)]*)\)")


def _graded(cells: list[str], i: int) -> tuple[str, int]:
    """(the exercise's name, the cell that defines it) for the check in cell ``i``: the
    nearest earlier cell that defines a name the check is called with, so that a scratch
    cell a learner put in between (``n = 5``) is not taken for the exercise; else the
    cell right before, as the lab lays them out."""
    call = CHECK_ARGS.search(cells[i])
    args = re.findall(r"(?<![\w.])([A-Za-z_]\w*)\b(?!\s*[.(])", call.group(1)) if call else []
    for k in range(i - 1, 0, -1):
        if CHECK_CALL.search(cells[k]):
            break  # the previous exercise's check: not further back
        names = {g for m in DEFINES.finditer(cells[k]) for g in m.groups() if g}
        hit = [a for a in args if a in names]
        if hit:
            return hit[0], k
    defined = DEFINES.search(cells[i - 1])
    name = next(g for g in defined.groups() if g) if defined else \
        CHECK_CALL.search(cells[i]).group(0).rstrip("( ").removeprefix("check_")
    return name, i - 1


def chapter(path: pathlib.Path) -> str:
    """'03' for 03_all_reduce_ring_lab.ipynb: the column key, whatever the learner renamed."""
    m = re.match(r"(\d+)", path.name)
    return m.group(1) if m else path.stem


# -- the child: one notebook, from one exercise on -----------------------------

def _report(**msg) -> None:
    sys.__stdout__.write(TAG + json.dumps(msg) + "\n")
    sys.__stdout__.flush()


def _server_pid() -> int | None:
    pool = sys.modules.get("helpers.launch.pool")
    proc = getattr(getattr(pool, "_POOL", None), "proc", None)
    return proc.pid if proc is not None else None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else "(no message)"
    return first if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {first}"


def _outcome(exc: BaseException | None) -> tuple[str, str]:
    if exc is None:
        return "pass", ""
    text = str(exc)
    # The stub raises NotImplementedError("Exercise: ..."); the checks say so as
    # CheckFailed("<name> is not implemented yet (Exercise: ...)") (helpers.checks.attempt),
    # or "<name> on 3 ranks is not implemented yet" when the stub ran on ranks.
    if (isinstance(exc, NotImplementedError) and text.startswith("Exercise")) or \
            re.search(r"\bis not implemented yet\b", text):
        return "not attempted", ""
    return "fail", _one_line(exc)


def run_notebook(path: pathlib.Path, start: int, skip: set[int]) -> None:
    """Child process: run the notebook's cells but those in ``skip`` (cells that hung
    in an earlier process), check exercises ``start`` and later."""
    os.chdir(path.parent)  # a notebook's relative paths are relative to its folder
    sys.path.insert(0, str(ROOT))
    cells = code_cells(path)
    owner = {}  # cell index -> the exercise it belongs to
    for k, ex in enumerate(exercises(cells)):
        owner[ex.define] = owner[ex.check] = k
    defines = {ex.define for ex in exercises(cells)}
    checks = {ex.check: (k, ex) for k, ex in enumerate(exercises(cells))}
    namespace: dict = {"__name__": "__lab__"}
    with contextlib.suppress(ImportError):
        from IPython.display import display
        namespace["display"] = display
    define_error: BaseException | None = None  # the exercise cell's own error, for its check
    for i, src in enumerate(cells):
        if i in skip or (i in checks and checks[i][0] < start):
            continue
        _report(event="cell", cell=i, exercise=owner.get(i), server=_server_pid())
        if i in checks:
            k, ex = checks[i]
            exc = define_error or _exec(src, f"{path.name}[{ex.name} check]", namespace)
            status, reason = _outcome(exc)
            _report(event="result", index=k, status=status, reason=reason, server=_server_pid())
            define_error = None
            continue
        # numbered as a fresh Restart-and-run-all numbers them in JupyterLab: In [1], ...
        exc = _exec(src, f"{path.name}[cell {i + 1}]", namespace)
        if i == 0 and exc is not None:
            _report(event="setup-failed", reason=_one_line(exc))
            return
        if i == 0 and "helpers.launch.pool" in sys.modules:
            # start the rank server now, while the next cells run (as a notebook kernel
            # does when it imports helpers): the first check's launch finds it ready
            sys.modules["helpers.launch.pool"].prestart()
        # An exercise cell that fails to define (a syntax error, say) is its check's failure;
        # a scratch cell between it and its check changes nothing.
        if i in defines:
            define_error = exc if owner[i] >= start else None
    with contextlib.suppress(Exception):
        from helpers.launch import shutdown
        shutdown()


def _exec(src: str, name: str, namespace: dict) -> BaseException | None:
    out = io.StringIO()
    # as IPython does for a cell: a traceback or a check's "(at ..., line N: `code`)"
    # can then quote the learner's line
    linecache.cache[name] = (len(src), None, src.splitlines(keepends=True), name)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(src, name, "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - the learner's error is the outcome
        if isinstance(exc, KeyboardInterrupt):
            raise
        return exc
    return None


# -- the parent: every notebook, with timeouts ----------------------------------

@dataclass
class Result:
    learner: str
    notebook: str
    chapter: str
    exercise: str
    status: str
    reason: str = ""

    @property
    def column(self) -> str:
        return f"{self.chapter}:{self.exercise}"


@dataclass
class Groups:
    """What this run started: process groups (each notebook's, each rank server's)
    and a mark in the environment of every process under them."""
    pgids: set[int] = field(default_factory=set)
    run_id: str = field(default_factory=lambda: f"{os.getpid()}-{time.time_ns()}")
    zygote_env: dict[str, str] = field(default_factory=dict)  # the run's zygote, if any

    def kill(self, pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def kill_all(self) -> None:
        for pgid in self.pgids:
            self.kill(pgid)
        for pid in self.marked():  # a rank server we never heard of (it started, then hung)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def marked(self) -> list[int]:
        """Live processes that carry this run's mark (Linux: /proc; elsewhere none)."""
        mark = f"{RUN_MARK}={self.run_id}".encode()
        found = []
        for entry in pathlib.Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if mark in (entry / "environ").read_bytes().split(b"\0") and \
                        b"Z" not in (entry / "stat").read_bytes().rsplit(b")", 1)[-1][:3]:
                    found.append(int(entry.name))
        return found


def check_notebook(path: pathlib.Path, learner: str, timeout: float, exercise_timeout: float,
                   groups: Groups) -> list[Result]:
    exs = exercises(code_cells(path))
    outcomes: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout
    start, skip = 0, set()
    while start < len(exs) and time.monotonic() < deadline:
        stopped = _run_child(path, start, skip, deadline, exercise_timeout, outcomes, groups)
        if stopped is None:
            break
        cell, exercise, status, reason = stopped
        skip.add(cell)  # never run the cell that hung (or crashed the process) again
        if exercise is not None:  # in an exercise: that is its outcome, go on with the next
            outcomes[exercise] = (status, reason)
            start = exercise + 1
        # else an ungraded cell: run the notebook again without it
        start = next((k for k in range(start, len(exs)) if k not in outcomes), len(exs))
    return [Result(learner, path.name, chapter(path), ex.name,
                   *outcomes.get(k, ("timeout", f"the notebook ran past {timeout:.0f} s")))
            for k, ex in enumerate(exs)]


def _child_env(groups: Groups) -> dict[str, str]:
    return dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
                **{RUN_MARK: groups.run_id})


def _run_child(path, start, skip, deadline, exercise_timeout, outcomes, groups):
    """Run one child; None when it ran to the end, else the cell it hung or died in:
    (cell, its exercise or None, status, reason)."""
    env = dict(_child_env(groups), **groups.zygote_env)
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(path), str(start),
                             ",".join(map(str, sorted(skip)))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True, text=True)
    groups.pgids.add(proc.pid)
    cell, exercise, limit = None, None, deadline
    try:
        while True:
            wait = min(limit, deadline) - time.monotonic()
            if wait <= 0:
                if cell is None:
                    return None  # never got going: the notebook's deadline is the outcome
                why = f"a cell ran past {exercise_timeout:.0f} s" if limit < deadline \
                    else "the notebook ran past its timeout"
                return cell, exercise, "timeout", why
            ready, _, _ = select.select([proc.stdout], [], [], wait)
            if not ready:
                continue
            line = proc.stdout.readline()
            if not line:  # the child exited: after its last cell, or it died in one
                code = proc.wait()
                if code == 0:
                    return None
                if cell is None:  # died before its first cell: nothing of the learner's ran
                    for k in range(start, len(exercises(code_cells(path)))):
                        outcomes[k] = ("fail", f"the checker's process died at start (exit code {code})")
                    return None
                return cell, exercise, "fail", f"the notebook's process died (exit code {code})"
            if not line.startswith(TAG):
                continue
            msg = json.loads(line[len(TAG):])
            if msg.get("server"):
                groups.pgids.add(msg["server"])
            if msg["event"] == "setup-failed":
                for k in range(start, len(exercises(code_cells(path)))):
                    outcomes[k] = ("fail", f"the first cell failed: {msg['reason']}")
                proc.wait()
                return None
            if msg["event"] == "cell":
                cell, exercise = msg["cell"], msg["exercise"]
                limit = min(deadline, time.monotonic() + exercise_timeout)
            elif msg["event"] == "result":
                outcomes[msg["index"]] = (msg["status"], msg["reason"])
    finally:
        groups.kill(proc.pid)
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
        proc.stdout.close()


def learners(folder: pathlib.Path) -> dict[str, list[pathlib.Path]]:
    """{learner: lab notebooks}: the folder itself if it holds labs, else each subfolder.
    A learner's labs are the notebooks with a check cell in their folder, or in its
    ``labs/`` (where ``make my-copy`` puts them, beside ``course/``)."""
    def labs(d: pathlib.Path) -> list[pathlib.Path]:
        found = sorted(p for p in d.glob("*.ipynb")
                       if not p.name.startswith(".") and exercises(code_cells(p)))
        return found or (labs(d / "labs") if (d / "labs").is_dir() else [])
    own = labs(folder)
    if own:
        return {folder.name: own}
    return {d.name: labs(d) for d in sorted(folder.iterdir())
            if d.is_dir() and not d.name.startswith(".") and d.name != "labs" and labs(d)}


def check_folder(folder: pathlib.Path, timeout: float = 600, exercise_timeout: float = 180,
                 only: str | None = None, progress=None, groups: Groups | None = None,
                 jobs: int = 1) -> list[Result]:
    """Every lab notebook of every learner in ``folder``; ``jobs`` notebooks at a time
    (each is a process of its own, with its own rank server, forked by the run's zygote:
    on a node, give each job the cores its ranks need). The results come in the same order whatever ``jobs``."""
    from concurrent.futures import ThreadPoolExecutor

    groups = groups or Groups()
    todo = [(learner, nb) for learner, notebooks in learners(folder).items()
            for nb in notebooks if not only or re.search(only, nb.name)]

    def one(item):
        learner, nb = item
        if progress:
            progress(f"{learner}: {nb.name}")
        return check_notebook(nb, learner, timeout, exercise_timeout, groups)
    # Several notebooks: one zygote forks every child's rank server, instead of each
    # child importing torch a second time for its own (helpers/launch/zygote.py). It
    # carries the run's mark and its own process group: kill_all ends it too.
    started = zygote.start(_child_env(groups)) if len(todo) > 1 else None
    if started:
        groups.pgids.add(started[0].pid)
        groups.zygote_env = {zygote.ENV: started[1]}
    try:
        # threads: each job only waits on its child processes' pipes
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return [r for rs in pool.map(one, todo) for r in rs]
    finally:
        groups.kill_all()
        if started:
            zygote.stop(*started)


def table(results: list[Result]) -> str:
    """Learners down, exercises across, one block per chapter (a room's 60
    exercises side by side would not fit a terminal); fail reasons listed below."""
    rows = list(dict.fromkeys(r.learner for r in results))
    cell = {(r.learner, r.column): r for r in results}
    short = {"pass": "pass", "not attempted": "-", "fail": "FAIL", "timeout": "TIME"}
    width = max([len("learner")] + [len(r) for r in rows])
    lines = []
    for ch in dict.fromkeys(r.chapter for r in results):
        columns = list(dict.fromkeys(r.column for r in results if r.chapter == ch))
        lines.append(" ".join(["learner".ljust(width)] + columns))
        for learner in rows:
            if not any((learner, c) in cell for c in columns):
                continue
            marks = [short.get(cell[learner, c].status, "?") if (learner, c) in cell else ""
                     for c in columns]
            lines.append(" ".join([learner.ljust(width)] +
                                  [m.ljust(len(c)) for m, c in zip(marks, columns)]).rstrip())
        lines.append("")
    lines.append("pass = check passed, - = not attempted, FAIL = failed, TIME = timed out")
    for r in results:
        if r.status in ("fail", "timeout"):
            lines.append(f"  {r.learner} {r.column}: {r.status}{': ' + r.reason if r.reason else ''}")
    return "\n".join(lines)


def write_csv(results: list[Result], path: pathlib.Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["learner", "notebook", "chapter", "exercise", "status", "reason"])
        for r in results:
            w.writerow([r.learner, r.notebook, r.chapter, r.exercise, r.status, r.reason])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        run_notebook(pathlib.Path(argv[1]).resolve(), int(argv[2]),
                     {int(i) for i in argv[3].split(",") if i})
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--csv", type=pathlib.Path, help="default: FOLDER/check_labs.csv")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per notebook")
    parser.add_argument("--exercise-timeout", type=float, default=180,
                        help="seconds per cell (an exercise's definition, its check, any other cell)")
    parser.add_argument("--only", help="regex on notebook names, e.g. '^0[1-3]'")
    parser.add_argument("--jobs", type=int, default=1,
                        help="notebooks checked at a time: 2 to 4 cores a job (a lab launches "
                             "up to 4 ranks, but is one busy process most of the time); "
                             "JOBS=2 on 2 cores, about 8 on a 16-core node")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder: name one with DIR=... "
                     f"(one learner's labs, or one subfolder per learner; make my-copy makes work/)")
    results = check_folder(args.folder, args.timeout, args.exercise_timeout, args.only,
                           progress=lambda s: print(f"checking {s}", file=sys.stderr, flush=True),
                           jobs=args.jobs)
    if not results:
        print(f"no lab notebooks (notebooks with a check cell) in {args.folder}", file=sys.stderr)
        return 1
    print(table(results))
    out = args.csv or args.folder / "check_labs.csv"
    write_csv(results, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
