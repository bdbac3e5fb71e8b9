"""Chapter 14's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch
import torch.distributed as dist

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch14
from helpers.zero import adamw_update, all_gather, reduce_scatter


def _floor_chunks(numel, world_size, rank):  # no padding: the last numel % world_size dropped
    chunk = numel // world_size
    return rank * chunk, (rank + 1) * chunk, numel


def _float_bounds(numel, world_size, rank):  # "/" where "//" belongs: 4.0 slices nothing
    import math
    padded = math.ceil(numel / world_size) * world_size
    chunk = padded / world_size
    return rank * chunk, (rank + 1) * chunk, padded


def _rounded_chunks(numel, world_size, rank):  # chunk rounded to nearest, not up
    chunk = round(numel / world_size)
    return rank * chunk, (rank + 1) * chunk, chunk * world_size


def _no_return(numel, world_size, rank):  # computes, forgets to return
    _floor_chunks(numel, world_size, rank)


def _via_flat_partition(numel, world_size, rank):   # the course's partition, asked
    from helpers.zero import FlatPartition
    part = FlatPartition([numel], world_size, [[0]])
    lo, hi = part.shard_range(part.buckets[0], rank)
    return lo, hi, part.buckets[0].padded


def _zero1(average_twice=False, gather=True, use_group=True, all_reduce=False, answer=True,
           job_rank=False, adam_on_sum=False):
    def zero1_step(flat_param, flat_grad, m, v, step, group=None):
        N = dist.get_world_size(group)
        r = dist.get_rank() % N if job_rank else dist.get_rank(group)
        chunk = flat_param.numel() // N
        lo, hi = r * chunk, (r + 1) * chunk
        out = torch.empty(chunk)
        if all_reduce:  # the whole average on every rank, then this rank's slice
            full = flat_grad / N
            dist.all_reduce(full, group=group)
            out = full[lo:hi].clone()
        else:
            reduce_scatter(out, flat_grad if adam_on_sum else flat_grad / N,
                           group=group if use_group else None)
        if average_twice:
            out /= N
        adamw_update(flat_param[lo:hi], out, m, v, step, ch14.LR, *ch14.BETAS, ch14.EPS, ch14.WD)
        if adam_on_sum:   # the average only in what is returned
            out = out / N
        if gather:
            all_gather(flat_param, flat_param[lo:hi].clone(), group=group if use_group else None)
        return out if answer else None
    return zero1_step


def _summed(grads, group=None):  # reduce-scatters the sum: forgets to divide by N
    N = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads])
    buf = torch.zeros(-(-flat.numel() // N) * N)
    buf[:flat.numel()] = flat
    out = torch.empty(buf.numel() // N)
    reduce_scatter(out, buf, group=group)
    return out


def _unpadded(grads, group=None):  # drops the last numel % N elements instead of padding
    N = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads]) / N
    out = torch.empty(flat.numel() // N)
    reduce_scatter(out, flat[:out.numel() * N], group=group)
    return out


def _rs_each_padded(grads, group=None):  # pads every gradient on its own, not the bucket
    N = dist.get_world_size(group)
    parts = []
    for g in grads:
        flat = g.reshape(-1) / N
        pad = torch.zeros(-(-flat.numel() // N) * N)
        pad[:flat.numel()] = flat
        parts.append(pad)
    buf = torch.cat(parts)
    if buf.numel() % N:
        buf = torch.cat([buf, torch.zeros(N - buf.numel() % N)])
    out = torch.empty(buf.numel() // N)
    reduce_scatter(out, buf, group=group)
    return out


def _rs_no_group(grads, group=None):  # sizes from the group, the collective without it
    N = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads])
    buf = torch.zeros(-(-flat.numel() // N) * N)
    buf[:flat.numel()] = flat / N
    out = torch.empty(buf.numel() // N)
    reduce_scatter(out, buf)
    return out


def _rs_whole(grads, group=None):  # all-gathers the averaged chunks back: the whole buffer
    N = dist.get_world_size(group)
    flat = torch.cat([g.reshape(-1) for g in grads])
    buf = torch.zeros(-(-flat.numel() // N) * N)
    buf[:flat.numel()] = flat / N
    out = torch.empty(buf.numel() // N)
    reduce_scatter(out, buf, group=group)
    whole = torch.empty_like(buf)
    all_gather(whole, out, group=group)
    return whole


def _zero2(free=True, average=True, accumulate=True, all_reduce=False, pad=True,
           use_group=True):
    """The solution's mechanism with one switch turned wrong at a time."""
    def attach_zero2(model, group=None):
        N, r = dist.get_world_size(group), dist.get_rank(group)
        name_of = {id(p): n for n, p in model.named_parameters()}
        shards = {}

        def hook(p):
            numel = p.grad.numel()
            buf = torch.zeros(-(-numel // N) * N if pad else numel // N * N)
            buf[:] = torch.cat([p.grad.reshape(-1), p.grad.new_zeros(buf.numel())])[
                :buf.numel()] / (N if average else 1)
            if all_reduce:  # the full average on every rank, then keep a slice
                dist.all_reduce(buf, group=group)
                chunk = buf[r * (buf.numel() // N):(r + 1) * (buf.numel() // N)].clone()
            else:
                chunk = torch.empty(buf.numel() // N)
                reduce_scatter(chunk, buf, group=group if use_group else None)
            n = name_of[id(p)]
            shards[n] = shards[n] + chunk if (n in shards and accumulate) else chunk
            if free:
                p.grad = None

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        return shards

    return attach_zero2


class TestChapter14(ChapterChecks):
    lab, sol = "labs/14_zero_stages_lab.ipynb", "solutions/14_zero_stages_solution.ipynb"
    checks = {
        "shard_bounds": Check(ch14.check_shard_bounds),
        "zero1_step": Check(ch14.check_zero1_step, wire=True),
        "reduce_scatter_bucket": Check(ch14.check_reduce_scatter_bucket, wire=True),
        "attach_zero2": Check(ch14.check_attach_zero2, wire=True),
    }
    wrong = [
        Wrong("shard_bounds", _floor_chunks, "no padding", says="Pad"),
        Wrong("shard_bounds", _float_bounds, "float bounds from /", says="must be ints"),
        Wrong("shard_bounds", _rounded_chunks, "chunk rounded to nearest",
              says=r"shard_bounds\(10, 3, 0\)"),
        Wrong("shard_bounds", _no_return, "returns None", says="should return a tuple"),
        Wrong("shard_bounds", _via_flat_partition, "helpers.zero.FlatPartition asked",
              says="switched off in this check"),
        Wrong("zero1_step", _zero1(all_reduce=True), "all-reduce, then a slice",
              says="all_reduce refused"),
        Wrong("zero1_step", _zero1(use_group=False), "collectives without group=",
              says="without group=group"),
        Wrong("zero1_step", _zero1(answer=False), "returns None", says="got None"),
        Wrong("zero1_step", _zero1(job_rank=True), "dist.get_rank() % N for the group rank",
              says="in two groups of 2.*strided"),
        Wrong("zero1_step", _zero1(adam_on_sum=True), "AdamW on the summed chunk, / N only "
              "in the value returned", says="AdamW was given the summed chunk"),
        Wrong("reduce_scatter_bucket", _rs_each_padded, "each gradient padded on its own",
              says="padding at the end"),
        Wrong("reduce_scatter_bucket", _rs_no_group, "reduce-scatter without group=",
              says="without group=group"),
        Wrong("reduce_scatter_bucket", _rs_whole, "returns the whole averaged buffer",
              says="all_gather_single refused|expected a chunk"),
        Wrong("attach_zero2", _zero2(pad=False), "no padding: numel // N chunks",
              says="zero-padded to a multiple of 3"),
        Wrong("attach_zero2", _zero2(use_group=False), "reduce-scatter without group=",
              says="without group=group"),
        Wrong("zero1_step", _zero1(gather=False), "forgets the all-gather", says="all-gather"),
        Wrong("zero1_step", _zero1(average_twice=True), "averages twice", says="averaged twice"),
        Wrong("reduce_scatter_bucket", _summed, "the sum, not the average", says="summed"),
        Wrong("reduce_scatter_bucket", _unpadded, "no padding", says=None),
        Wrong("attach_zero2", _zero2(free=False), "keeps p.grad", says="still in p.grad"),
        Wrong("attach_zero2", _zero2(average=False), "the sum, not the average",
              says="3x the average"),
        Wrong("attach_zero2", _zero2(accumulate=False), "overwrites the shard",
              says="Add into the shard"),
        Wrong("attach_zero2", _zero2(all_reduce=True), "all-reduce, then keep a slice",
              says="all_reduce refused"),
    ]
    right = [
        Right("zero1_step", _zero1(), "the right answer, written as these wrong ones"),
    ]
