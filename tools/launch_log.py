"""How many launches ran on which backend, from a ``COURSE_LAUNCH_LOG`` file.

    COURSE_LAUNCH_LOG=launches.log pytest course solutions ...
    python tools/launch_log.py launches.log

``make test-gpu`` runs the notebooks and the lab checks with the node's GPUs visible
and prints this table after them: a launch of n ranks runs on nccl where the node has
n GPUs (``backend="auto"``), else on gloo; the table says which sizes really met nccl.

Without a GPU, a dry run: log step 3's selection on the CPU, then replay it for a node
of N GPUs, which lists, per test, the launches that would run on nccl there::

    COURSE_LAUNCH_LOG=cpu.log pytest <step 3's selection>
    python tools/launch_log.py --gpus 1,2,3,4,8 cpu.log
"""

from __future__ import annotations

import collections
import pathlib
import sys


def parse(line: str) -> dict | None:
    """A log line ("nccl 4", "gloo 3 rules asked=auto test=tests/x.py::t") as a dict."""
    parts = line.split()
    if len(parts) < 2 or not parts[1].isdigit():
        return None
    fields = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
    return {"backend": parts[0], "world": int(parts[1]), "rules": "rules" in parts[2:],
            "asked": fields.get("asked", "auto"), "test": fields.get("test", "")}


def summarize(lines: list[str]) -> dict[tuple[str, int], int]:
    """{(backend, world size): launches}; a line reads "nccl 4" or "gloo 3 rules"."""
    counts: collections.Counter = collections.Counter()
    for rec in filter(None, map(parse, lines)):
        backend = rec["backend"] + (" (NCCL's rules)" if rec["rules"] else "")
        counts[backend, rec["world"]] += 1
    return dict(counts)


def replay(lines: list[str], gpus: int) -> dict[str, list[int]]:
    """A CPU run's launches on a node of ``gpus`` GPUs: {test: sizes of its launches
    that would run on nccl}, by the launcher's own rule (``backend_for``)."""
    from helpers.launch.arguments import backend_for

    out: dict[str, list[int]] = {}
    for rec in filter(None, map(parse, lines)):
        if backend_for(rec["asked"], rec["world"], gpus) == "nccl":
            out.setdefault(rec["test"] or "(no test)", []).append(rec["world"])
    return out


def replay_table(lines: list[str], counts: list[int]) -> str:
    rows = []
    for gpus in counts:
        nccl = replay(lines, gpus)
        launches = sum(len(v) for v in nccl.values())
        rows.append(f"== {gpus} GPU(s): {launches} launch(es) on nccl in {len(nccl)} test(s)")
        rows += [f"   {test}: {sorted(set(sizes))} ranks" for test, sizes in sorted(nccl.items())]
    return "\n".join(rows)


def table(counts: dict[tuple[str, int], int]) -> str:
    sizes = sorted({n for _, n in counts})
    backends = sorted({b for b, _ in counts})
    if not counts:
        return "no launch was logged"
    head = f"{'backend':24s}" + "".join(f"{f'{n} ranks':>10s}" for n in sizes)
    rows = [f"{b:24s}" + "".join(f"{counts.get((b, n), 0):10d}" for n in sizes) for b in backends]
    lines = [head, *rows]
    if not any(b == "nccl" for b in backends):
        lines.append("no launch ran on nccl: nccl needs one GPU per rank, and the "
                     "notebooks launch 2 ranks or more")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    gpus = None
    if len(argv) == 3 and argv[0] == "--gpus":
        gpus = [int(n) for n in argv[1].split(",")]
        argv = argv[2:]
    if len(argv) != 1:
        print(__doc__)
        return 2
    path = pathlib.Path(argv[0])
    lines = path.read_text().splitlines() if path.exists() else []
    print(table(summarize(lines)) if gpus is None else replay_table(lines, gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
