"""Checks for chapter 20's lab: the model state a layout leaves on each GPU, a layout
chosen for a budget by the course's order, the verdict on the 3-D capstone's run, and
the groups of one axis of the capstone's device mesh."""

from __future__ import annotations

import dataclasses
import math

from helpers.checks import CheckFailed, attempt, expect_close, passed
from helpers.checks.course_answers import refusing

__all__ = ["check_model_state", "check_choose_layout", "check_capstone_verdict",
           "check_axis_groups", "LAYOUT_CASES", "MESH_CASES", "lowest_rung_within",
           "reference_axis_groups"]


# the course's own answers to the exercises, switched off while the learner's code runs
_STATE_HELPERS = {"helpers.memory.formulas.model_state_bytes": "it is chapter 06's answer to this "
                  "exercise: add the three states yourself",
                  "helpers.costs.memory.model_state": "it is the planner's answer to this "
                  "exercise: add the three states yourself"}
_RULE_HELPERS = {"helpers.checks.ch20.lowest_rung_within": "it is this check's reference"}
_MESH_HELPERS = {"helpers.mesh.axis_groups": "", "helpers.mesh.coords_of": "",
                 "helpers.mesh.rank_coords": "", "helpers.mesh.axis_stride": "",
                 "helpers.parallel3d.rank_table": "",
                 "helpers.checks.ch20.reference_axis_groups": "it is this check's reference"}


def check_model_state(model_state_gb) -> None:
    """``model_state_gb(n_params, dp, tp, pp, zero)`` -> GB per GPU of weights, gradients
    and optimizer state (bf16 mixed-precision Adam), against ``helpers.memory``.

    Mistakes it is built to catch (every ZeRO stage appears, with tp x pp > 1 and dp
    from 8 to 128): the optimizer state left out; everything sharded from stage 1;
    a stage off by one (gradients sharded at stage 1, or only from stage 3); the
    tp x pp split forgotten; bytes or GiB instead of GB; chapter 06's
    ``model_state_bytes`` (or the planner's ``costs.model_state``) called instead of
    the arithmetic: switched off while it runs."""
    from helpers.memory import GB, model_state_bytes

    cases = [(7e9, 8, 1, 1, 0), (7e9, 8, 1, 1, 1), (70e9, 64, 1, 1, 3), (70e9, 8, 8, 1, 2),
             (175e9, 16, 8, 4, 1), (405e9, 128, 8, 16, 1)]
    for n, dp, tp, pp, zero in cases:
        want = model_state_bytes(n / (tp * pp), dp=dp, zero_stage=zero).total / GB
        with refusing(exercise="model_state_gb", paths=_STATE_HELPERS):
            got = attempt(model_state_gb, n, dp, tp, pp, zero, what="model_state_gb")
        what = f"model_state_gb({n:.0e} params, dp={dp}, tp={tp}, pp={pp}, zero={zero})"
        try:
            # the same products in another order: equal to rounding (rel 1e-9)
            expect_close(got, want, what, rel=1e-9)
        except CheckFailed as exc:
            states = model_state_bytes(n / (tp * pp), dp=dp, zero_stage=zero)
            if abs(float(got) - (states.params + states.grads) / GB) < 1e-9 * want:
                raise CheckFailed(f"{what}: {got:.4g} GB is weights + gradients only; the "
                                  f"optimizer state (fp32 master copy, Adam's m and v: 12 "
                                  f"bytes per parameter before ZeRO) is missing") from None
            raise exc
    passed("model state per GPU matches helpers.memory on 6 layouts, every ZeRO stage")


# (model, global batch, nodes, GPU kind, cluster preset): the budgets choose_layout is tried
# on, each there for a mistake (the rung ratios are the planner's, printed by the check on
# failure). The hardware varies apart from the GPU: both GPU presets have 80 GB and both
# DGX clusters 8 GPUs a node, so only the cases where a GPU meets another cluster than its
# own DGX preset show a preset swapped or hard-coded for one of the same size.
LAYOUT_CASES = [
    # ZeRO-3, TP, PP, CP at 1.33, 1.02, 1.02, 1.00 x the fastest: the rule picks TP, not
    # the planner's winner (CP, the fastest rung) nor the first rung that fits (ZeRO-3);
    # a 2% threshold picks CP. (On a100_cluster(8) the rule picks PP 4: the A100 preset
    # swapped in for the H100 one.)
    ("70B", 1024, 8, "H100", "h100-ndr"),
    # TP, PP, CP at 1.05, 1.00, 1.00 (nothing fits below TP): the rule picks PP; a 10%
    # threshold picks TP, which is also the first rung that fits (and the rule's rung
    # with the A100_80GB preset in place of the H100's)
    ("70B", 1024, 2, "H100", "h100-ndr"),
    # on A100s the first rung that fits, TP, is within 5% (1.02): a hard-coded H100 misses it
    ("70B", 256, 2, "A100", "a100-hdr"),
    # every rung's best is the same ZeRO-1 layout: nothing above the first rung buys time
    ("7B", 512, 1, "H100", "h100-ndr"),
    # H100s on the HDR network: TP, PP, CP at 1.09, 1.02, 1.00, the rule picks PP 4; with
    # h100_cluster(8)'s NDR (a cluster rebuilt from the node count, or from the GPU) the
    # rule picks TP 2 (1.02 there), as it does with the A100 GPU preset on this cluster
    ("70B", 1024, 8, "H100", "h100-hdr"),
    # A100s in PCIe boxes (one 100 Gb/s NIC a node): ZeRO-3 to PP all 1.14, CP 1.00: the
    # rule picks CP; on a100_cluster(4) or h100_cluster(4) it picks TP 4, and with the H100
    # preset on this cluster PP 8
    ("70B", 1024, 4, "A100", "pcie-eth"),
]


def _clusters():
    """The cluster presets the cases name: ``helpers.topology.PRESETS``' three, and the
    H100 DGX preset on the A100's HDR network."""
    from helpers.topology import a100_cluster, h100_cluster, pcie_cluster
    from helpers.topology.links import IB_HDR
    return {"h100-ndr": h100_cluster, "a100-hdr": a100_cluster, "pcie-eth": pcie_cluster,
            "h100-hdr": lambda nodes: h100_cluster(nodes, network=IB_HDR)}


def _models():
    from helpers.planner import ModelSpec
    return {"7B": ModelSpec(name="7B", layers=32, hidden=4096, heads=32, vocab=32000, seq=4096,
                            ffn=11008, gated_mlp=True),
            "70B": ModelSpec(name="70B", layers=80, hidden=8192, heads=64, vocab=32000, seq=4096,
                             ffn=28672, kv_heads=8,
                             gated_mlp=True)}


def lowest_rung_within(rungs: list, within: float) -> int:
    """Index in ``rungs`` ([(name, best Candidate or None)]) of the lowest rung whose best
    step time is within ``within`` of the fastest rung's: the exercise's rule."""
    fastest = min(b.step_time for _, b in rungs if b is not None)
    return next(i for i, (_, b) in enumerate(rungs)
                if b is not None and b.step_time <= (1 + within) * fastest)


def check_choose_layout(choose_layout, within: float = 0.05) -> None:
    """``choose_layout(model, global_batch, gpu, topology)`` -> the ``Layout`` of the
    lowest rung of ``ladder`` whose best layout is within 5% of the fastest rung's.

    Mistakes it is built to catch (``LAYOUT_CASES``):
    * the planner's winner (``plan(...).best``, the fastest rung): 70B on 64 H100s;
    * the first rung that fits, whatever its time: 70B on 64 H100s;
    * another threshold (10%: 70B on 16 H100s; 2%: 70B on 64 H100s) or comparing to
      the wrong rung;
    * the H100 GPU hard-coded instead of the argument: 70B on 16 A100s;
    * a preset swapped for another of the same size (the other 80 GB GPU; another 8-GPU
      cluster preset rebuilt from ``topology.nodes``, or from the GPU's kind): the H100s
      on HDR and the A100s in PCIe boxes, where GPU and cluster are not a DGX pair; named
      with the hardware whose answer it is;
    * a rung where nothing fits not skipped (``p.best`` of an empty ranking raises);
    * not a ``Layout`` (a rung name, a Candidate)."""
    from helpers.planner import A100_80GB, H100_80GB, Layout, evaluate, ladder

    models, clusters = _models(), _clusters()
    gpus = {"H100": H100_80GB, "A100": A100_80GB}

    def rule(model, batch, gpu, topo):
        rungs = [(r, p.best if p.ranked else None) for r, p in ladder(model, batch, gpu, topo)]
        return rungs, lowest_rung_within(rungs, within)

    for name, batch, nodes, kind, preset in LAYOUT_CASES:
        gpu, model, topo = gpus[kind], models[name], clusters[preset](nodes)
        case = f"{name} on {topo.world_size} {kind}s ({preset}), global batch {batch}"
        rungs, want = rule(model, batch, gpu, topo)
        with refusing(exercise="choose_layout", paths=_RULE_HELPERS):
            lay = attempt(choose_layout, model, batch, gpu, topo, what=f"choose_layout ({case})")
        if not isinstance(lay, Layout):
            raise CheckFailed(f"{case}: choose_layout must return a helpers.planner.Layout "
                              f"(a rung's .best.layout), got {type(lay).__name__}")
        if lay == rungs[want][1].layout:
            continue
        fastest = min(b.step_time for _, b in rungs if b is not None)
        table = "; ".join(f"{r.split(' (')[0]}: " + ("nothing fits" if b is None else
                          f"{b.step_time / fastest:.3f}") for r, b in rungs)
        first = next(i for i, (_, b) in enumerate(rungs) if b is not None)
        whys = []   # every explanation that gives exactly this layout
        if lay == min((b for _, b in rungs if b is not None), key=lambda b: b.step_time).layout:
            whys.append("that is the fastest rung's layout (the planner's winner); the rule "
                        "takes the lowest rung within 5% of it")
        if lay == rungs[first][1].layout:
            whys.append("that is the first rung that fits, but it is more than 5% slower "
                        "than the fastest")
        # the same rule on the other presets of the same size: the other 80 GB GPU on this
        # cluster, this GPU on every other cluster preset with these nodes
        others = [(f"{k}s ({g.name}) on this cluster", g, topo)
                  for k, g in gpus.items() if k != kind]
        others += [(f"{kind}s on the {c} preset with {nodes} nodes", gpu, make(nodes))
                   for c, make in clusters.items() if c != preset]
        swapped = []
        for what, g, t in others:
            alt_rungs, alt = rule(model, batch, g, t)
            if lay == alt_rungs[alt][1].layout:
                swapped.append(what)
        if swapped:
            whys.append(f"that is the rule's answer for {' and for '.join(swapped)}, not for "
                        f"the hardware given ({gpu.name} on {topo.name}): pass choose_layout's "
                        f"gpu and topology to ladder as they are, without swapping or rebuilding "
                        f"a preset")
        if not whys and any(b is not None and lay == b.layout for _, b in rungs):
            whys.append("that is another rung's best: is the threshold 5% of the fastest "
                        "rung's time?")
        elif not whys:
            e = evaluate(model, lay, batch, gpu, topo)
            whys.append(f"it is not feasible: {e.reason}" if not e.feasible else
                        "it is no rung's best layout: return that rung's plan.best.layout")
        why = "; or ".join(whys)
        raise CheckFailed(f"{case}: got {lay.short()}, expected {rungs[want][1].layout.short()} "
                          f"(rung '{rungs[want][0]}'). Step time / fastest by rung: {table}. "
                          f"{why[0].upper()}{why[1:]}")
    passed(f"choose_layout picks the lowest rung within {within:.0%} of the fastest on "
           f"{len(LAYOUT_CASES)} budgets (7B and 70B; H100 and A100 GPUs on their own DGX "
           f"clusters, on another network and in PCIe boxes)")


# (mesh dims slowest first, sizes): each separates the C-order rule from a near miss
MESH_CASES = [
    (("dp", "pp", "tp"), (2, 2, 2)),   # the capstone's mesh
    (("dp", "tp", "pp"), (2, 2, 2)),   # TP not innermost: its groups are strided
    (("dp", "pp", "tp"), (2, 3, 4)),   # unequal sizes: a stride from the wrong side fails
    (("pp", "dp", "cp", "tp"), (3, 2, 1, 2)),   # four axes, one of size 1, odd pp
]


def reference_axis_groups(dims: tuple, sizes: tuple, axis: str) -> list[list[int]]:
    """What ``init_device_mesh`` builds: ranks laid out as a C-order array of ``sizes``
    (the last dimension fastest); a group of ``axis`` is a line along that dimension."""
    import torch
    mesh = torch.arange(math.prod(sizes)).reshape(sizes)
    d = dims.index(axis)
    return sorted(mesh.movedim(d, -1).reshape(-1, sizes[d]).tolist())


def check_axis_groups(axis_groups) -> None:
    """``axis_groups(dims, sizes, axis)`` -> every group of ``axis``, as lists of ranks,
    on a device mesh of ``sizes`` named ``dims`` (slowest first), as
    ``torch.distributed.device_mesh.init_device_mesh`` numbers ranks.

    Mistakes it is built to catch:
    * consecutive ranks for every axis (right only for the innermost one);
    * the stride taken from the wrong side (the product of the earlier sizes: equal to
      the right one on the capstone's 2 x 2 x 2 mesh, wrong on 2 x 3 x 4);
    * a size or stride of 2 hard-coded (3 x 2 x 1 x 2);
    * a group missing ranks or a rank in two groups of one axis;
    * groups that are not lists of ints (a tensor, numpy ints);
    * ``helpers.mesh``'s or ``helpers.parallel3d``'s own rank arithmetic, or this check's
      reference, called instead of written: switched off while it runs."""
    for dims, sizes in MESH_CASES:
        for axis in dims:
            case = f"axis_groups({dims}, {sizes}, {axis!r})"
            with refusing(exercise="axis_groups", paths=_MESH_HELPERS):
                got = attempt(axis_groups, tuple(dims), tuple(sizes), axis, what=case)
            if (not isinstance(got, (list, tuple))
                    or not all(isinstance(g, (list, tuple)) for g in got)
                    or not all(type(r) is int for g in got for r in g)):
                raise CheckFailed(f"{case}: return a list of groups, each a list of int ranks; "
                                  f"got {got!r:.120}")
            want = reference_axis_groups(dims, sizes, axis)
            norm = sorted(sorted(g) for g in got)
            if norm == want:
                continue
            flat = sorted(r for g in norm for r in g)
            why = ""
            if flat != list(range(math.prod(sizes))):
                why = " (every rank must be in exactly one group of an axis)"
            elif norm == sorted([list(range(i, i + sizes[dims.index(axis)]))
                                 for i in range(0, math.prod(sizes), sizes[dims.index(axis)])]):
                why = (" (consecutive ranks form a group only for the last, fastest-varying "
                       "dimension; the others are strided by the product of the sizes after them)")
            raise CheckFailed(f"{case}: expected {want}, got {norm}{why}")
    passed(f"axis_groups wires every axis of {len(MESH_CASES)} meshes as init_device_mesh does "
           f"(TP inner or not, unequal sizes, four axes)")


@dataclasses.dataclass
class _Run:
    """The fields of ``helpers.parallel3d.run_capstone``'s result that a verdict reads."""

    losses: list
    reference_losses: list
    max_grad_diff: float
    bound: float


def check_capstone_verdict(capstone_agrees) -> None:
    """``capstone_agrees(result) -> bool``: True exactly when every step's loss and the
    gradients after step 1 are within ``result.bound`` of the single-process run, and
    both runs have the same number of steps.

    Mistakes it is built to catch: the gradients ignored; zip hiding a missing step;
    a NaN accepted (NaN > bound is False); exact equality instead of the bound; a
    truthy non-bool (1, a tensor) returned; the bound taken as relative (x the loss,
    ~4: a loss 2.5e-5 off, or gradients 1.5e-5 off, just outside the absolute 1e-5,
    pass it); the mean difference over the steps instead of every step's (one step
    2.5e-5 off, the others exact: a mean of 0.8e-5)."""
    ref = [4.17, 4.02, 3.88]
    cases = [
        ("equal runs", _Run(list(ref), ref, 0.0, 1e-5), True),
        ("within the bound", _Run([x + 5e-6 for x in ref], ref, 8e-6, 1e-5), True),
        ("the last loss off by 1e-3", _Run(ref[:2] + [ref[2] + 1e-3], ref, 0.0, 1e-5), False),
        ("gradients off by 1e-2, losses equal", _Run(list(ref), ref, 1e-2, 1e-5), False),
        ("the first loss off by 2.5e-5 (the bound is 1e-5, absolute), the others equal",
         _Run([ref[0] + 2.5e-5] + ref[1:], ref, 0.0, 1e-5), False),
        ("gradients off by 1.5e-5 (the bound is 1e-5, absolute), losses equal",
         _Run(list(ref), ref, 1.5e-5, 1e-5), False),
        ("a step missing", _Run(ref[:2], ref, 0.0, 1e-5), False),
        ("a NaN loss", _Run(ref[:2] + [float("nan")], ref, 0.0, 1e-5), False),
    ]
    for what, run, want in cases:
        got = attempt(capstone_agrees, run, what="capstone_agrees")
        if not isinstance(got, bool):
            kind = f"{type(got).__module__}.{type(got).__qualname__}".removeprefix("builtins.")
            hint = (" (a comparison of tensors or arrays gives their own bool type: wrap it "
                    "in bool(...))" if type(got).__module__ in ("numpy", "torch") else "")
            raise CheckFailed(f"capstone_agrees must return a Python bool, got {kind} "
                              f"{got!r:.40}{hint}")
        if got != want:
            raise CheckFailed(f"{what}: capstone_agrees returned {got}, expected {want}")
    passed(f"capstone_agrees decides {len(cases)} runs correctly (losses, gradients, steps, NaN)")
