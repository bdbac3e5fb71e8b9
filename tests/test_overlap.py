"""helpers.overlap: interval arithmetic, DDP and FSDP timelines, the profiler trace."""

import json

import pytest
import torch

from helpers import launch, rank_info
from helpers.overlap import (Timeline, ddp_timeline, exposed_comm, export_trace, short_label,
                             union_length)


def test_union_length_and_exposed():
    assert union_length([]) == 0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == 3
    assert union_length([(0, 4), (1, 2)]) == 4       # nested
    assert union_length([(0, 1), (1, 2)]) == 2       # touching
    ev = [{"lane": "comm", "name": "a", "start": 0.0, "end": 4.0},
          {"lane": "comm", "name": "b", "start": 1.0, "end": 2.0},
          {"lane": "wait", "name": "w", "start": 3.0, "end": 4.0},
          {"lane": "compute", "name": "c", "start": 0.0, "end": 3.0}]
    assert exposed_comm(ev) == {"total": 4.0, "exposed": 1.0, "hidden": 3.0}
    tl = Timeline()
    with pytest.raises(ValueError):
        tl.add("comm", "x", 2.0, 1.0)


def _spans(comm=(), wait=(), compute=()):
    return ([{"lane": "comm", "name": "c", "start": a, "end": b} for a, b in comm]
            + [{"lane": "wait", "name": "w", "start": a, "end": b} for a, b in wait]
            + [{"lane": "compute", "name": "f", "start": a, "end": b} for a, b in compute])


@pytest.mark.parametrize("comm, wait, total, exposed", [
    # nothing in flight: nothing to expose, however long the thread waited
    ([], [(0, 5)], 0, 0),
    # the thread never waited: everything hidden
    ([(0, 4)], [], 4, 0),
    # waited for the whole collective: all exposed
    ([(1, 3)], [(1, 3)], 2, 2),
    # a wait before the collective was issued and one after it ended count nothing
    ([(2, 4)], [(0, 1), (5, 6)], 2, 0),
    # a wait straddling the end: only the part inside counts
    ([(0, 4)], [(3, 6)], 4, 1),
    # two waits inside one collective, overlapping each other: counted once
    ([(0, 10)], [(2, 5), (4, 7)], 10, 5),
    # two overlapping collectives (union 0..6) and one wait across both
    ([(0, 4), (2, 6)], [(3, 5)], 6, 2),
    # one wait spanning a gap between two collectives: the gap is not exposed comm
    ([(0, 2), (4, 6)], [(1, 5)], 4, 2),
    # compute spans play no part in the metric
    ([(0, 2)], [(1, 2)], 2, 1),
])
def test_exposed_comm_on_constructed_spans(comm, wait, total, exposed):
    ev = _spans(comm, wait, compute=[(0, 1), (1.5, 9)])
    got = exposed_comm(ev)
    assert got == {"total": total, "exposed": exposed, "hidden": total - exposed}, got


def test_ddp_timeline_conversion():
    ddp = [{"bucket": 0, "event": "ready", "t": 1.0}, {"bucket": 0, "event": "launched", "t": 1.0},
           {"bucket": 1, "event": "ready", "t": 2.0}, {"bucket": 1, "event": "launched", "t": 2.0},
           {"bucket": 0, "event": "finished", "t": 1.5}, {"bucket": 1, "event": "finished", "t": 3.0}]
    ev = ddp_timeline(ddp, backward_start=0.0, backward_end=2.0)
    assert exposed_comm(ev) == {"total": 1.5, "exposed": 1.0, "hidden": 0.5}


def _timelines():
    from helpers.ddp import BucketedDDP
    from helpers.fsdp import FSDP
    from helpers.model import build_model

    r = rank_info()
    x = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(r.rank))
    out = {}
    for cap in (0.01, 1000):  # many small buckets vs one bucket
        ddp = BucketedDDP(build_model("toy", seed=0), bucket_cap_mb=cap, first_bucket_mb=cap)
        loss = ddp(x, x)[1]
        t0 = __import__("time").perf_counter()
        loss.backward()
        t1 = __import__("time").perf_counter()
        out[cap] = exposed_comm(ddp_timeline(ddp.timeline, t0, t1))
        out[f"n{cap}"] = len({e["bucket"] for e in ddp.timeline})
    for prefetch in (True, False):
        tl = Timeline()
        f = FSDP(build_model("toy", seed=0, n_layer=3), prefetch=prefetch, timeline=tl)
        f(x, x)[1].backward()
        out[f"fsdp{prefetch}"] = sorted(tl.events, key=lambda e: e["start"])
        out[f"bytes{prefetch}"] = f.comm_bytes()["total"]
    from helpers.zero import ZeroOptimizer
    for stage in (2, 3):  # the same timeline works for ZeRO
        tl = Timeline()
        model = build_model("toy", seed=0)
        opt = ZeroOptimizer(model, stage, timeline=tl)
        model(x, x)[1].backward()
        opt.step()
        names = {lane: sorted(e["name"] for e in tl.events if e["lane"] == lane)
                 for lane in ("comm", "wait")}
        out[f"zero{stage}"] = {e["lane"] for e in tl.events}, names
    return out


@pytest.mark.slow
def test_ddp_overlap_and_fsdp_prefetch_order():
    res = launch(_timelines, 2, timeout=60)
    for r in res:
        assert r["n0.01"] > 3 and r["n1000"] == 1
        # one bucket is launched when backward is over: nothing to hide under
        # (hidden is only the moment between the last gradient and the launch)
        assert r[1000]["hidden"] < 0.5 * r[1000]["total"]
        for stage in (2, 3):
            lanes, names = r[f"zero{stage}"]
            assert lanes == {"comm", "wait"}
            # every collective ZeRO issued was waited for exactly once, by name
            assert names["comm"] and names["comm"] == names["wait"], (stage, names)
        # prefetch changes when gathers are issued, not how many bytes move
        assert r["bytesTrue"] == r["bytesFalse"]
        for pf in (True, False):
            ev = r[f"fsdp{pf}"]
            end_fwd0 = next(e["end"] for e in ev if e["name"] == "forward blocks.0")
            first_gather1 = min(e["start"] for e in ev
                                if e["lane"] == "comm" and e["name"] == "all-gather blocks.1")
            # prefetch on: block 1's gather is issued while block 0 still computes
            issued_early = first_gather1 < end_fwd0
            assert issued_early == pf


def test_export_trace(tmp_path):
    path = export_trace(lambda: torch.randn(64, 64) @ torch.randn(64, 64), tmp_path / "t.json")
    data = json.loads(open(path).read())
    assert any("mm" in e.get("name", "") for e in data["traceEvents"])


def test_export_trace_drops_profiler_chatter_but_keeps_other_stderr(tmp_path, capfd):
    import os

    from helpers.overlap import export_trace

    def fn():
        torch.ones(3).sum()
        os.write(2, b"a real warning\n")

    path = export_trace(fn, tmp_path / "trace.json")
    err = capfd.readouterr().err
    assert os.path.getsize(path) > 0
    assert "USDT" not in err and "a real warning" in err


def _reduce_scatter_span(sleep_s):
    import time

    import torch.distributed as dist

    from helpers.comm import reduce_scatter
    from helpers.overlap import wait_comm

    tl = Timeline()
    dist.barrier()  # both ranks issue the collective together
    out, inp = torch.empty(4), torch.ones(8)
    t0 = time.perf_counter()
    work = reduce_scatter(out, inp, async_op=True)
    tl.comm(work, "reduce-scatter", t0)
    time.sleep(sleep_s)  # the training thread "computes" and does not look
    t_wait = time.perf_counter()
    wait_comm(tl, work, "reduce-scatter")
    span = next(e for e in tl.events if e["lane"] == "comm")
    return {"end": span["end"], "t_wait": t_wait, "out": out}


def test_future_less_reduce_scatter_ends_when_it_completes():
    """Gloo's reduce-scatter has no future. Its span must close when the data
    arrives (a watcher thread), not when the training thread next looks: a
    2-element reduce-scatter finishes long before a 1 s sleep ends."""
    for r in launch(_reduce_scatter_span, 2, 1.0, timeout=60):
        assert torch.equal(r["out"], torch.full((4,), 2.0))
        assert r["end"] < r["t_wait"], "span closed at the wait, not at completion"


def test_short_labels_name_each_span_once():
    """A bar's label: the collective and its unit or bucket; a wait keeps its word
    ("W" would read as chapter 12's weight-gradient action)."""
    assert short_label("all-gather blocks.1") == "AG1"
    assert short_label("backward blocks.2") == "B2"
    assert short_label("all-reduce bucket 3") == "AR3"
    assert short_label("all-gather root") == "AG root"
    assert short_label("wait for buckets") == "wait"


def test_timeline_labels_lie_inside_their_bars():
    """A bar carries its short label only where the text fits inside it ("wait" on a short
    wait ran over its bar's ends)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from helpers.overlap import plot_timelines

    def ev(lane, name, start, end):
        return {"lane": lane, "name": name, "start": start, "end": end}
    timeline = [ev("compute", "backward blocks.1", 0.0, 0.30),
                ev("comm", "all-reduce bucket 12", 0.04, 0.055),   # 15 ms of 380: too short
                ev("comm", "all-reduce bucket 1", 0.10, 0.30),
                ev("wait", "wait for buckets", 0.300, 0.306),      # 6 ms: "wait" does not fit
                ev("wait", "wait for buckets", 0.31, 0.38)]
    fig, ax = plt.subplots(figsize=(4, 2))   # a narrow panel: a 15 ms bar is ~9 points
    plot_timelines([timeline], ax=ax)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bars = [c.get_transform().transform_path(path).get_extents()   # in display points
            for c in ax.collections for path in c.get_paths()]
    texts = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts]
    assert sorted(t for t, _ in texts) == ["AR1", "B1", "wait"], texts
    for text, box in texts:
        assert any(b.x0 <= box.x0 and box.x1 <= b.x1 for b in bars), (text, box)
    plt.close(fig)
