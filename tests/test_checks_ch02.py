"""Chapter 02's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch
import torch.distributed as dist

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers import rank_info
from helpers.checks import ch02


def _sum_only(model):  # forgets to divide
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def _no_none_test(model):  # all-reduces every .grad, also a None one
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(dist.get_world_size())


def _halves(model):  # divides by a hard-coded 2
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(2)


def _local_only(model):  # never communicates
    pass


def _thirds(model):  # divides by 3, the world size of the first run it was tried on
    for p in model.parameters():
        if p.grad is None:
            continue
        dist.all_reduce(p.grad)
        p.grad.div_(3)


def _weights_only(model):  # averages matrices, skips biases and norms (dim 1)
    for p in model.parameters():
        if p.grad is not None and p.dim() > 1:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def _flat_no_view(model):  # one flat all-reduce, copied back without reshaping: raises
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece) if g.dim() == 1 else g.copy_(piece.view(-1, 1))


def _grads_none(model):  # averages into new tensors, then clears .grad
    for p in [q for q in model.parameters() if q.grad is not None]:
        avg = p.grad.clone()
        dist.all_reduce(avg)
        p.grad = None


def _whole_batch_step(model, opt, x, y):  # every rank repeats the whole batch
    opt.zero_grad()
    loss = model(x, y)[1]
    loss.backward()
    ch02_average(model)
    opt.step()
    return float(loss.detach())


def _no_zero_grad_step(model, opt, x, y):  # gradients pile up across steps
    r, p = rank_info().rank, rank_info().world_size
    b = x.size(0) // p
    loss = model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1]
    loss.backward()
    ch02_average(model)
    opt.step()
    return float(loss.detach())


def _right_step_calling(average_gradients):
    """The solution's dp_step, calling a wrong average_gradients (exercise 1 not done)."""
    def dp_step(model, opt, x, y):
        r, p = rank_info().rank, rank_info().world_size
        b = x.size(0) // p
        opt.zero_grad()
        loss = model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1]
        loss.backward()
        average_gradients(model)
        opt.step()
        return float(loss.detach())
    return dp_step


def _two_rows(model, opt, x, y):  # a slice width hard-coded from the 3-rank run
    r = rank_info().rank
    opt.zero_grad()
    loss = model(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])[1]
    loss.backward()
    ch02_average(model)
    opt.step()
    return float(loss.detach())


def _logs_mean_loss(model, opt, x, y):  # right step, but logs the loss averaged over ranks
    r, p = rank_info().rank, rank_info().world_size
    b = x.size(0) // p
    opt.zero_grad()
    loss = model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1]
    loss.backward()
    ch02_average(model)
    opt.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return float(logged) / p


def _loss_after_step(model, opt, x, y):  # right step, returns the loss recomputed after it
    r, p = rank_info().rank, rank_info().world_size
    b = x.size(0) // p
    opt.zero_grad()
    model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1].backward()
    ch02_average(model)
    opt.step()
    with torch.no_grad():
        return float(model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1])


def _returns_none(model, opt, x, y):  # right step, forgets `return loss`
    r, p = rank_info().rank, rank_info().world_size
    b = x.size(0) // p
    opt.zero_grad()
    model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1].backward()
    ch02_average(model)
    opt.step()


def _no_average_step(model, opt, x, y):  # steps on local gradients: replicas drift apart
    r, p = rank_info().rank, rank_info().world_size
    b = x.size(0) // p
    opt.zero_grad()
    loss = model(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1]
    loss.backward()
    opt.step()
    return float(loss.detach())


def _gather_then_mean(model):  # right numbers from p copies of every gradient on every rank
    p = dist.get_world_size()
    for q in model.parameters():
        if q.grad is not None:
            copies = [torch.empty_like(q.grad) for _ in range(p)]
            dist.all_gather(copies, q.grad)
            q.grad.copy_(torch.stack(copies).mean(0))


def _reduce_then_broadcast(model):  # right numbers, every byte through rank 0
    p = dist.get_world_size()
    for q in model.parameters():
        if q.grad is not None:
            dist.reduce(q.grad, dst=0)
            q.grad.div_(p)
            dist.broadcast(q.grad, src=0)


def _averaged_twice(model):  # a second pass of all-reduce + divide: same mean, twice the bytes
    p = dist.get_world_size()
    for _ in range(2):
        for q in model.parameters():
            if q.grad is not None:
                dist.all_reduce(q.grad)
                q.grad.div_(p)


def _one_flat_buffer(model):  # right: every gradient in one all-reduce
    grads = [q.grad for q in model.parameters() if q.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def ch02_average(model):
    from helpers.naive_dp import average_gradients
    average_gradients(model)


class TestChapter02(ChapterChecks):
    lab = "labs/02_sync_sgd_data_parallel_lab.ipynb"
    sol = "solutions/02_sync_sgd_data_parallel_solution.ipynb"
    checks = {
        "average_gradients": Check(ch02.check_average_gradients, slow=True, wire=True),
        "dp_step": Check(ch02.check_dp_step, slow=True, wire=True),
    }
    uses = {"dp_step": ("average_gradients",)}  # the step calls the notebook's average_gradients
    wrong = [
        Wrong("average_gradients", _sum_only, "forgets to divide", says="divide by the world size"),
        Wrong("average_gradients", _no_none_test, "all-reduces a None gradient",
              says="skip parameters whose .grad is None"),
        Wrong("average_gradients", _halves, "divides by a hard-coded 2",
              says="not by a fixed number"),
        Wrong("average_gradients", _local_only, "never communicates", says="own gradient"),
        Wrong("average_gradients", _thirds, "divides by a hard-coded 3",
              says="not by a fixed number"),
        Wrong("average_gradients", _weights_only, "skips 1-D parameters", says="own gradient"),
        Wrong("average_gradients", _flat_no_view, "copies a flat buffer back without a view",
              says="failed on a rank: rank . raised RuntimeError"),
        Wrong("average_gradients", _grads_none, "sets .grad to None", says="is None"),
        Wrong("average_gradients", _gather_then_mean, "all_gather every gradient, then a mean",
              says="called all_gather.*p times the memory"),
        Wrong("average_gradients", _reduce_then_broadcast, "reduce to rank 0, then broadcast",
              says="called broadcast, reduce.*funnel"),
        Wrong("average_gradients", _averaged_twice, "all-reduces every gradient twice",
              says="all-reduced once"),
        Wrong("dp_step", _two_rows, "a slice width hard-coded to 2 rows", says="rank.s slice"),
        Wrong("dp_step", _logs_mean_loss, "returns the loss averaged over ranks",
              says="not the loss averaged"),
        Wrong("dp_step", _loss_after_step, "returns the loss after the step",
              says="before the step"),
        Wrong("dp_step", _returns_none, "returns None", says="should return this rank's loss"),
        Wrong("dp_step", _no_average_step, "never averages", says="average, then step"),
        Wrong("dp_step", _right_step_calling(_sum_only), "a right step, exercise 1 wrong",
              says="dp_step calls your average_gradients, which is not right yet.*divide"),
        Wrong("dp_step", _whole_batch_step, "every rank repeats the whole batch", says="own slice"),
        Wrong("dp_step", _no_zero_grad_step, "gradients pile up across steps",
              says="Zero the gradients"),
    ]
    right = [
        Right("average_gradients", _one_flat_buffer, "one all-reduce of a flat buffer"),
    ]
