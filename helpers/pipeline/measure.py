"""Measure schedules on real ranks: timelines, bubble, step time; ours and PyTorch's.

``time_schedule`` is a rank function (call it through ``launch``): it splits the
GPT into stages, runs a few steps of one schedule with our executor or with
``torch.distributed.pipelining`` on the *same* split, and returns the step
times, each timed step's timeline, the measured stash and the loss.
``measured_bubble`` turns the ranks' timelines into a bubble fraction defined
exactly as the simulator defines it: 1 - busy / (p * makespan).

What "busy" means here: the time a rank spends in its forward or backward
compute, from the moment its input has arrived. Waiting for a receive is idle,
as on a GPU. What separates a measurement from the formula (p-1)/(v*m+p-1):

* messages are not free: each hop costs a latency (``p2p_latency``), and
  1F1B's steady phase waits for a round trip; interleaving has v times more
  hops. Small micro-batches make this large next to the compute.
* the stages are not equal: the first also embeds, the last runs the head and
  the loss. ``replay`` feeds the simulator each rank's measured forward and
  backward times (and a latency): the formula evaluated on what really ran.
* the machine: with more busy processes than cores, a rank waits for a core in
  the middle of its compute, which stretches busy intervals unevenly (more
  when both ranks compute, less when one waits). ``cpu_share`` says how much
  of the compute intervals the ranks actually ran (1.0: a core each); well
  below 1 the measurement describes the scheduler as much as the pipeline.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from helpers.clock import clock_for, elapsed
from helpers.launch import rank_info
from helpers.pipeline.schedules import Action

__all__ = ["measured_bubble", "median_bubble", "cpu_share", "time_schedule", "time_schedules",
           "make_schedule",
           "layer_costs", "p2p_latency", "replay"]


def make_schedule(kind: str, p: int, m: int, v: int = 1):
    from helpers.pipeline.schedules import gpipe, interleaved_1f1b, one_f_one_b

    if kind == "gpipe":
        return gpipe(p, m)
    if kind == "1f1b":
        return one_f_one_b(p, m)
    if kind == "interleaved":
        return interleaved_1f1b(p, m, v)
    raise ValueError(f"kind must be 'gpipe', '1f1b' or 'interleaved', got {kind!r}")


def median_bubble(results: list[dict]) -> tuple[float, list]:
    """Median bubble over the timed steps of ``launch(time_schedule, ...)``'s results,
    and the timeline of the step with that median (for a Gantt chart)."""
    per_step = [measured_bubble([r["timelines"][i] for r in results])
                for i in range(len(results[0]["timelines"]))]
    order = sorted(range(len(per_step)), key=lambda i: per_step[i][2])
    mid = per_step[order[len(order) // 2]]
    return mid[2], mid[0]


def cpu_share(results: list[dict]) -> float | None:
    """CPU seconds / wall seconds over every compute interval of every rank and timed
    step of ``launch(time_schedule, ...)``: 1.0 when each rank had a core to itself.

    A CPU quantity: it tells whether another process took a rank's core in the middle
    of its compute. On a GPU (None) the intervals are CUDA-event times of the rank's own
    GPU, which no other rank shares, and the host thread's CPU time only counts the
    launching of kernels: there is nothing of the kind to measure."""
    if any(str(r.get("device", "cpu")).startswith("cuda") for r in results):
        return None
    cpu = sum(sum(step) for r in results for step in r["cpu_times"])
    wall = sum(e - s for r in results for tl in r["timelines"] for s, e, _ in tl)
    return cpu / wall


def measured_bubble(timelines: list[list[tuple[float, float, Action]]]):
    """(intervals shifted to start at 0, makespan, bubble fraction) of per-rank timelines
    taken on one machine (helpers.clock resolves every rank's marks on the host
    ``perf_counter`` scale, one clock for all the machine's processes)."""
    t0 = min(s for row in timelines for s, _, _ in row)
    shifted = [[(s - t0, e - t0, a) for s, e, a in row] for row in timelines]
    span = max(e for row in shifted for _, e, _ in row)
    busy = sum(e - s for row in shifted for s, e, _ in row)
    return shifted, span, 1.0 - busy / (len(timelines) * span)


def time_schedule(kind: str, m: int, v: int = 1, *, engine: str = "ours", size: str = "toy",
                  n_layer: int = 8, microbatch_size: int = 8, seq_len: int = 32,
                  steps: int = 4, threads: int = 1, return_grads: bool = False) -> dict:
    """Rank function. ``engine``: "ours" (helpers.pipeline.executor) or "torch"
    (torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B /
    ScheduleInterleaved1F1B). The first step is a warm-up and is not timed.
    ``return_grads``: also return the last step's gradients (unsplit model's names)."""
    from helpers import rank_info
    from helpers.model import build_model, lm_loss
    from helpers.pipeline.executor import chunk_grads, pipeline_step, split_model, sync_tied_grads

    torch.set_num_threads(threads)
    info = rank_info()
    p, rank = info.world_size, info.rank
    device = torch.device(info.device)
    model = build_model(size, n_layer=n_layer)
    chunks = [c.to(device) for c in split_model(model, p, v)[rank]]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (m * microbatch_size, seq_len), generator=g)
    y = torch.randint(0, model.config.vocab_size, (m * microbatch_size, seq_len), generator=g)
    x, y = x.to(device), y.to(device)
    sched = make_schedule(kind, p, m, v)
    params = [q for c in chunks for q in c.parameters()]

    if engine == "torch":
        from torch.distributed import pipelining as pp

        stages = [pp.PipelineStage(c, c_idx * p + rank, p * v, device)
                  for c_idx, c in enumerate(chunks)]
        cls = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
               "interleaved": pp.ScheduleInterleaved1F1B}[kind]
        runner = cls(stages if kind == "interleaved" else stages[0], m, loss_fn=lm_loss)

        def step(warm_up: bool):
            losses = []
            kwargs = {}
            if any(c.last for c in chunks):
                kwargs = dict(target=y, losses=losses)
            args = (x,) if any(c.first for c in chunks) else ()
            runner.step(*args, **kwargs)
            sync_tied_grads(chunks, p)
            return (float(torch.stack([l.detach() for l in losses]).mean()) if losses else None,
                    None, None)
    else:
        def step(warm_up: bool):
            # the stash is measured in the warm-up step (same shapes, same bytes); the
            # meter's per-tensor bookkeeping would otherwise show up in the timings
            res = pipeline_step(chunks, sched, x, y, measure_stash=warm_up)
            if warm_up:
                stash[:] = [res.peak_stash, res.peak_stash_bytes, res.stash_unit_bytes]
            return res.loss, res.timeline, res

    times, timelines, cpu_times, out = [], [], [], None
    clk = clock_for(device)
    stash = [None, None, None]
    for i in range(steps + 1):
        for q in params:
            q.grad = None
        dist.barrier()
        t0 = clk.mark()
        out = step(i == 0)
        dist.barrier()
        if i:
            times.append(elapsed(t0, clk.mark()))
            timelines.append(out[1])
            cpu_times.append(out[2].cpu_time if out[2] is not None else None)
    loss, _, res = out
    # step_time: median over the timed steps; timelines, cpu_times: one per timed step
    result = dict(step_time=statistics.median(times), step_times=times, loss=loss,
                  timelines=timelines, cpu_times=cpu_times, device=str(device),
                  peak_stash=stash[0], peak_stash_bytes=stash[1], stash_unit_bytes=stash[2])
    if return_grads:
        result["grads"] = chunk_grads(chunks)
    return result


def time_schedules(runs: list[dict], **common) -> list[dict]:
    """Rank function: ``time_schedule(**run, **common)`` for each dict of ``runs`` in
    turn, in one launch (a launch forks and connects the ranks anew; nine runs in one
    save eight of those). Each run builds its own model and times after its own warm-up
    step. The results in the order of ``runs``."""
    return [time_schedule(**run, **common) for run in runs]


def stage_compute_seconds(stage, x: torch.Tensor, y: torch.Tensor) -> float:
    """One micro-batch's forward and backward on ``stage`` alone, no messages: the time a
    rank is *busy* with it, measured with the course clock (CUDA events on a GPU, where
    a host thread's CPU time counts only the launching of the kernels). Its input is
    ``x`` on the first stage, a random activation (B, T, C) elsewhere; the last stage
    backprops the loss against ``y``, the others a random output gradient. Leaves no
    gradient behind."""
    from helpers.model import lm_loss

    clk = clock_for(x.device)
    g = torch.Generator().manual_seed(0)
    inp = x if stage.first else \
        torch.randn(*x.shape, stage.n_embd, generator=g).to(x.device).requires_grad_()
    grad = None if stage.last else torch.randn(*x.shape, stage.n_embd, generator=g).to(x.device)
    for warm_up in (True, False):  # the first run allocates and warms the kernels up
        t0 = clk.mark()
        out = stage(inp)
        if stage.last:
            lm_loss(out, y).backward()
        else:
            out.backward(grad)
        t1 = clk.mark()
    stage.zero_grad(set_to_none=True)
    return elapsed(t0, t1)


def layer_costs(model, x: torch.Tensor, y: torch.Tensor, repeats: int = 5) -> dict:
    """Measured forward + backward seconds of the embedding, each block and the head
    (with the loss) of ``model`` on one batch, single process; the fastest of
    ``repeats`` runs (on a shared machine the fastest run is the least disturbed).

    ``per_block`` folds the embedding into block 0 and the head into the last block,
    because those are the stages that run them: pass it to ``split_model(...,
    layer_costs=...)`` or ``partition``."""
    from helpers.model import lm_loss

    clk = clock_for(x.device)

    def timed(fn, inp):
        out_times = []
        for i in range(repeats + 1):  # the first run warms up allocator and kernels
            a = inp.detach().requires_grad_(inp.is_floating_point())
            t0 = clk.mark()
            out = fn(a)
            (out if out.dim() == 0 else out.float().square().mean()).backward()
            if i:
                out_times.append(elapsed(t0, clk.mark()))  # on a GPU: the kernels' end
        return min(out_times)

    with torch.no_grad():
        h = model.embed(x)
    embed = timed(model.embed, x)
    blocks = [timed(b, h) for b in model.blocks]
    head = timed(lambda a: lm_loss(model.head(a), y), h)
    model.zero_grad(set_to_none=True)
    per_block = list(blocks)
    per_block[0] += embed
    per_block[-1] += head
    return dict(embed=embed, blocks=blocks, head=head, per_block=per_block)


def p2p_latency(numel: int, repeats: int = 50) -> float:
    """Rank function for 2+ ranks: one-way seconds to send ``numel`` float32 values
    from rank 0 to rank 1 (half the median ping-pong round trip)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    buf = torch.zeros(numel, device=rank_info().device)  # nccl sends GPU tensors only
    # helpers.clock: under nccl send/recv return once queued; a CUDA event after
    # them completes when the transfer has (the stream waits on the p2p stream)
    clk = clock_for(buf.device)
    rtts = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = clk.mark()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        rtts.append(elapsed(t0, clk.mark()))
    return statistics.median(rtts[1:]) / 2


def replay(schedule, timeline, t_comm: float = 0.0):
    """Simulate ``schedule`` with the per-rank forward / backward times measured in
    ``timeline`` (per rank: (start, end, action)), plus ``t_comm`` per message."""
    from helpers.pipeline.schedules import schedule_shape
    from helpers.pipeline.simulate import simulate

    p, m, v = schedule_shape(schedule)
    tf = [sum(e - s for s, e, a in row if a.kind == "F") / m for row in timeline]
    tb = [sum(e - s for s, e, a in row if a.kind == "B") / m for row in timeline]
    return simulate(schedule, tf, tb, t_comm)
