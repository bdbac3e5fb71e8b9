"""How many launches ran on which backend, from a ``COURSE_LAUNCH_LOG`` file.

    COURSE_LAUNCH_LOG=launches.log pytest course solutions ...
    python tools/launch_log.py launches.log

``make test-gpu`` runs the notebooks and the lab checks with the node's GPUs visible
and prints this table after them: a launch of n ranks runs on nccl where the node has
n GPUs (``backend="auto"``), else on gloo; the table says which sizes really met nccl.
"""

from __future__ import annotations

import collections
import pathlib
import sys


def summarize(lines: list[str]) -> dict[tuple[str, int], int]:
    """{(backend, world size): launches}; a line reads "nccl 4" or "gloo 3 rules"."""
    counts: collections.Counter = collections.Counter()
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            backend = parts[0] + (" (NCCL's rules)" if "rules" in parts[2:] else "")
            counts[backend, int(parts[1])] += 1
    return dict(counts)


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
    if len(argv) != 1:
        print(__doc__)
        return 2
    path = pathlib.Path(argv[0])
    lines = path.read_text().splitlines() if path.exists() else []
    print(table(summarize(lines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
