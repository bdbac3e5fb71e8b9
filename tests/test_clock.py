"""helpers.clock: one device-aware clock under every timeline.

Under nccl ``work.wait()`` and a Future's callbacks return when the collective
is queued, not done; a host clock read there measures the launch. The tests:

* a static guard: no module of helpers/ or benchmarks/ reads a host clock
  except helpers/clock.py and the allow-list below (each entry with why the
  read is not around GPU or collective work);
* the bug itself, on CPU, with doubles: a collective whose ``wait()`` returns
  at once while its transfer ends later (nccl's host-side wait), and a clock
  that resolves a mark to when all work the stream waits on has finished (a
  CUDA event on the current stream). The timeline code must then cover the
  transfer; the same code on the raw host clock does not;
* the clock's own behaviour on CPU, and on a GPU (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import ast
import contextlib
import pathlib
import threading
import time

import pytest
import torch
import torch.nn as nn

from helpers import clock
from helpers.clock import HostClock, clock_for, completed, elapsed, resolve, seconds, using

ROOT = pathlib.Path(__file__).resolve().parent.parent
HOST_CLOCKS = {"perf_counter", "time", "monotonic", "thread_time"}

# (file, function, clock function) -> why a host clock is right there: nothing
# it times runs on a GPU stream or inside a collective. "<module>": outside any def.
ALLOWED = {
    ("helpers/launch/pool.py", "_reply", "monotonic"): "deadline for the rank server's reply",
    ("helpers/launch/pool.py", "wait_ready", "monotonic"): "deadline for the rank server to start",
    ("helpers/launch/pool.py", "exit_code", "monotonic"): "deadline for a rank's exit",
    ("helpers/launch/pool.py", "kill_ranks", "monotonic"): "deadline for killed ranks to go",
    ("helpers/launch/pool.py", "get_pool", "monotonic"): "the rank server's start-up line",
    ("helpers/launch/pool.py", "_wait_for", "monotonic"): "the rank server's start-up line",
    ("helpers/launch/pool.py", "wait", "monotonic"): "deadline for a zygote-forked server to end",
    ("helpers/launch/launcher.py", "launch", "monotonic"): "the launch's timeout",
    ("helpers/launch/launcher.py", "_collect", "monotonic"): "the launch's timeout",
    ("helpers/launch/torchrun.py", "_wait_for_agent", "time"):
        "a failed job's deadline, shared by its ranks through the store (wall clock: "
        "other processes and nodes read it), after the collectives failed",
    ("helpers/checkpoint/async_save.py", "save", "perf_counter"):
        "host stall of a checkpoint save (copy to host memory; disk, not GPU work)",
    ("helpers/checkpoint/async_save.py", "_write", "perf_counter"): "seconds to write a file",
    ("helpers/checkpoint/job.py", "start_torchrun", "perf_counter"):
        "start of a torchrun subprocess, for its wall seconds and its timeout",
    ("helpers/checkpoint/job.py", "wait", "perf_counter"): "the same subprocess's end",
    ("helpers/checks/ch17.py", "fsync", "time"):
        "orders a traced save's file events (fsync, rename): files, not GPU work",
    ("helpers/checks/ch17.py", "rename", "time"): "the same file-event order",
    ("helpers/checks/race_schedule.py", "wait_for_others", "monotonic"):
        "deadline for the other ranks' status files in the atomic-save schedule (files)",
    ("helpers/debug/recorder.py", "begin", "time"):
        "wall-clock stamp of a call for the cross-rank diff (GPU completion: a clock mark)",
    ("helpers/debug/recorder.py", "finish", "time"): "wall-clock stamp of the host return",
    ("helpers/debug/recorder.py", "_poll", "time"): "wall-clock stamp of an observed completion",
    ("helpers/pipeline/executor.py", "computing", "thread_time"):
        "CPU seconds of the host thread (cpu_share), a host quantity by definition",
    ("helpers/pipeline/executor.py", "done", "thread_time"): "the same CPU seconds, read at the end",
    ("benchmarks/bench_launch.py", "main", "perf_counter"): "start-up time of the launcher's processes",
    ("benchmarks/bench_launch.py", "first_launch", "perf_counter"):
        "a fresh rank server's first launch, wall time of process start-up",
    ("benchmarks/bench_first_check.py", "run_cell", "perf_counter"):
        "a fresh kernel's first check cell, wall time as the learner waits for it",
    ("helpers/launch/stacks.py", "where", "monotonic"):
        "deadline for the hung ranks' stack dumps (files), after the launch timed out",
    ("benchmarks/bench_planner.py", "_cold_plan", "perf_counter"): "the planner's host search time",
    ("benchmarks/bench_checkpoint.py", "timed", "perf_counter"):
        "checkpoint save/load wall time (files; barriers around it)",
    ("benchmarks/bench_checkpoint.py", "measure", "perf_counter"):
        "the training thread's host stall while a checkpoint is handed off",
    ("benchmarks/bench_debug.py", "per_call", "thread_time"):
        "CPU seconds of the recorder's Python wrapper (gloo, CPU tensors)",
    ("benchmarks/bench_ddp.py", "main", "perf_counter"): "the whole run's wall time, printed",
    ("benchmarks/bench_debug.py", "main", "perf_counter"): "the whole run's wall time, printed",
    ("benchmarks/bench_collectives.py", "main", "perf_counter"): "the whole run's wall time, printed",
    ("benchmarks/bench_topology.py", "main", "perf_counter"): "the whole run's wall time, printed",
}


class _Reads(ast.NodeVisitor):
    """(enclosing function, host clock function) of every read in a module."""

    def __init__(self):
        self.stack, self.found = ["<module>"], set()

    def visit_FunctionDef(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node):
        if node.attr in HOST_CLOCKS and isinstance(node.value, ast.Name) \
                and node.value.id == "time":
            self.found.add((self.stack[-1], node.attr))
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        if node.module == "time":
            self.found |= {(self.stack[-1], a.name) for a in node.names if a.name in HOST_CLOCKS}


def host_clock_reads(path: pathlib.Path) -> set[tuple[str, str]]:
    """(function, clock) for each ``time.X`` / ``from time import X`` in ``path``."""
    reads = _Reads()
    reads.visit(ast.parse(path.read_text()))
    return reads.found


def scan(root: pathlib.Path) -> set[tuple[str, str, str]]:
    files = [*(root / "helpers").rglob("*.py"), *(root / "benchmarks").glob("*.py")]
    return {(p.relative_to(root).as_posix(), fn, clk) for p in files
            if p.relative_to(root).as_posix() != "helpers/clock.py"
            for fn, clk in host_clock_reads(p)}


def test_only_the_clock_and_the_allow_list_read_host_clocks():
    reads = scan(ROOT)
    assert sorted(reads - ALLOWED.keys()) == [], \
        "time this with helpers.clock (or allow-list it here with the reason)"
    assert sorted(ALLOWED.keys() - reads) == [], "allow-list entries no file needs any more"


def test_the_guard_sees_a_planted_read(tmp_path):
    (tmp_path / "helpers").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "helpers" / "clock.py").write_text("import time\nt = time.perf_counter()\n")
    (tmp_path / "helpers" / "a.py").write_text(
        "import time\ndef step():\n    return time.perf_counter()\n")
    (tmp_path / "benchmarks" / "b.py").write_text("from time import monotonic\n")
    assert scan(tmp_path) == {("helpers/a.py", "step", "perf_counter"),
                              ("benchmarks/b.py", "<module>", "monotonic")}


# --------------------------------------------------------------------------
# Doubles: nccl's asynchronous completion, on CPU.
# --------------------------------------------------------------------------

class StreamClock:
    """A clock double: a mark resolves to when everything the current stream
    waits on has finished, as a CUDA event recorded on it does. Work joins the
    stream when it is waited on (``wait()``) and, for the callback's duration,
    inside a Future's callback (torch runs callbacks on streams synchronized
    with the collective)."""

    def __init__(self):
        self.ready = 0.0                  # the stream's backlog ends here (host seconds)
        self._local = threading.local()   # .inside: the callback's work end

    def mark(self) -> float:
        return max(time.perf_counter(), self.ready, getattr(self._local, "inside", 0.0))

    def seconds(self, mark: float) -> float:
        return mark

    @contextlib.contextmanager
    def callback_of(self, work):
        self._local.inside = work.done_at
        try:
            yield
        finally:
            self._local.inside = 0.0


class LateWork:
    """A collective whose ``wait()`` returns at once (nccl's host-side wait)
    while its transfer ends ``transfer`` seconds after it was issued."""

    def __init__(self, clk: StreamClock, transfer: float, value=None):
        self.clk, self.value = clk, value
        self.issued = time.perf_counter()
        self.done_at = self.issued + transfer

    def wait(self, timeout=None):
        self.clk.ready = max(self.clk.ready, self.done_at)  # the stream now waits on it
        return True

    def get_future(self):
        return LateFuture(self)


class LateFuture:
    """Its callbacks run at once (the collective is "done" on the host) on a
    stream that waits for the transfer."""

    def __init__(self, work: LateWork):
        self.work = work

    def add_done_callback(self, fn):
        with self.work.clk.callback_of(self.work):
            fn(self)

    def then(self, fn):
        with self.work.clk.callback_of(self.work):
            value = fn(self)
        return LateFuture(LateWork(self.work.clk, 0.0, value))

    def value(self):
        return self.work.value

    def wait(self):
        self.work.wait()
        return self.work.value


TRANSFER = 0.5  # seconds of injected transfer; nothing sleeps, so any value is free


def overlap_spans(clk):
    """Issue, compute 1 ms, wait: the Timeline (and the late work)."""
    from helpers.overlap import Timeline, issue_mark, record_comm, wait_comm

    tl = Timeline(clock=clk)
    t0 = issue_mark(tl)
    work = LateWork(clk if isinstance(clk, StreamClock) else StreamClock(), TRANSFER)
    record_comm(tl, work, "all-reduce", t0)
    with tl.span("compute", "backward"):
        time.sleep(0.001)
    wait_comm(tl, work, "all-reduce")
    return tl, work


def test_overlap_timeline_covers_the_transfer():
    tl, work = overlap_spans(StreamClock())
    (comm,) = [e for e in tl.events if e["lane"] == "comm"]
    (wait,) = [e for e in tl.events if e["lane"] == "wait"]
    (compute,) = [e for e in tl.events if e["lane"] == "compute"]
    assert comm["start"] <= work.issued and comm["end"] >= work.done_at
    # the rank waited from the end of its compute until the transfer ended
    assert wait["start"] >= compute["end"] and wait["end"] >= work.done_at
    assert tl.exposed_comm()["exposed"] == pytest.approx(work.done_at - wait["start"])


def test_overlap_timeline_on_the_host_clock_misses_the_transfer():
    """The bug guarded against: the same code, host clock, sees only the launch."""
    tl, _ = overlap_spans(HostClock())
    (comm,) = [e for e in tl.events if e["lane"] == "comm"]
    assert comm["end"] - comm["start"] < TRANSFER / 2


def ddp_bucket_spans(clk) -> list[dict]:
    """One backward of a two-bucket BucketedDDP whose all-reduces are late works."""
    from helpers.ddp import BucketedDDP
    from helpers.overlap import ddp_timeline

    stream = clk if isinstance(clk, StreamClock) else StreamClock()

    def late_hook(flat, group):
        return LateFuture(LateWork(stream, TRANSFER, flat))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
    with using(clk):
        ddp = BucketedDDP(model, bucket_cap_mb=0.001, first_bucket_mb=0.001,
                          comm_hook=late_hook)
    assert len(ddp.buckets) >= 2  # 4 KB of gradients per layer against 1 KB caps
    start = clk.mark()
    ddp(torch.randn(8, 64)).square().mean().backward()
    events = ddp_timeline(ddp.timeline, seconds(start), seconds(clk.mark()))
    return [e for e in events if e["lane"] == "comm"]


def test_ddp_bucket_timeline_covers_the_transfer():
    spans = ddp_bucket_spans(StreamClock())
    assert spans and all(e["end"] - e["start"] >= TRANSFER for e in spans)


def test_ddp_bucket_timeline_on_the_host_clock_misses_the_transfer():
    spans = ddp_bucket_spans(HostClock())
    assert spans and all(e["end"] - e["start"] < TRANSFER / 2 for e in spans)


def pipeline_recv_wait(clk) -> tuple[float, float]:
    """One action whose input is a late receive: StepRecorder's recv_wait, and
    the least it must be to cover the transfer (from the wait to its end)."""
    from helpers.pipeline.executor import StepRecorder
    from helpers.pipeline.schedules import Action

    stream = clk if isinstance(clk, StreamClock) else StreamClock()
    rec = StepRecorder([], measure_stash=False, clock=clk)
    work = LateWork(stream, TRANSFER)
    rec.waiting()
    least = work.done_at - time.perf_counter()  # the waiting mark is before this read
    work.wait()
    rec.computing()
    rec.done(Action("F", 0))
    res = rec.result(None, 1)
    (start, end, _), = res.timeline
    assert end >= start
    return res.recv_wait[0], least


def test_pipeline_recv_wait_covers_the_transfer():
    wait, least = pipeline_recv_wait(StreamClock())
    assert wait >= least > TRANSFER / 2


def test_pipeline_recv_wait_on_the_host_clock_misses_the_transfer():
    wait, least = pipeline_recv_wait(HostClock())
    assert wait < TRANSFER / 2 < least


def ring_spans(clk, monkeypatch) -> tuple[list[dict], list[LateWork]]:
    """ring_forward on one process posing as rank 0 of 2, its K/V exchange a late work."""
    from helpers.sp.attention import ring

    stream = clk if isinstance(clk, StreamClock) else StreamClock()
    works = []

    def late_shift(x, group=None, tag=0):
        works.append(LateWork(stream, TRANSFER))
        return x.clone(), [works[-1]]

    monkeypatch.setattr(ring, "check_qkv", lambda q, k, v, group, layout: (2, 0, 2 * q.size(-2)))
    monkeypatch.setattr(ring, "ring_shift", late_shift)
    q, k, v = torch.randn(3, 1, 2, 8, 4).unbind(0)  # (batch, heads, seq/cp, head_dim)
    timeline: list[dict] = []
    with using(clk):
        ring.ring_forward(q, k, v, timeline=timeline)
    return timeline, works


def test_ring_attention_timeline_covers_the_transfer(monkeypatch):
    timeline, (work,) = ring_spans(StreamClock(), monkeypatch)
    (comm,) = [e for e in timeline if e["lane"] == "comm"]
    (wait,) = [e for e in timeline if e["lane"] == "wait"]
    assert comm["start"] <= work.issued and comm["end"] >= work.done_at
    assert wait["end"] >= work.done_at


def test_ring_attention_timeline_on_the_host_clock_misses_the_transfer(monkeypatch):
    timeline, _ = ring_spans(HostClock(), monkeypatch)
    (comm,) = [e for e in timeline if e["lane"] == "comm"]
    assert comm["end"] - comm["start"] < TRANSFER / 2


class FakeEvent:
    """A CUDA event's ``query()``: False until the test says the GPU got there."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_recorder_keeps_a_gpu_call_scheduled_until_its_event_completes():
    """Under nccl a call returns once queued (a stuck one too): the recorder
    calls it completed (``end`` set) only once the event after it completed."""
    from helpers.debug.recorder import CallRecord, Recorder

    event = FakeEvent()

    class EventClock:
        def mark(self):
            return clock.CudaMark(event, self)

    rec = CallRecord(rank=0, seq=0, op="all_reduce", group=(0, 1), peer=None, shapes=((4,),),
                     dtypes=("float32",), where=[], start=time.time())
    recorder = Recorder()
    with using(EventClock()):
        recorder.finish(rec, "returned", None, torch.device("cuda", 0))
    assert rec.returned is not None and rec.end is None
    assert rec.state == "scheduled, not completed"
    time.sleep(0.02)                      # ten polls: still not completed
    assert rec.end is None
    event.done = True
    deadline = time.monotonic() + 5.0     # the poller looks every 2 ms
    while rec.end is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert rec.end is not None and rec.state == "returned"


def test_recorder_on_cpu_return_is_done():
    from helpers.debug.recorder import CallRecord, Recorder

    rec = CallRecord(rank=0, seq=0, op="all_reduce", group=(0, 1), peer=None, shapes=((4,),),
                     dtypes=("float32",), where=[], start=time.time())
    Recorder().finish(rec, "returned", None, torch.device("cpu"))
    assert rec.end == rec.returned and rec.state == "returned"


# --------------------------------------------------------------------------
# The clock on CPU.
# --------------------------------------------------------------------------

def test_cpu_marks_are_perf_counter_seconds():
    clk = clock_for("cpu")
    assert isinstance(clk, HostClock) and clock_for(torch.zeros(1)) is clk
    before = time.perf_counter()
    m = clk.mark()
    after = time.perf_counter()
    assert isinstance(m, float) and before <= m <= after
    assert seconds(m) == m and completed(m)
    assert elapsed(1.0, 3.5) == 2.5


def test_default_device_outside_a_launch_is_the_host():
    assert isinstance(clock_for(), HostClock)


def test_using_installs_a_clock_and_puts_the_old_one_back():
    double = StreamClock()
    with using(double):
        assert clock_for("cpu") is double and clock_for("cuda:0") is double
    assert isinstance(clock_for("cpu"), HostClock)


def test_resolve_turns_marks_into_seconds_and_keeps_the_shape():
    class FakeCudaMark(clock.CudaMark):  # no GPU here: a mark whose clock answers 2.0
        pass

    class Answer:
        def seconds(self, mark):
            return 2.0

    m = FakeCudaMark(None, Answer())
    data = {"a": [m, 1.0, (m, "x")], "b": 3}
    assert resolve(data) == {"a": [2.0, 1.0, (2.0, "x")], "b": 3}


# --------------------------------------------------------------------------
# The clock on a GPU (make test-gpu).
# --------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_marks_resolve_to_when_the_gpu_finished():
    clk = clock_for("cuda:0")
    assert isinstance(clk, clock.CudaClock) and clock_for("cuda:0") is clk
    torch.cuda.synchronize()
    t0 = clk.mark()
    torch.cuda._sleep(200_000_000)   # a spin kernel: ~0.1 s or more on any current GPU
    host_returned = time.perf_counter()
    t1 = clk.mark()
    assert not completed(t1)         # queued, not run: the host is far ahead
    assert seconds(t1) > host_returned  # ... and the mark says when the GPU got there
    assert elapsed(t0, t1) > 0.01
    assert completed(t1)


@pytest.mark.gpu
def test_cuda_marks_are_on_the_host_scale():
    """Origin + event time: a mark on an idle stream lands within a few ms of the
    host clock (tolerance: the event's launch and a synchronize, both microseconds,
    times a generous factor for a shared node)."""
    clk = clock_for("cuda:0")
    torch.cuda.synchronize()
    before = time.perf_counter()
    m = clk.mark()
    torch.cuda.synchronize()
    after = time.perf_counter()
    assert before - 5e-3 <= seconds(m) <= after + 5e-3
