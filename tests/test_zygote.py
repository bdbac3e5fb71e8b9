"""helpers.launch.zygote: one process that imported torch forks each caller's rank server.

The zygote is what the notebook half of ``make test`` uses (the root conftest.py starts
one for nbval), so these tests hold it to the same promises as a server started alone:
the caller's launches run and give their results, its server is its own (a separate
process group, dying with the caller and taking its ranks), and a request the zygote
cannot serve faithfully (another import-time environment) falls back to a server of the
caller's own.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENV = "_COURSE_ZYGOTE"


@pytest.fixture(scope="module")
def zygote():
    """One zygote for the module (each test's callers are new processes; a zygote
    serves any number of them, which the first test checks too)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from helpers.launch.zygote import zygote_entry; zygote_entry()"],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    path = proc.stdout.readline().strip()
    assert path, "the zygote did not start"
    yield proc, path
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


CALLER = textwrap.dedent("""
    import os, sys, time
    from helpers.launch import launch
    from helpers.launch import pool

    def where():
        return os.getpid(), os.getppid()

    out = launch(where, 2)
    server = pool._POOL.proc.pid
    print("RESULT", os.getpid(), server, os.getpgid(server), [ppid for _, ppid in out],
          flush=True)
    if sys.argv[1:] == ["hang"]:
        time.sleep(60)
""")


def _run_caller(env, *args, timeout=60):
    return subprocess.run([sys.executable, "-c", CALLER, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _result(stdout: str):
    line = next(l for l in stdout.splitlines() if l.startswith("RESULT"))
    caller, server, group, parents = line.split(" ", 4)[1:]
    return int(caller), int(server), int(group), eval(parents)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet, in a container without an init, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_callers_server_is_forked_by_the_zygote_and_is_its_own(zygote):
    proc, path = zygote
    env = dict(os.environ, **{ENV: path})
    first = _run_caller(env)
    assert first.returncode == 0, first.stderr
    _, server, group, parents = _result(first.stdout)
    assert parents == [server, server]          # the ranks are the server's children
    assert group == server                      # its own process group (setsid)
    assert "First launch only" not in first.stderr  # no server started by the caller
    # the caller has ended: its server and ranks with it; the zygote lives on
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server) and proc.poll() is None
    second = _run_caller(env)
    assert second.returncode == 0, second.stderr
    assert _result(second.stdout)[1] != server  # a fresh server for the next caller


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_killed_caller_takes_its_forked_server_and_ranks_along(zygote):
    proc, path = zygote
    caller = subprocess.Popen([sys.executable, "-c", CALLER, "hang"], cwd=ROOT,
                              env=dict(os.environ, **{ENV: path}), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    line = caller.stdout.readline()
    _, server, _, _ = _result(line)
    assert _parent(server) == proc.pid          # forked by the zygote, not by the caller
    caller.kill()                               # SIGKILL: no atexit, no goodbye
    caller.wait()
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(server)
    assert proc.poll() is None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_another_import_time_environment_gets_a_server_of_its_own(zygote):
    """OMP_NUM_THREADS is read when torch starts: a fork of the zygote would keep its
    value, so the zygote refuses and the caller starts a server as it would alone."""
    proc, path = zygote
    env = dict(os.environ, **{ENV: path}, OMP_NUM_THREADS="3")
    run = _run_caller(env)
    assert run.returncode == 0, run.stderr
    caller, server, _, _ = _result(run.stdout)
    assert "starting 2 ranks" in run.stderr
    assert not _alive(server) or _parent(server) != proc.pid


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_no_zygote_or_a_gone_one_means_a_server_started_as_usual(tmp_path):
    env = dict(os.environ, **{ENV: str(tmp_path / "nobody-listens.sock")})
    run = _run_caller(env)
    assert run.returncode == 0, run.stderr
    assert "starting 2 ranks" in run.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_zygote_dies_with_the_process_that_started_it():
    starter = textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c",
                              "from helpers.launch.zygote import zygote_entry; zygote_entry()"],
                             cwd={str(ROOT)!r}, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
        p.stdout.readline()
        print(p.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
