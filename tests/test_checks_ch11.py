"""Chapter 11's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch
import torch.distributed as dist

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch11
from helpers.model import lm_loss


def _greedy(costs, k):
    """Fill each stage up to the average cost: a plausible, wrong answer."""
    if len(costs) < k:
        raise ValueError("too few layers")
    target, stages, start, acc = sum(costs) / k, [], 0, 0.0
    for i, c in enumerate(costs):
        acc += c
        left_layers, left_stages = len(costs) - i - 1, k - len(stages) - 1
        if left_stages and (acc >= target or left_layers == left_stages):
            stages.append(range(start, i + 1))
            start, acc = i + 1, 0.0
    stages.append(range(start, len(costs)))
    return stages


def _by_count(costs, k):  # equal layer counts, no check for too few layers
    n = len(costs)
    edges = [round(i * n / k) for i in range(k + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


def _min_spread(costs, k):  # the most even split: smallest gap between costliest and cheapest
    import itertools
    if len(costs) < k:
        raise ValueError("too few layers")
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        e = (0, *cuts, n)
        sums = [sum(costs[a:b]) for a, b in zip(e, e[1:])]
        if best is None or max(sums) - min(sums) < best[0]:
            best = (max(sums) - min(sums), [range(a, b) for a, b in zip(e, e[1:])])
    return best[1]


def _forgets_return(costs, k):  # builds the stages, returns nothing
    _min_spread(costs, k)


def _index_error_when_too_few(costs, k):  # no check up front: fails inside with IndexError
    import itertools
    costs[k - 1]  # "the last stage starts at layer k - 1 at the latest"
    n = len(costs)
    best = min(((0, *cuts, n) for cuts in itertools.combinations(range(1, n), k - 1)),
               key=lambda e: max(sum(costs[a:b]) for a, b in zip(e, e[1:])))
    return [range(a, b) for a, b in zip(best, best[1:])]


def _pipeline(stage, x, y, *, buffer=None, requires_grad=True, as_float=True, last=None):
    """The solution's loop with one part swapped for a mistake."""
    rank = dist.get_rank()
    B, T = x.shape
    is_last = stage.last if last is None else last(rank)
    if stage.first:
        inp = x
    else:
        inp = buffer(B, T, stage.n_embd) if buffer else torch.empty(B, T, stage.n_embd)
        dist.recv(inp, src=rank - 1)
        if requires_grad:
            inp.requires_grad_()
    out = stage(inp)
    loss = None
    if is_last:
        loss = lm_loss(out, y)
        loss.backward()
    else:
        dist.send(out.detach(), dst=rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1)
        out.backward(grad)
    if not stage.first:
        dist.send(inp.grad, dst=rank - 1)
    if loss is None:
        return None
    return loss.item() if as_float else loss.detach()


def _no_requires_grad(stage, x, y):  # the received activation never gets a .grad
    return _pipeline(stage, x, y, requires_grad=False)


def _returns_tensor(stage, x, y):  # returns the loss tensor, not loss.item()
    return _pipeline(stage, x, y, as_float=False)


def _last_is_rank_3(stage, x, y):  # the last stage hard-coded from the 4-rank picture
    return _pipeline(stage, x, y, last=lambda rank: rank == 3)


def _flat_buffer(stage, x, y):  # receives into (B, T): the activation is (B, T, n_embd)
    return _pipeline(stage, x, y, buffer=lambda B, T, C: torch.empty(B, T))


def _ignores_received_grad(stage, x, y):
    """Receives the output gradient but backprops ones instead (a plausible slip)."""
    rank = dist.get_rank()
    B, T = x.shape
    inp = x
    if not stage.first:
        inp = torch.empty(B, T, stage.n_embd)
        dist.recv(inp, src=rank - 1)
        inp.requires_grad_()
    out = stage(inp)
    result = None
    if stage.last:
        loss = lm_loss(out, y)
        loss.backward()
        result = loss.item()
    else:
        dist.send(out.detach(), dst=rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1)
        out.backward(torch.ones_like(out))
    if not stage.first:
        dist.send(inp.grad, dst=rank - 1)
    return result


def _recv_before_send(stage, x, y):
    """Every stage first waits for the gradient, then sends its activation: deadlock."""
    rank = dist.get_rank()
    B, T = x.shape
    inp = x
    if not stage.first:
        inp = torch.empty(B, T, stage.n_embd)
        dist.recv(inp, src=rank - 1)
        inp.requires_grad_()
    out = stage(inp)
    if not stage.last:
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1)   # the next stage is still waiting for our output
        dist.send(out.detach(), dst=rank + 1)
        out.backward(grad)
    return None


def _course_partition(costs, k):  # the chapter's own answer, one line
    from helpers.pipeline import partition
    return partition(costs, k)


def _lone_send_recv(stage, x, y):  # right: the loop with lone send and recv, in order
    return _pipeline(stage, x, y)


def _loss_sent_to_rank_0(stage, x, y):
    """Right numbers, one message too many: the last stage also sends its loss to rank 0
    (to print it there)."""
    loss = _pipeline(stage, x, y)
    rank, p = dist.get_rank(), dist.get_world_size()
    if rank == p - 1:
        dist.send(torch.tensor([loss]), dst=0)
    elif rank == 0:
        dist.recv(torch.empty(1), src=p - 1)
    return loss


def _loss_broadcast(stage, x, y):
    """Right numbers, a collective the pipeline does not need: the loss broadcast to
    every rank from the last."""
    loss = _pipeline(stage, x, y)
    p = dist.get_world_size()
    t = torch.tensor([loss if loss is not None else 0.0])
    dist.broadcast(t, src=p - 1)
    return loss


def _tied_exchanged(stage, x, y):
    """Reads "exactly as the unsplit model's backward would" literally: the first and the
    last stage swap their parts of the tied weight's gradient and add them."""
    loss = _pipeline(stage, x, y)
    rank, p = dist.get_rank(), dist.get_world_size()
    w = stage.wte.weight if stage.first else stage.lm_head.weight if stage.last else None
    if w is not None:   # blocking calls, as the loop's own messages: rank 0 sends first
        other = torch.empty_like(w.grad)
        if rank == 0:
            dist.send(w.grad.clone(), p - 1)
            dist.recv(other, p - 1)
        else:
            dist.recv(other, 0)
            dist.send(w.grad.clone(), 0)
        w.grad += other
    return loss


def _course_executor(stage, x, y):  # the chapter's executor, one line
    from helpers.pipeline import gpipe
    from helpers.pipeline.executor import pipeline_step
    return pipeline_step([stage], gpipe(dist.get_world_size(), 1), x, y).loss


class TestChapter11(ChapterChecks):
    lab, sol = "labs/11_pipeline_basics_lab.ipynb", "solutions/11_pipeline_basics_solution.ipynb"
    # (the run_stage stub, unlike most, fails on the ranks: its test starts them too)
    checks = {
        "balanced_partition": Check(ch11.check_balanced_partition),
        "run_stage": Check(ch11.check_run_stage, slow=True, wire="p2p"),
    }
    wrong = [
        Wrong("balanced_partition", _greedy, "greedy fill up to the average",
              says="slowest stage"),
        Wrong("balanced_partition", _by_count, "equal layer counts, no error for too few layers",
              says=None),
        Wrong("balanced_partition", _min_spread, "minimizes the spread, not the slowest stage",
              says=r"\[4, 1, 9, 4, 6, 4, 3\], 3\).*slowest stage costs 14"),
        Wrong("balanced_partition", _forgets_return, "returns None", says="got None"),
        Wrong("balanced_partition", _index_error_when_too_few,
              "no up-front check: IndexError for too few layers", says="raised IndexError"),
        Wrong("run_stage", _no_requires_grad, "no requires_grad_ on the received activation",
              says="requires_grad_"),
        Wrong("run_stage", _returns_tensor, "returns the loss tensor", says="as a float"),
        Wrong("run_stage", _last_is_rank_3, "the last stage hard-coded as rank 3",
              says="rank 2 sends to rank 3, which is not in its group"),
        Wrong("run_stage", _flat_buffer, "a (B, T) receive buffer", says="aborted inside gloo"),
        Wrong("run_stage", _ignores_received_grad, "backprops ones, not the received gradient",
              says="gradient of .* differs"),
        # a loop that hangs is stopped and reported (short timeout to keep the suite fast)
        Wrong("run_stage", _recv_before_send, "receives before it sends: deadlock",
              says=r"hung: rank\(s\) \[0, 1, 2\]", kwargs={"timeout": 3}),
        Wrong("balanced_partition", _course_partition, "the course's partition",
              says="course's own answer"),
        Wrong("run_stage", _loss_sent_to_rank_0, "the loss also sent to rank 0",
              says=r"rank 2 sent .*4 B to rank 0"),
        Wrong("run_stage", _loss_broadcast, "the loss broadcast to every rank",
              says=r"called \['broadcast'\]"),
        Wrong("run_stage", _tied_exchanged, "the tied weight's gradient exchanged",
              says="tied embedding's gradient: leave each copy's part"),
        Wrong("run_stage", _course_executor, "the course's pipeline_step",
              says="course's own answer"),
    ]
    right = [Right("run_stage", _lone_send_recv, "lone send and recv in pipeline order")]
