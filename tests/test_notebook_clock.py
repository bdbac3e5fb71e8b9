"""Notebook rank functions time GPU work with helpers.clock, not a host clock.

Under nccl a kernel or a collective returns to the host once it is queued, so
``time.perf_counter()`` read around it measures the launch (helpers/clock.py
says why and how the course's clock avoids it). tests/test_clock.py guards
helpers/ and benchmarks/; this test guards the functions that the notebooks of
course/ and solutions/ run on ranks: every function passed to ``launch``
(directly or through ``functools.partial``), and every function or class of the
same notebook that such a function refers to, transitively. A host clock read
there must be in the allow-list below, with the reason it times no GPU work.
Code outside those functions (a whole launch's wall time, a RankTimeout's
arrival) runs in the kernel on the host and is not checked.
"""

from __future__ import annotations

import ast
import pathlib

import nbformat
import pytest

from notebook_ast import called_name, code_cells

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOST_CLOCKS = {"perf_counter", "time", "monotonic", "thread_time"}

# (notebook, rank-side function, clock function) -> why a host clock is right there.
ALLOWED = {
    ("solutions/11_pipeline_basics_solution.ipynb", "timed_stage", "thread_time"):
        "cell 11: CPU seconds of the rank's thread, the chapter's CPU lesson on busy time "
        "(a host quantity by definition; the markdown says what it means on a GPU)",
    ("course/18_debugging_health.ipynb", "per_call_cost", "thread_time"):
        "CPU seconds of the recorder's Python wrapper around a gloo call on CPU tensors: "
        "the cost being measured is host work by definition",
}



def _launched(call: ast.Call) -> ast.expr | None:
    """The function argument of ``launch(fn, ...)``, unwrapping ``partial(fn, ...)``."""
    if called_name(call) != "launch" or not call.args:
        return None
    fn = call.args[0]
    if isinstance(fn, ast.Call) and fn.args and getattr(fn.func, "id", getattr(fn.func, "attr", "")) \
            == "partial":
        fn = fn.args[0]
    return fn


def _time_names(cells) -> set[str]:
    """Names bound by ``from time import perf_counter`` (and the like) in the notebook."""
    return {a.asname or a.name for _, tree in cells for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "time"
            for a in node.names if a.name in HOST_CLOCKS}


def _is_time_module(node: ast.expr) -> bool:
    """``time`` or ``__import__("time")``."""
    if isinstance(node, ast.Name):
        return node.id == "time"
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__" \
        and bool(node.args) and getattr(node.args[0], "value", None) == "time"


def rank_side_reads(path: pathlib.Path) -> set[tuple[str, str]]:
    """(function, clock) for each host clock read in a function that runs on ranks."""
    cells = code_cells(path)
    defs: dict[str, list[ast.AST]] = {}   # top-level functions and classes by name
    for _, tree in cells:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs.setdefault(node.name, []).append(node)
    todo = [fn.id for _, tree in cells for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(fn := _launched(node), ast.Name)]
    seen: set[str] = set()
    while todo:                           # functions and classes reachable from a rank function
        name = todo.pop()
        if name in seen or name not in defs:
            continue
        seen.add(name)
        todo += [n.id for d in defs[name] for n in ast.walk(d) if isinstance(n, ast.Name)]
    imported = _time_names(cells)
    found = set()
    for name in seen:
        for d in defs[name]:
            for n in ast.walk(d):
                if isinstance(n, ast.Attribute) and n.attr in HOST_CLOCKS and _is_time_module(n.value):
                    found.add((name, n.attr))
                elif isinstance(n, ast.Name) and n.id in imported:
                    found.add((name, n.id))
    return found


def scan(root: pathlib.Path) -> set[tuple[str, str, str]]:
    paths = sorted([*(root / "course").glob("*.ipynb"), *(root / "solutions").glob("*.ipynb")])
    return {(p.relative_to(root).as_posix(), fn, clk) for p in paths
            for fn, clk in rank_side_reads(p)}


def test_rank_functions_time_with_the_course_clock():
    reads = scan(ROOT)
    allowed = ALLOWED.keys()
    assert sorted(reads - allowed) == [], \
        "time GPU work with helpers.clock (clk = clock_for(dev); t0 = clk.mark(); " \
        "elapsed(t0, clk.mark())), or allow-list the read here with the reason"
    assert sorted(allowed - reads) == [], "allow-list entries no notebook needs any more"


def _notebook(path: pathlib.Path, *sources: str):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


def test_the_guard_sees_planted_reads(tmp_path):
    for d in ("course", "solutions"):
        (tmp_path / d).mkdir()
    _notebook(tmp_path / "course" / "a.ipynb",
              "import time\nfrom time import monotonic as mono\n%matplotlib inline",
              "def helper():\n    return mono()\n\n"
              "class Timer:\n    def start(self):\n        return time.time()\n\n"
              "def step(n):\n    t0 = time.perf_counter()\n    helper()\n    Timer().start()\n"
              "    return time.perf_counter() - t0",
              "def not_on_ranks():\n    return time.perf_counter()\n\n"
              "t0 = time.perf_counter()\nlaunch(step, 2, 3)\nprint(time.perf_counter() - t0)")
    _notebook(tmp_path / "solutions" / "b.ipynb",
              "import functools",
              "def rank_fn():\n    return __import__('time').thread_time()",
              "helpers.launch(functools.partial(rank_fn), 2)")
    assert scan(tmp_path) == {
        ("course/a.ipynb", "step", "perf_counter"),
        ("course/a.ipynb", "helper", "mono"),
        ("course/a.ipynb", "Timer", "time"),
        ("solutions/b.ipynb", "rank_fn", "thread_time"),
    }


@pytest.mark.parametrize("path", sorted(
    [*(ROOT / "course").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb")]),
    ids=lambda p: p.name)
def test_the_clock_is_imported_in_the_first_code_cell(path):
    """A notebook that calls clock_for imports it with the other imports."""
    cells = code_cells(path)
    uses = any(isinstance(n, ast.Name) and n.id == "clock_for"
               for _, tree in cells[1:] for n in ast.walk(tree))
    if uses:
        first = {a.asname or a.name for n in ast.walk(cells[0][1])
                 if isinstance(n, ast.ImportFrom) and n.module == "helpers.clock" for a in n.names}
        assert "clock_for" in first, f"{path.name}: import clock_for in the first code cell"
