"""Chapter 20's checks pass on the solution, fail on the lab's stubs and on plausible mistakes:
a memory estimate that forgets the optimizer state, a layout whose TP crosses nodes or
that is not the rule's rung (the planner's winner, the first rung that fits, another
threshold, a hard-coded GPU), a verdict that ignores the gradients or lets a NaN
through, mesh groups built consecutive or strided from the wrong side."""

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch20
from helpers.memory import GB
from helpers.planner import H100_80GB, Layout, ladder, plan


def _weights_and_grads(n, dp, tp, pp, zero):  # forgets the optimizer state
    n = n / (tp * pp)
    return (2 * n / (dp if zero >= 3 else 1) + 2 * n / (dp if zero >= 2 else 1)) / GB


def _everything_at_stage_1(n, dp, tp, pp, zero):
    return 16 * n / (tp * pp) / (dp if zero >= 1 else 1) / GB


def _stage_off_by_one(n, dp, tp, pp, zero):   # gradients sharded from stage 1
    n = n / (tp * pp)
    return (2 * n / (dp if zero >= 3 else 1) + 2 * n / (dp if zero >= 1 else 1)
            + 12 * n / (dp if zero >= 1 else 1)) / GB


def _no_model_parallel_split(n, dp, tp, pp, zero):
    return (2 * n / (dp if zero >= 3 else 1) + 2 * n / (dp if zero >= 2 else 1)
            + 12 * n / (dp if zero >= 1 else 1)) / GB


def _gib(n, dp, tp, pp, zero):
    n = n / (tp * pp)
    return (2 * n / (dp if zero >= 3 else 1) + 2 * n / (dp if zero >= 2 else 1)
            + 12 * n / (dp if zero >= 1 else 1)) / 2**30


def _tp_over_two_nodes(model, batch, gpu, topo):   # "TP 16 for a 70B model"
    return Layout(topo.world_size // 16, 16, 1, zero=3, recompute="full")


def _deepest_pipeline(model, batch, gpu, topo):
    # the feasible layout with the most pipeline stages: a large bubble
    p = plan(model, batch, gpu, topo, zero_stages=(1,), interleaves=(1,))
    return max(p.ranked, key=lambda e: (e.layout.pp, e.step_time)).layout


def _planner_winner(model, batch, gpu, topo):
    return plan(model, batch, gpu, topo).best.layout


def _first_rung_that_fits(model, batch, gpu, topo):
    return next(p.best.layout for _, p in ladder(model, batch, gpu, topo) if p.ranked)


def _threshold(within):
    def choose_layout(model, batch, gpu, topo):
        rungs = [p for _, p in ladder(model, batch, gpu, topo) if p.ranked]
        fastest = min(p.best.step_time for p in rungs)
        return next(p.best.layout for p in rungs if p.best.step_time <= (1 + within) * fastest)
    return choose_layout


def _h100_hard_coded(model, batch, gpu, topo):
    return _threshold(0.05)(model, batch, H100_80GB, topo)


def _gpu_swapped(model, batch, gpu, topo):  # the other 80 GB preset: A100 for H100 and back
    from helpers.planner import A100_80GB
    other = A100_80GB if gpu == H100_80GB else H100_80GB
    return _threshold(0.05)(model, batch, other, topo)


def _cluster_swapped(model, batch, gpu, topo):  # the other DGX preset, same node count
    from helpers.topology import a100_cluster, h100_cluster
    rebuilt = a100_cluster if "H100" in topo.name else h100_cluster
    return _threshold(0.05)(model, batch, gpu, rebuilt(topo.nodes))


def _h100_cluster_hard_coded(model, batch, gpu, topo):  # h100_cluster(nodes), given GPU
    from helpers.topology import h100_cluster
    return _threshold(0.05)(model, batch, gpu, h100_cluster(topo.nodes))


def _cluster_from_gpu(model, batch, gpu, topo):  # the GPU's own DGX preset, not the topology
    from helpers.topology import a100_cluster, h100_cluster
    cluster = h100_cluster if gpu == H100_80GB else a100_cluster
    return _threshold(0.05)(model, batch, gpu, cluster(topo.nodes))


def _empty_rung_not_skipped(model, batch, gpu, topo):
    rungs = [p for _, p in ladder(model, batch, gpu, topo)]
    fastest = min(p.best.step_time for p in rungs)      # .best of an empty ranking
    return next(p.best.layout for p in rungs if p.best.step_time <= 1.05 * fastest)


def _rung_name(model, batch, gpu, topo):
    rungs = [(n, p) for n, p in ladder(model, batch, gpu, topo) if p.ranked]
    fastest = min(p.best.step_time for _, p in rungs)
    return next(n for n, p in rungs if p.best.step_time <= 1.05 * fastest)


def _consecutive(dims, sizes, axis):
    n, world = sizes[dims.index(axis)], 1
    for s in sizes:
        world *= s
    return [list(range(i, i + n)) for i in range(0, world, n)]


def _stride_from_the_front(dims, sizes, axis):
    # stride = product of the sizes *before* the axis (the mesh read Fortran-style)
    d, world = dims.index(axis), 1
    for s in sizes:
        world *= s
    stride = 1
    for s in sizes[:d]:
        stride *= s
    groups = {}
    for r in range(world):
        key = (r // (stride * sizes[d]), r % stride)
        groups.setdefault(key, []).append(r)
    return sorted(groups.values())


def _pairs_only(dims, sizes, axis):   # a group of 2 hard-coded, stride right
    d, world = dims.index(axis), 1
    for s in sizes:
        world *= s
    stride = 1
    for s in sizes[d + 1:]:
        stride *= s
    return sorted([[r, r + stride] for r in range(world) if (r // stride) % 2 == 0
                   and r + stride < world])


def _tensor_groups(dims, sizes, axis):   # the right groups, as tensors
    import torch
    mesh = torch.arange(int(torch.tensor(sizes).prod())).reshape(sizes)
    d = dims.index(axis)
    return list(mesh.movedim(d, -1).reshape(-1, sizes[d]))


def _via_chapter_06(n, dp, tp, pp, zero):   # chapter 06's formula, one call
    from helpers.memory import model_state_bytes
    return model_state_bytes(n / (tp * pp), dp=dp, zero_stage=zero).total / GB


def _via_mesh(dims, sizes, axis):   # helpers.mesh does the arithmetic
    from helpers.mesh import axis_groups
    return axis_groups(axis, dims, dict(zip(dims, sizes)))


class TestChapter20(ChapterChecks):
    lab = "labs/20_design_training_stack_lab.ipynb"
    sol = "solutions/20_design_training_stack_solution.ipynb"
    checks = {
        "model_state": Check(ch20.check_model_state, "model_state_gb"),
        "choose_layout": Check(ch20.check_choose_layout),
        "capstone_verdict": Check(ch20.check_capstone_verdict, "capstone_agrees"),
        "axis_groups": Check(ch20.check_axis_groups),
    }
    wrong = [
        Wrong("model_state", _weights_and_grads, "forgets the optimizer state",
              says="optimizer state .* is missing"),
        Wrong("model_state", _everything_at_stage_1, "shards everything at stage 1",
              says="expected"),
        Wrong("model_state", _stage_off_by_one, "gradients sharded from stage 1",
              says="expected"),
        Wrong("model_state", _no_model_parallel_split, "tp x pp split forgotten",
              says="expected"),
        Wrong("model_state", _gib, "GiB instead of GB", says="expected"),
        Wrong("model_state", _via_chapter_06, "chapter 06's model_state_bytes called",
              says="switched off in this check"),
        Wrong("axis_groups", _via_mesh, "helpers.mesh.axis_groups called",
              says="switched off in this check"),
        Wrong("axis_groups", lambda d, s, a: ch20.reference_axis_groups(d, s, a),
              "the check's own reference returned", says="this check's reference"),
        Wrong("choose_layout", lambda m, b, g, t: ch20.lowest_rung_within(
              [(r, p.best if p.ranked else None) for r, p in ladder(m, b, g, t)], 0.05) and None,
              "the check's own rule called", says="this check's reference"),
        Wrong("capstone_verdict", lambda r: int(r.max_grad_diff <= r.bound and all(
              abs(a - b) <= r.bound for a, b in zip(r.losses, r.reference_losses))
              and len(r.losses) == len(r.reference_losses)), "returns an int",
              says="must return a Python bool, got int"),
        Wrong("capstone_verdict", lambda r: __import__("numpy").bool_(
              r.max_grad_diff <= r.bound and len(r.losses) == len(r.reference_losses)
              and all(abs(a - b) <= r.bound for a, b in zip(r.losses, r.reference_losses))),
              "returns numpy's bool", says="got numpy.bool.*wrap it in bool"),
        Wrong("choose_layout", _tp_over_two_nodes, "TP across two nodes",
              says="TP crosses a node"),
        Wrong("choose_layout", _deepest_pipeline, "feasible but slow: the deepest pipeline",
              says="expected .* Step time / fastest by rung"),
        Wrong("choose_layout", _planner_winner, "the planner's winner",
              says="fastest rung's layout"),
        Wrong("choose_layout", _first_rung_that_fits, "the first rung that fits",
              says="first rung that fits"),
        Wrong("choose_layout", _threshold(0.10), "10% instead of 5%", says="more than 5% slower"),
        Wrong("choose_layout", _threshold(0.02), "2% instead of 5%", says="lowest rung within 5%"),
        Wrong("choose_layout", _h100_hard_coded, "H100 hard-coded", says="A100s"),
        Wrong("choose_layout", _gpu_swapped, "the other 80 GB GPU preset",
              says="the rule's answer for"),
        Wrong("choose_layout", _cluster_swapped, "the other DGX cluster preset, same nodes",
              says="the rule's answer for"),
        Wrong("choose_layout", _h100_cluster_hard_coded, "h100_cluster(nodes) hard-coded",
              says="the rule's answer for"),
        Wrong("choose_layout", _cluster_from_gpu, "the GPU's own cluster preset, not the topology",
              says="the rule's answer for"),
        Wrong("choose_layout", _empty_rung_not_skipped, "a rung where nothing fits not skipped",
              says="choose_layout .*raised"),
        Wrong("choose_layout", _rung_name, "returns the rung's name", says="must return"),
        Wrong("axis_groups", _consecutive, "consecutive ranks for every axis",
              says="consecutive ranks form a group only"),
        Wrong("axis_groups", _stride_from_the_front, "stride from the slow side",
              says="expected"),
        Wrong("axis_groups", _pairs_only, "groups of 2 hard-coded",
              says=r"expected \[\[0, 4, 8\]"),
        Wrong("axis_groups", _tensor_groups, "tensors instead of int lists",
              says="list of int ranks"),
        Wrong("capstone_verdict",
              lambda r: all(abs(a - b) <= r.bound for a, b in zip(r.losses, r.reference_losses)),
              "ignores the gradients", says="gradients off"),
        Wrong("capstone_verdict",
              lambda r: not any(abs(a - b) > r.bound for a, b in zip(r.losses, r.reference_losses))
              and r.max_grad_diff <= r.bound,
              "zip hides a missing step", says="a step missing"),
        Wrong("capstone_verdict",
              lambda r: len(r.losses) == len(r.reference_losses) and r.max_grad_diff <= r.bound
              and not any(abs(a - b) > r.bound for a, b in zip(r.losses, r.reference_losses)),
              "NaN > bound is False", says="a NaN loss"),
        Wrong("capstone_verdict",
              lambda r: r.losses == r.reference_losses and r.max_grad_diff == 0,
              "exact equality, no bound", says="within the bound"),
        Wrong("capstone_verdict",
              lambda r: len(r.losses) == len(r.reference_losses)
              and r.max_grad_diff <= r.bound * abs(r.reference_losses[0])
              and all(abs(a - b) <= r.bound * abs(b)
                      for a, b in zip(r.losses, r.reference_losses)),
              "the bound taken as relative to the loss", says="absolute"),
        Wrong("capstone_verdict",
              lambda r: len(r.losses) == len(r.reference_losses) and r.max_grad_diff <= r.bound
              and sum(abs(a - b) for a, b in zip(r.losses, r.reference_losses))
              / len(r.losses) <= r.bound,
              "the mean difference over the steps", says="the others equal"),
    ]
