"""helpers.launch: results, seeding, output, every way a launch can fail,
and fresh ranks for every launch.

Each failure test asserts the rank named in the message and that no rank
process is left behind (the rank server, which never runs user code, stays).
"""

import contextlib
import dataclasses
import gc
import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import typing

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from helpers import RankError, RankTimeout, launch, rank_info, shutdown
from helpers.launch.arguments import resolve_backend


def child_pids() -> set[int]:
    """Live (non-zombie) children of this process, read from /proc."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(entry))
    return found


def assert_no_children():
    deadline = time.monotonic() + 5
    while child_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child_pids() == set(), "ranks left behind"


LAUNCH = sys.modules["helpers.launch.pool"]  # the rank server's handle: LAUNCH._POOL


def rank_pids() -> set[int]:
    """Our processes other than the rank server and its spares (forked ahead,
    they never ran anything): the server's children named course-rank, or (a
    pool of ranks started directly) our children. Empty when no rank is alive."""
    server = LAUNCH._POOL.proc.pid if getattr(LAUNCH._POOL, "proc", None) else None
    found = child_pids() - {server}
    if server is not None:
        # (a just-forked spare shows the server's name until it renames itself)
        found |= {p for p in all_pids() if parent_of(p) == server and name_of(p) == "course-rank"}
    return found


def name_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def assert_no_ranks():
    deadline = time.monotonic() + 5
    while rank_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = rank_pids()
    assert left == set(), f"ranks left behind: {[(p, name_of(p)) for p in left]}"


def test_results_in_rank_order_with_closure_args_and_kwargs():
    offset = 10.0  # closed over: the function travels by value

    def fn(a, *, b):
        info = rank_info()
        t = torch.tensor([float(info.rank)])
        dist.all_reduce(t)
        return {"rank": info.rank, "world": info.world_size, "sum": t.item() + offset + a + b,
                "backend": info.backend, "device": info.device}

    out = launch(fn, 3, 1.0, b=2.0)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 and o["sum"] == 3 + 13 for o in out)
    # gloo on CPU here; on a node with 3 or more GPUs "auto" picks nccl, a rank per GPU
    backend = resolve_backend("auto", 3)
    assert all(o["backend"] == backend for o in out)
    assert [o["device"] for o in out] == (["cpu"] * 3 if backend == "gloo" else
                                          [f"cuda:{r}" for r in range(3)])


def test_namedtuple_and_dataclass_results_come_back_detached():
    """to_cpu looks inside NamedTuples and dataclasses as it does inside lists,
    tuples and dicts: otherwise, on a GPU node, their CUDA tensors reached the
    caller; here, their tensors came back still requiring grad (detach is the
    half of to_cpu a CPU run can see)."""
    class Pair(typing.NamedTuple):
        loss: torch.Tensor
        grads: list

    @dataclasses.dataclass(frozen=True)
    class Result:
        pair: Pair
        weight: torch.Tensor
        step: int = 0

    def fn():
        w = torch.nn.Parameter(torch.full((3,), float(dist.get_rank() + 1)))
        return Result(Pair((w * w).sum(), [w * 2]), w, step=7)

    out = launch(fn, 2)
    for rank, r in enumerate(out):
        assert type(r).__name__ == "Result" and type(r.pair).__name__ == "Pair"
        assert r.pair._fields == ("loss", "grads") and r.step == 7
        tensors = [r.pair.loss, r.pair.grads[0], r.weight]
        assert not any(t.requires_grad for t in tensors), [t.requires_grad for t in tensors]
        assert type(r.weight) is torch.Tensor  # the Parameter, detached
        assert r.pair.loss.item() == 3 * (rank + 1) ** 2
        assert r.pair.grads[0].tolist() == [2.0 * (rank + 1)] * 3


def test_to_cpu_rebuilds_containers_and_leaves_the_original_alone():
    """The same without ranks: a frozen dataclass with an init=False field, a
    NamedTuple, nested in a list and a dict; other objects pass through as they are."""
    from helpers.launch.rank import to_cpu

    class Point(typing.NamedTuple):
        x: torch.Tensor
        y: int

    @dataclasses.dataclass(frozen=True)
    class Box:
        t: torch.Tensor
        points: list
        derived: torch.Tensor = dataclasses.field(init=False)
        unset: object = dataclasses.field(init=False)

        def __post_init__(self):
            object.__setattr__(self, "derived", self.t * 3)

    w = torch.ones(2, requires_grad=True)
    box = Box(w * 2, [Point(w + 1, 5)])
    marker = object()
    out = to_cpu({"box": box, "other": marker, "pair": (w,)})
    got = out["box"]
    assert type(got) is Box and type(got.points[0]) is Point and got.points[0].y == 5
    assert not any(t.requires_grad for t in (got.t, got.derived, got.points[0].x, out["pair"][0]))
    assert got.derived.tolist() == [6.0, 6.0] and not hasattr(got, "unset")
    assert out["other"] is marker
    assert box.t.requires_grad and box.points[0].x.requires_grad  # the original: untouched


def test_server_is_reused_and_every_launch_gets_fresh_ranks():
    launch(os.getpid, 2)
    server = LAUNCH._POOL
    start = time.perf_counter()
    pids = launch(os.getpid, 2)
    assert time.perf_counter() - start < 1.0  # target is 0.3 s; generous for a loaded CI box
    assert_no_ranks()                          # a launch's ranks exit when it returns
    assert set(launch(os.getpid, 4)).isdisjoint(pids)  # new processes, any world size
    assert LAUNCH._POOL is server and server.alive()


def test_rank_output_reaches_caller_prefixed(capsys):
    def talk():
        print("hello from", rank_info().rank)
        print("no newline at the end", end="")

    launch(talk, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 1] no newline at the end" in out


def _chatty(lines: int):
    for i in range(lines):
        print(f"line {i}")
    if rank_info().rank == 1 and lines > 10:
        raise ValueError("and then it failed")
    return lines


def test_a_rank_that_prints_too_much_is_cut_short_with_where_the_rest_is(capsys):
    """200,000 lines from one rank would freeze a notebook's browser tab: the first
    SHOWN_LINES are streamed, the rest held back, and the note says where all of it is,
    also when the launch then fails."""
    from helpers.launch import launcher

    with pytest.raises(RankError, match="and then it failed"):
        launch(_chatty, 2, 200_000)
    captured = capsys.readouterr()
    for rank in (0, 1):
        shown = [ln for ln in captured.out.splitlines() if ln.startswith(f"[rank {rank}] line ")]
        assert len(shown) == launcher.SHOWN_LINES
        assert shown[-1] == f"[rank {rank}] line {launcher.SHOWN_LINES - 1}"
        note = [ln for ln in captured.err.splitlines()
                if ln.startswith(f"[launch] rank {rank} printed 200,000 lines")]
        assert len(note) == 1 and "only the first 1,000 lines" in note[0]
        path = note[0].rsplit(" ", 1)[1]
        with open(path) as f:
            whole = f.read().splitlines()
        assert len(whole) == 200_000 and whole[-1] == f"[rank {rank}] line 199999"
        assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    launch(_chatty, 2, 3)  # a short output: all of it, and no note
    captured = capsys.readouterr()
    assert captured.out.count("] line ") == 6 and "[launch]" not in captured.err


def _one_long_line():
    print("x" * 1_000_000)


def test_one_line_too_long_to_show_is_not_said_to_be_shown(capsys):
    """The note says what reached the screen: here nothing did."""
    launch(_one_long_line, 1)
    err = capsys.readouterr().err
    note = [ln for ln in err.splitlines() if ln.startswith("[launch] rank 0 printed 1 line ")]
    assert len(note) == 1 and "none of it is shown above" in note[0], err[-500:]


def _listening_sockets_of_this_process() -> set[str]:
    """Inodes of TCP sockets in LISTEN state (st 0A) that this process holds open."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A":
                    listening.add(fields[9])
    ours = {os.readlink(f"/proc/self/fd/{fd}")[8:-1] for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")
            and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:[")}
    return listening & ours


def test_the_rendezvous_is_private_to_its_user():
    """Ranks meet through a file in a folder only this user can enter, not a TCP port
    anyone on the machine can connect to (torchrun's TCPStore)."""
    launch(os.getpid, 2)
    assert _listening_sockets_of_this_process() == set()  # nothing to connect to
    rundir = LAUNCH._POOL.rundir
    st = os.stat(rundir)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    if os.getuid() != 0:
        pytest.skip("a stranger's access is tried as root only (it becomes another user)")
    # A stranger (another user of the machine) can neither list nor open it: a child
    # that becomes "nobody" tries.
    probe = textwrap.dedent(f"""
        import os, sys
        os.setgid(65534); os.setuid(65534)
        for what in (lambda: os.listdir({rundir!r}),
                     lambda: open(os.path.join({rundir!r}, "launch1.store"), "a")):
            try:
                what()
                sys.exit("a stranger got in")
            except PermissionError:
                pass
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_in_a_notebook_the_server_starts_with_the_import(capsys):
    """helpers.launch.pool.prestart (what ``import helpers`` calls in a kernel) starts
    the server without waiting; the first launch then waits only for what is left."""
    shutdown()
    LAUNCH.prestart()
    server = LAUNCH._POOL
    assert server is not None and not server.ready
    assert launch(os.getpid, 2) and LAUNCH._POOL is server and server.ready
    assert "ready in" in capsys.readouterr().err
    LAUNCH.prestart()  # a second import (a rerun cell) changes nothing
    assert LAUNCH._POOL is server


def test_in_a_kernel_import_helpers_starts_the_server_before_its_slow_imports():
    """In a kernel, ``import helpers`` starts the server first, so that its seconds
    overlap the rest of the import (the collective recorder, matplotlib), not follow it.
    A fresh interpreter that looks like a kernel records, with an audit hook, when the
    server's process starts and when matplotlib is imported."""
    probe = textwrap.dedent("""
        import sys, types
        sys.modules["ipykernel"] = types.ModuleType("ipykernel")  # looks like a kernel
        events = []
        def hook(event, args):
            # the server's own process only: torch's CUDA build may start others at
            # import (seen with torch 2.14.1+cu130 on a machine without a GPU)
            if (event == "subprocess.Popen" and "server_entry" in str(args[1])) or \
                    (event == "import" and args[0] == "matplotlib"):
                events.append(event)
        sys.addaudithook(hook)
        import helpers
        from helpers.launch import pool
        assert pool._POOL is not None, "import helpers started no server"
        pool.kill_pool()  # (now: a stop would wait for the server to finish importing)
        print(events[:2])
    """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items()
                                            if k != "_COURSE_POOL_WORKER"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "['subprocess.Popen', 'import']"


def test_same_seed_on_every_rank_matches_single_process():
    torch.manual_seed(0)
    want = torch.rand(4)
    got = launch(lambda: torch.rand(4), 2)
    assert all(torch.equal(g, want) for g in got)
    per_rank = launch(lambda: torch.rand(4), 2, seed=5, seed_per_rank=True)
    for r, g in enumerate(per_rank):
        torch.manual_seed(5 + r)
        assert torch.equal(g, torch.rand(4))


def test_rank_that_raises_is_named_with_type_message_and_traceback():
    def fn():
        if rank_info().rank == 1:
            raise ValueError("shape mismatch on purpose")
        dist.all_reduce(torch.ones(1))  # rank 0 would wait forever for rank 1

    start = time.monotonic()
    with pytest.raises(RankError) as err:
        launch(fn, 2, timeout=30)
    assert time.monotonic() - start < 15
    e = err.value
    assert e.rank == 1 and e.exc_type == "ValueError"
    assert "rank 1 raised ValueError: shape mismatch on purpose" in str(e)
    assert "traceback of rank 1" in str(e) and "in fn" in e.rank_traceback
    assert isinstance(e.__cause__, ValueError)
    assert_no_ranks()


@pytest.mark.parametrize("how, words", [
    ("os._exit(3)", "exited with code 3"),
    ("os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ("ctypes.string_at(0)", "SIGSEGV"),
])
def test_rank_that_dies_is_named_with_how(how, words):
    code = f"import os, signal, ctypes\nif rank == 1:\n    {how}\n"

    def fn():
        rank = rank_info().rank  # noqa: F841 (used by exec)
        exec(code)
        dist.all_reduce(torch.ones(1))

    with pytest.raises(RankError) as err:
        launch(fn, 2, timeout=30)
    assert err.value.rank == 1
    assert str(err.value).startswith("rank 1 ") and words in str(err.value)
    assert_no_ranks()


def _dies_mid_step():
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank_info().rank == 1:
        os._exit(3)
    dist.all_reduce(t)  # the peers fail here with "Connection closed by peer"


def test_a_rank_that_dies_mid_step_is_named_not_a_peer_that_lost_it():
    """The peers' "connection closed" errors can reach the caller before the
    dead rank's own socket closes; the dead rank is still the one named.
    A fresh server each time: the first launch forks its ranks while it
    holds the launch's sockets, which once left a copy of rank 1's socket in
    rank 2 (so rank 1's death was not seen until rank 2 died too)."""
    for _ in range(3):
        shutdown()
        with pytest.raises(RankError) as err:
            launch(_dies_mid_step, 3, timeout=30)
        assert (err.value.rank, err.value.exc_type) == (1, "died"), str(err.value)
        assert str(err.value).startswith("rank 1 exited with code 3")
    assert_no_ranks()


def test_a_dead_rank_whose_socket_stays_open_is_named_from_its_exit_status(tmp_path):
    """Rank 1 forks a child that inherits its sockets (as a DataLoader worker
    would) and dies: no socket closes, and its peers wait in the all-reduce, so
    only the rank server's exit report can tell. Without it the launch ends in
    a timeout naming ranks 0 and 2."""
    pid_file = tmp_path / "child.pid"

    def fn():
        dist.all_reduce(torch.ones(4))
        if rank_info().rank == 1:
            if os.fork() == 0:  # the child keeps every socket of rank 1 open
                pid_file.write_text(str(os.getpid()))
                time.sleep(60)
                os._exit(0)
            while not pid_file.exists():
                time.sleep(0.01)
            os._exit(3)
        dist.all_reduce(torch.ones(4))

    start = time.monotonic()
    try:
        with pytest.raises(RankError) as err:
            launch(fn, 3, timeout=15)
    finally:
        with contextlib.suppress(Exception):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert (err.value.rank, err.value.exc_type) == (1, "died"), str(err.value)
    assert "exited with code 3" in str(err.value)
    assert time.monotonic() - start < 10  # named from the report, not at the timeout
    assert_no_ranks()


def test_the_dead_rank_is_named_on_a_loaded_machine():
    """Busy loops on every core (more than cores): the dead rank is still named,
    each of several times (a grace window would be a guess under load)."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 * (os.cpu_count() or 1))]
    try:
        for _ in range(3):
            with pytest.raises(RankError) as err:
                launch(_dies_mid_step, 3, timeout=60)
            assert (err.value.rank, err.value.exc_type) == (1, "died"), str(err.value)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert_no_ranks()


def test_deadlock_missing_collective_names_the_stuck_rank():
    def fn():
        if rank_info().rank == 0:
            dist.all_reduce(torch.ones(1))

    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        launch(fn, 2, timeout=2)
    elapsed = time.monotonic() - start
    assert err.value.ranks == [0] and "rank(s) [0] did not finish" in str(err.value)
    assert elapsed < 2 + 10  # timeout plus server start-up and a few seconds
    assert_no_ranks()


def _one_rank_sleeps():
    t = torch.ones(2)
    if rank_info().rank == 2:
        time.sleep(60)  # the odd one out
    dist.all_reduce(t)


def test_timeout_says_where_each_rank_was_and_which_is_elsewhere():
    """Every rank is unfinished when one sleeps and the others wait for it in an
    all-reduce; the stacks the ranks dump at the deadline tell them apart."""
    with pytest.raises(RankTimeout) as err:
        launch(_one_rank_sleeps, 4, timeout=4)
    text = str(err.value)
    assert err.value.ranks == [0, 1, 2, 3] and err.value.rank == 2, text
    assert "rank 2: " in text and "time.sleep(60)" in text, text
    assert "ranks 0, 1, 3: " in text and "torch.distributed.all_reduce" in text, text
    assert "Rank 2 is the only one elsewhere" in text, text
    assert_no_ranks()


def test_timeout_names_no_odd_rank_when_two_wait_for_each_other():
    def fn():
        buf = torch.zeros(1)
        dist.recv(buf, src=1 - rank_info().rank)

    with pytest.raises(RankTimeout) as err:
        launch(fn, 2, timeout=2)
    assert "only one elsewhere" not in str(err.value)  # two places or one: no culprit
    assert "torch.distributed.recv" in str(err.value), str(err.value)


def test_deadlock_mismatched_send_recv_names_both_ranks():
    def fn():
        buf = torch.zeros(1)
        dist.recv(buf, src=1 - rank_info().rank)  # both wait to receive: nobody sends

    with pytest.raises(RankTimeout) as err:
        launch(fn, 2, timeout=2)
    assert err.value.ranks == [0, 1]
    assert_no_ranks()


def test_pool_recovers_after_failure():
    with pytest.raises(RankError):
        launch(lambda: 1 / 0, 2)
    assert launch(lambda: rank_info().rank, 2) == [0, 1]


def test_no_rank_outlives_a_failed_launch_even_when_every_rank_raised():
    """A failed check on every rank still kills every rank (the syllabus:
    after a failure no rank remains); a rank that raised may leave a pending
    send or half-built state behind, and the next launch must not see it."""
    launch(os.getpid, 2)
    server = LAUNCH._POOL

    def all_raise():
        if rank_info().rank == 0:
            dist.isend(torch.ones(1000), 1)  # left pending
        raise AssertionError("wrong answer")

    with pytest.raises(RankError, match="wrong answer"):
        launch(all_raise, 2, timeout=10)
    assert_no_ranks()
    assert LAUNCH._POOL is server  # the server never ran that code: it stays
    assert launch(lambda: dist.all_reduce(torch.ones(2)) or 1, 2) == [1, 1]


def test_bad_arguments_fail_before_any_rank_starts():
    before = child_pids()
    with pytest.raises(ValueError, match="world_size"):
        launch(print, 0)
    with pytest.raises(ValueError, match="world_size"):
        launch(print, "2")
    with pytest.raises(ValueError, match="backend"):
        launch(print, 2, backend="mpi")
    with pytest.raises(ValueError, match="timeout"):
        launch(print, 2, timeout=-1)
    with pytest.raises(TypeError, match="function"):
        launch(42, 2)
    if torch.cuda.device_count() < 2:
        with pytest.raises(RuntimeError, match="nccl"):
            launch(print, 2, backend="nccl")
    lock = __import__("threading").Lock()
    with pytest.raises(TypeError, match="picklable"):
        launch(print, 2, lock)
    assert child_pids() == before
    assert_no_ranks()  # (the last test's ranks may take a moment to exit)


SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from helpers import launch, rank_info

    def fn():
        t = torch.tensor([float(rank_info().rank + 1)])
        dist.all_reduce(t)
        return (rank_info().rank, rank_info().world_size, t.item())

    if __name__ == "__main__":
        import sys
        # one write per line: two processes share the pipe, and a short single
        # write is atomic where print's separate text and newline writes are not
        sys.stdout.write(f"RESULT {launch(fn, 2)}\\n")
        sys.stdout.flush()
""")


def test_two_launches_at_once_do_not_collide(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all("RESULT [(0, 2, 3.0), (1, 2, 3.0)]" in o for o in outs), outs


# Under torchrun, launch creates the job's group, so it must also take it down:
# a gloo group alive at interpreter exit aborted rank 0 in about one run in five
# ("terminate called without an active exception", SIGABRT) and failed CI. The
# exit-code check alone catches that only by luck, so the job also runs its exit
# handlers early and reports whether the group is gone.
TORCHRUN_SCRIPT = SCRIPT + textwrap.dedent("""
    if __name__ == "__main__":
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.write(f"GROUP_LEFT {dist.is_initialized()}\\n")
        sys.stdout.flush()
""")


def test_same_code_runs_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", str(script)],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    # every process of the job gets every rank's result
    assert out.stdout.count("RESULT [(0, 2, 3.0), (1, 2, 3.0)]") == 2, out.stdout
    assert out.stdout.count("GROUP_LEFT False") == 2, out.stdout


@pytest.mark.parametrize("local_rank", [0, 1])
def test_torchrun_processes_agree_on_the_backend(monkeypatch, local_rank):
    # Two processes on a node with one GPU: both must choose gloo. Deciding
    # from a process's own LOCAL_RANK gave rank 0 nccl and rank 1 gloo, and
    # the job died at its first collective (seen on an H100 node).
    chosen = []

    def fake_init(backend, **kwargs):
        chosen.append(backend)
        raise SystemExit  # stop before any real group is made

    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with pytest.raises(SystemExit):
        launch(print, 2)
    assert chosen == ["gloo"]
    with pytest.raises(RuntimeError, match="one GPU per rank"):
        launch(print, 2, backend="nccl")  # asked for explicitly: refused by every process


def test_every_launch_gets_a_fresh_group():
    def leave_a_mess():
        # both ranks connected first: a rank that tears its group down while its peer
        # is still inside init_process_group's connect closes the socket under it
        # ("Connection closed by peer" on the peer), a race that is not this test's
        dist.barrier()
        dist.new_group([0])            # a subgroup, left behind
        dist.destroy_process_group()   # and no default group at all

    launch(leave_a_mess, 2)

    def total():
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    assert launch(total, 2) == [2.0, 2.0]


# --------------------------------------------------------------------------
# Every launch behaves as if its ranks were fresh (issue 12, item 3). Each of
# these failed with the pooled ranks that ran launch after launch.
# --------------------------------------------------------------------------

def test_environment_set_after_the_server_started_reaches_the_ranks(monkeypatch):
    launch(os.getpid, 2)  # the server is up before the variables are set
    monkeypatch.setenv("COURSE_TEST_SETTING", "set in a later cell")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")

    def look():
        from torch.distributed.distributed_c10d import _get_default_group
        # DETAIL is read when the group is made: it wraps the backend in a
        # checker of collective shapes and order (_ProcessGroupWrapper).
        wrapped = type(_get_default_group()._get_backend(torch.device("cpu"))).__name__
        return os.environ.get("COURSE_TEST_SETTING"), dist.get_debug_level().name, wrapped

    assert launch(look, 2) == [("set in a later cell", "DETAIL", "_ProcessGroupWrapper")] * 2
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    monkeypatch.delenv("COURSE_TEST_SETTING")
    assert launch(look, 2)[0] == (None, "OFF", "ProcessGroupGloo")


def test_nothing_a_launch_does_in_its_ranks_reaches_the_next(tmp_path, monkeypatch):
    def change_everything():
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        os.chdir("/")
        sys.path.append("/added/by/a/launch")
        torch.nn.Linear.__call__ = None  # a monkeypatch of torch itself

    def look():
        return (torch.ones(1).dtype, torch.is_grad_enabled(), os.getcwd(),
                "/added/by/a/launch" in sys.path, torch.nn.Linear.__call__ is not None)

    monkeypatch.chdir(tmp_path)  # the caller's directory, at the time of the call
    launch(change_everything, 2)
    assert launch(look, 2) == [(torch.float32, True, str(tmp_path), False, True)] * 2


def test_an_edited_and_reloaded_module_runs_its_new_code(tmp_path, monkeypatch):
    module = tmp_path / "course_edited_module.py"
    module.write_text("def answer():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import course_edited_module as mod  # pickled by reference: the ranks import it
    assert launch(mod.answer, 2) == [1, 1]
    # Another size, so the (mtime, size) check of cached bytecode sees the edit.
    module.write_text("def answer():\n    return 22\n")
    importlib.reload(mod)
    assert launch(mod.answer, 2) == [22, 22]


def test_server_restarts_when_what_it_imported_changes(tmp_path, monkeypatch, capsys):
    launch(os.getpid, 2)
    server = LAUNCH._POOL
    assert server.stale() is None
    # A variable read only when torch is imported: a fork would keep the old value.
    monkeypatch.setenv("OMP_SCHEDULE", "static")
    assert server.stale() == "$OMP_SCHEDULE changed (it is read when torch is imported)"
    monkeypatch.delenv("OMP_SCHEDULE")
    assert server.stale() is None
    # A file the server had imported changes on disk: its forks would run the old code.
    source = tmp_path / "imported_by_server.py"
    source.write_text("x = 1\n")
    server.stamps[str(source)] = os.stat(source).st_mtime_ns
    os.utime(source, ns=(0, 0))
    capsys.readouterr()
    launch(os.getpid, 2)
    assert LAUNCH._POOL is not server
    assert "imported_by_server.py changed: restarting the rank server" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Descriptors and lifetime (issue 12, item 4).
# --------------------------------------------------------------------------

def open_fds() -> int:
    return len([fd for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}")])


def test_failed_launches_leak_no_file_descriptors():
    launch(os.getpid, 2)
    gc.collect()
    gc.disable()  # what a learner's kernel does between collections: only refcounts free
    try:
        before = open_fds()
        errors = []
        for _ in range(4):  # each kept, with its traceback, as sys.last_value would be
            with pytest.raises(RankError) as err:
                launch(lambda: 1 / 0 if rank_info().rank == 1 else 0, 2)
            errors.append(err.value)
        with pytest.raises(RankTimeout) as err:
            launch(lambda: dist.recv(torch.zeros(1), src=1 - rank_info().rank), 2, timeout=1)
        errors.append(err.value)
        assert open_fds() == before
        rundir = LAUNCH._POOL.rundir
        shutdown()  # the socket to the server (our end and its duplicate) closes now
        assert open_fds() <= before - 2
        assert not os.path.exists(rundir)  # and the private folder is gone
        assert_no_children()
    finally:
        gc.enable()


# --------------------------------------------------------------------------
# Interrupts (issue 21, item 4).
# --------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _sigint_raises():
    """SIGINT raises KeyboardInterrupt, as in a terminal or a kernel, also when this run
    inherited SIGINT ignored (``make test &`` or nohup in a script: a shell starts
    background jobs with SIGINT ignored, and Python then installs no handler)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def interrupt_after(seconds: float) -> threading.Timer:
    """Ctrl-C / Jupyter's interrupt: SIGINT to this process, in `seconds`."""
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_interrupting_the_first_launch_while_it_starts_leaves_nothing():
    shutdown()
    interrupt_after(0.5)  # importing torch in the server takes seconds
    with pytest.raises(KeyboardInterrupt):
        launch(os.getpid, 2)
    assert_no_children()
    assert LAUNCH._POOL is None
    assert len(launch(os.getpid, 2)) == 2


def test_interrupting_a_running_launch_kills_its_ranks_only():
    launch(os.getpid, 2)
    server = LAUNCH._POOL
    interrupt_after(1.0)
    with pytest.raises(KeyboardInterrupt):
        launch(time.sleep, 2, 60)
    assert_no_ranks()
    assert LAUNCH._POOL is server and server.alive()


def test_a_server_that_died_is_replaced_not_reported(monkeypatch):
    launch(os.getpid, 2)
    server = LAUNCH._POOL
    os.kill(server.proc.pid, signal.SIGKILL)
    time.sleep(0.5)
    # Pretend its death went unseen (it happens between the check and the send).
    monkeypatch.setattr(type(server), "alive", lambda self: True)
    assert launch(lambda: rank_info().rank, 2) == [0, 1]
    assert LAUNCH._POOL is not server


KERNEL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from helpers import launch
    L = sys.modules["helpers.launch.pool"]
    launch(os.getpid, 2)
    server = L._POOL
    try:
        os.killpg(0, signal.SIGINT)  # Jupyter interrupts the kernel's whole group
        time.sleep(2)
    except KeyboardInterrupt:
        pass
    time.sleep(1)  # a rank or server that took that SIGINT would be dead by now
    print("IDLE SERVER KEPT", L._POOL is server and server.alive(), flush=True)
    print("RESULT", launch(lambda: 7, 2), L._POOL is server, flush=True)
    print("SERVER", server.proc.pid, flush=True)
    print("RUNDIR", server.rundir, flush=True)
    launch(lambda: print("RANK", os.getpid(), flush=True) or time.sleep(60), 2)
""")


def test_idle_server_ignores_the_kernels_sigint_and_dies_with_the_kernel(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL_SCRIPT)
    # A process group of its own, as a Jupyter kernel has.
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.getcwd()),
                              start_new_session=True)
    lines = []
    try:
        while sum(line.startswith("[rank") for line in lines) < 2:
            line = kernel.stdout.readline()
            assert line, f"the script ended early: {lines}"
            lines.append(line)
    finally:
        kernel.kill()  # the kernel dies (SIGKILL: no atexit, no cleanup)
        kernel.wait()
    assert "IDLE SERVER KEPT True\n" in lines
    assert "RESULT [7, 7] True\n" in lines
    pids = [int(line.split()[1]) for line in lines if line.startswith("SERVER")]
    pids += [int(line.split()[-1]) for line in lines if line.startswith("[rank")]
    deadline = time.monotonic() + 10
    while any(parent_of(p) is not None for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(parent_of(p) is None for p in pids), "server or ranks outlived the kernel"
    # the kernel could not remove the ranks' meeting folder: the server did, as it went
    rundir = next(line.split(maxsplit=1)[1].strip() for line in lines if line.startswith("RUNDIR"))
    deadline = time.monotonic() + 5
    while os.path.exists(rundir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(rundir), f"{rundir} outlived the kernel"


# --------------------------------------------------------------------------
# What the learner sees (issue 21, items 6 and 7).
# --------------------------------------------------------------------------

def test_first_launch_says_what_it_is_doing_once_and_outlives_its_thread(capsys):
    shutdown()
    # Started from a worker thread: PR_SET_PDEATHSIG is tied to the thread that
    # spawned a process, so ranks spawned from it used to die with the thread.
    worker = threading.Thread(target=launch, args=(os.getpid, 3))
    worker.start()
    worker.join()
    err = capsys.readouterr().err
    assert err.count("[launch] starting 3 ranks. First launch only: a rank server imports torch once") == 1
    assert "ready in" in err
    server = LAUNCH._POOL
    time.sleep(1.0)  # a death signal, if any, has arrived
    assert server.alive()
    launch(os.getpid, 2)
    assert LAUNCH._POOL is server
    assert "[launch]" not in capsys.readouterr().err


def test_rank_error_in_a_notebook_leads_with_rank_exception_and_the_learners_line():
    # A notebook cell's source is known to the kernel only (IPython caches it
    # in linecache under a made-up file name); the rank cannot read it.
    cell = "<ipython-input-7-course>"
    source = ("def train_step():\n"
              "    x = torch.ones(2)\n"
              "    if rank_info().rank == 1:\n"
              "        x = x @ torch.ones(3)  # the learner's bug\n"
              "    return x\n")
    import linecache
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    namespace = {"torch": torch, "rank_info": rank_info}
    exec(compile(source, cell, "exec"), namespace)
    try:
        with pytest.raises(RankError) as err:
            launch(namespace["train_step"], 2)
        lines = err.value._render_traceback_()
    finally:
        del linecache.cache[cell]
    assert lines[0].startswith("RankError: rank 1 raised RuntimeError:")
    assert "inconsistent tensor size" in lines[0]
    text = "\n".join(lines)
    assert f'File "{cell}", line 4, in train_step' in text
    assert "x = x @ torch.ones(3)  # the learner's bug" in text
    assert "helpers/launch/" not in text and "_rank_main" not in text  # no launcher internals
    assert "rank_traceback" in lines[-1]
    # The rank itself knew the cell's name and source (they travel with the
    # function): its own traceback text has the learner's line too.
    assert f'File "{cell}", line 4, in train_step' in err.value.rank_traceback
    assert "x = x @ torch.ones(3)  # the learner's bug" in err.value.rank_traceback
    # a rank that died has no frames: the message alone
    with pytest.raises(RankError) as err:
        launch(lambda: os._exit(3) if rank_info().rank == 1 else None, 2)
    assert err.value._render_traceback_() == [f"RankError: {err.value}"]


def test_shipped_code_keeps_its_file_name_whatever_the_serializer_does():
    # cloudpickle 3.1.3 renames a by-value function's code file to
    # "<dynamic-code>" (deterministic pickles); the rank must still see the
    # notebook cell's name, or tracebacks and the recorder lose the line.
    from helpers.launch.shipping import ship
    cell = "<ipython-input-9-ship>"
    source = "def f():\n    return 1\n"
    namespace = {}
    exec(compile(source, cell, "exec"), namespace)
    import linecache
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    try:
        payload, sources = ship((namespace["f"], (), {}))
    finally:
        del linecache.cache[cell]
    fn, _, _ = cloudpickle.loads(payload)
    assert fn.__code__.co_filename == cell and fn() == 1
    assert sources == {cell: (len(source), None, source.splitlines(True), cell)}
    # a function defined in a real file carries no source: the rank reads the file
    _, sources = ship((test_shipped_code_keeps_its_file_name_whatever_the_serializer_does, (), {}))
    assert sources == {}


def test_library_frames_are_folded_in_the_rendered_traceback():
    def fn():
        dist.all_reduce(torch.ones(2) if rank_info().rank == 0 else "not a tensor")

    with pytest.raises(RankError) as err:
        launch(fn, 2, timeout=10)
    text = "\n".join(err.value._render_traceback_())
    assert "in fn" in text and "dist.all_reduce(" in text
    assert "frame(s) inside torch" in text          # torch's own frames, folded
    assert "distributed_c10d.py" not in text
