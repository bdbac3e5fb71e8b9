"""Start and stop a zygote of rank servers (helpers/launch/zygote.py) for a run of many
notebooks: the nbval run of ``make test`` (conftest.py) and ``make check-labs``.

Standard library only: the caller must not import ``helpers`` (in a process where
ipykernel is loaded, importing it would start a rank server there)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = "_COURSE_ZYGOTE"  # helpers.launch.pool.ZYGOTE_ENV: where the kernels find it


def start(env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str] | None:
    """A zygote with ``env``, the environment the notebooks' processes will have (it
    refuses a process whose import-time variables differ); None if it did not start.
    Its own process group; it dies with the caller."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from helpers.launch.zygote import zygote_entry; zygote_entry()"],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    path = proc.stdout.readline().strip()           # printed once it listens
    if not path:
        stop(proc, "")
        return None
    return proc, path


def stop(proc: subprocess.Popen, path: str) -> None:
    """Kill it and remove its folder (the servers it forked end with their kernels)."""
    with contextlib.suppress(Exception):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    if path:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
