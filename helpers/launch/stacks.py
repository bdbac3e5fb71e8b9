"""Where each rank was when a launch ran out of time.

A hang looks the same from outside whichever rank caused it: every rank is
"still running". Three ranks waiting in an all-reduce and one rank sleeping,
looping or waiting at another call are told apart only by where each one is.
So each rank arms Python's ``faulthandler`` on SIGUSR1 (``arm``): on the signal
it writes every thread's Python stack to a file, from a C signal handler, which
works while the rank is blocked inside gloo or nccl with no Python running. At the
deadline the caller signals the ranks still running, reads the files
(``where``) and groups the ranks by the line of course or learner code they were
on (``summarise``), before they are killed.

This is what ``py-spy dump`` does from outside, with nothing to install; under
torchrun, the same question is answered by ``py-spy dump --pid`` on each worker or
by torch's flight recorder on nccl (``TORCH_NCCL_TRACE_BUFFER_SIZE``, torch 2.13).
"""

from __future__ import annotations

import contextlib
import faulthandler
import linecache
import os
import re
import signal
import time

from helpers.launch.errors import cell_name, library_dirs

_SIGNAL = getattr(signal, "SIGUSR1", None)  # not on Windows: then there is no summary
_ARMED = []  # the open file, kept alive for faulthandler (it writes to its descriptor)
_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>\S+)')


def stack_path(rundir: str, generation: int, rank: int) -> str:
    return os.path.join(rundir, f"stack-{generation}-{rank}")


def arm(rundir: str, generation: int, rank: int) -> None:
    """Inside a rank, before its function runs: dump the stacks on SIGUSR1."""
    if _SIGNAL is None:
        return
    f = open(stack_path(rundir, generation, rank), "w")
    _ARMED[:] = [f]
    faulthandler.register(_SIGNAL, file=f, all_threads=True, chain=False)


def where(pids: dict[int, int], rundir: str, generation: int,
          wait: float = 1.0) -> dict[int, list[tuple[str, int, str]]]:
    """Signal each rank (rank -> pid) and read its main thread's frames, outermost
    first, as (file, line, function); a rank that wrote nothing within ``wait``
    seconds (it died, or it is stuck where a signal cannot reach) is left out."""
    if _SIGNAL is None:
        return {}
    for pid in pids.values():
        with contextlib.suppress(OSError):
            os.kill(pid, _SIGNAL)
    found: dict[int, list] = {}
    deadline = time.monotonic() + wait
    while len(found) < len(pids) and time.monotonic() < deadline:
        time.sleep(0.02)
        for rank in pids:
            if rank not in found:
                frames = _main_thread(_read(stack_path(rundir, generation, rank)))
                if frames:
                    found[rank] = frames
    return found


def remove(rundir: str, generation: int, n: int) -> None:
    for rank in range(n):
        with contextlib.suppress(OSError):
            os.unlink(stack_path(rundir, generation, rank))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _main_thread(text: str) -> list[tuple[str, int, str]]:
    """The frames of the thread that runs the rank (the one that passes through the
    rank's entry, ``_rank_main``) below that entry, outermost first; [] until the dump
    is there."""
    for block in text.split("\n\n"):
        frames = [(m["file"], int(m["line"]), m["name"])
                  for m in map(_FRAME.match, block.splitlines()) if m][::-1]  # outermost first
        entry = [i for i, (_, _, name) in enumerate(frames) if name == "_rank_main"]
        if entry:
            return frames[entry[0] + 1:]  # the rank's function and what it called
    return []


def place(frames: list[tuple[str, int, str]]) -> str:
    """The innermost line of course or learner code (not the launcher's, not a
    library's), and the torch.distributed function it was inside, if any."""
    lib = library_dirs()
    launcher_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep
    mine = [i for i, (f, _, _) in enumerate(frames)
            if not os.path.realpath(f).startswith(lib) and not f.startswith(launcher_dir)]
    if not mine:
        return "inside the launcher"
    i = mine[-1]
    filename, lineno, name = frames[i]
    line = linecache.getline(filename, lineno).strip()
    text = f"{cell_name(filename, lineno)}, in {name}" + (f": {line}" if line else "")
    inside = [n for f, _, n in frames[i + 1:] if f.endswith("distributed_c10d.py")]
    if inside:
        text += f" (waiting inside torch.distributed.{inside[0]})"
    return text


def summarise(found: dict[int, list], unfinished: list[int]) -> tuple[str, int | None]:
    """Lines naming where the ranks were, grouped by place, and the rank to start
    from when exactly one rank is somewhere the others are not."""
    groups: dict[str, list[int]] = {}
    for rank in unfinished:
        if rank in found:
            groups.setdefault(place(found[rank]), []).append(rank)
    if not groups:
        return "", None
    lines = []
    for text, ranks in sorted(groups.items(), key=lambda g: (len(g[1]), g[1])):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"  {who}: {text}")
    odd = None
    sizes = sorted(len(r) for r in groups.values())
    if len(groups) == 2 and sizes[0] == 1 and sizes[1] > 1:  # one rank apart from the rest
        odd = min(groups.values(), key=len)[0]
    return "\n".join(lines), odd
