"""Chapter 11's checks pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch
import torch.distributed as dist

from checks_harness import ChapterChecks, Check, Wrong
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


class TestChapter11(ChapterChecks):
    lab, sol = "labs/11_pipeline_basics_lab.ipynb", "solutions/11_pipeline_basics_solution.ipynb"
    # (the run_stage stub, unlike most, fails on the ranks: its test starts them too)
    checks = {
        "balanced_partition": Check(ch11.check_balanced_partition),
        "run_stage": Check(ch11.check_run_stage, slow=True),
    }
    wrong = [
        Wrong("balanced_partition", _greedy, "greedy fill up to the average",
              says="slowest stage"),
        Wrong("balanced_partition", _by_count, "equal layer counts, no error for too few layers",
              says=None),
        Wrong("run_stage", _ignores_received_grad, "backprops ones, not the received gradient",
              says="gradient of .* differs"),
        # a loop that hangs is stopped and reported (short timeout to keep the suite fast)
        Wrong("run_stage", _recv_before_send, "receives before it sends: deadlock",
              says=r"hung: rank\(s\) \[0, 1, 2, 3\]", kwargs={"timeout": 3}),
    ]
