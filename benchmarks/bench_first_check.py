"""A learner's first lab check in a cold kernel: how long until it answers.

    python benchmarks/bench_first_check.py [--lab 02] [--kernels 1]

What a learner does on opening a lab: a fresh kernel, then "Run All" (or shift-enter
down the cells without reading). Here that is the solution notebook's cells up to and
including its first check cell, run in a new Jupyter kernel (jupyter_client, the
course's own Python) from the notebook's folder, cell after cell with no pause: the
worst case, since the rank server that ``import helpers`` starts in the background
has no time to get ready before the check's first launch. "check" is the check cell's
own time, from its execute request to its reply; "from start" adds every cell before
it (the kernel's own start is left out: that is Jupyter's, not the course's). Then
the same check runs again in the same kernel: "warm" is what every later check
costs, and cold / warm is the ratio the benchmark prints. With ``--kernels`` > 1,
the fastest and the median over that many fresh kernels (on a shared machine noise
only ever adds, so the fastest is the machine's own figure). The load average is
printed: on a shared machine the numbers scale with it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import queue
import statistics
import sys
import time

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cells_to_first_check(lab: str) -> tuple[pathlib.Path, list[str]]:
    """The solution notebook of chapter ``lab`` and its code cells up to its first
    check call (what Run All executes before the learner's first answer)."""
    found = sorted((ROOT / "solutions").glob(f"{lab}_*_solution.ipynb"))
    if not found:
        raise ValueError(f"--lab {lab!r}: no solutions/{lab}_*_solution.ipynb")
    nb = nbformat.read(found[0], as_version=4)
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            cells.append(cell.source)
            if "checks.check_" in cell.source:
                return found[0], cells
    raise ValueError(f"{found[0].name} calls no check")


def run_cell(kc, source: str, timeout: float = 120.0) -> float:
    """Execute ``source`` in the kernel; seconds from the request to the reply. A cell
    that raises fails the benchmark with the kernel's traceback."""
    start = time.perf_counter()
    msg_id = kc.execute(source)
    while True:
        try:
            reply = kc.get_shell_msg(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"a cell did not answer within {timeout:.0f} s:\n{source}") from None
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    elapsed = time.perf_counter() - start
    content = reply["content"]
    if content["status"] != "ok":
        raise RuntimeError(f"cell failed: {content.get('ename')}: {content.get('evalue')}\n{source}")
    return elapsed


def one_kernel(notebook: pathlib.Path, cells: list[str]) -> tuple[float, float, float]:
    """(check cold, from the first cell's start to the check's answer, check warm)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(notebook.parent))
    try:
        before = sum(run_cell(kc, src) for src in cells[:-1])
        cold = run_cell(kc, cells[-1])
        warm = run_cell(kc, cells[-1])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return cold, before + cold, warm


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lab", default="02", help="chapter number, two digits (default 02)")
    parser.add_argument("--kernels", type=int, default=1, help="fresh kernels, median (default 1)")
    args = parser.parse_args(argv)
    if args.kernels < 1:
        raise ValueError(f"--kernels must be >= 1, got {args.kernels}")
    notebook, cells = cells_to_first_check(args.lab)
    runs = [one_kernel(notebook, cells) for _ in range(args.kernels)]
    print(f"{notebook.name}: {len(cells)} code cells up to the first check, "
          f"run back to back in a fresh kernel ({args.kernels} kernel(s))")
    print(f"{'':8} | {'check cold s':>12} | {'from start s':>12} | {'check warm s':>12} | "
          f"{'cold/warm':>9}")
    print("-" * 65)
    for name, pick in [("fastest", min), ("median", statistics.median)][:1 + (args.kernels > 1)]:
        cold, total, warm = (pick(r[i] for r in runs) for i in range(3))
        print(f"{name:8} | {cold:12.2f} | {total:12.2f} | {warm:12.2f} | {cold / warm:9.2f}")
    print(f"\n(on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; "
          f"target: the first check answers within 5 s of its cell's start)")


if __name__ == "__main__":
    sys.exit(main())
