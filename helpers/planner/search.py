"""The search: enumerate every layout, check the course's rules in order, estimate, rank.

``structures`` lists every (dp, tp, pp, cp, ep) whose product is the
cluster; ``evaluate`` checks one layout against the rules (TP inside a node,
shapes divide, batch divides, memory fits; the first broken rule is the
reason) and estimates the survivors with ``cost``; ``plan`` runs both over
every structure and per-GPU choice and ranks the result into a
``rank.Ranking``; ``rungs`` and ``ladder`` climb the course's order of
escalation (DP, ZeRO-1/2, ZeRO-3, TP in a node, PP across nodes, CP, EP)
one rung at a time. The package docstring has the rules, the ranking and
what the search leaves out.
"""

from __future__ import annotations

import math
from typing import Iterable

from helpers.costs.gemm import GemmTable
from helpers.frameworks.plan import GPU, ModelSpec
from helpers.memory import GB
from helpers.planner.cost import (flops_per_token, gemm_efficiency, memory_terms, stage_layers,
                                  time_terms)
from helpers.planner.layouts import MEMORY_TERMS, Candidate, Layout
from helpers.planner.rank import Ranking
from helpers.recompute import RECOMPUTE_MODES
from helpers.topology.links import Topology
from helpers.validate import is_int, positive_int

__all__ = ["evaluate", "structures", "plan", "rungs", "ladder"]


# ---------------------------------------------------------------------------
# Checks for one layout
# ---------------------------------------------------------------------------

def _structure_rule(model: ModelSpec, dp: int, tp: int, pp: int, cp: int, ep: int,
                    global_batch: int, topo: Topology) -> tuple[str, str]:
    """(rule, message) for the first shape rule a structure breaks, in the course's
    order, or ('', ''). These do not depend on ZeRO, recompute or micro-batch."""
    g = topo.gpus_per_node
    if tp > g:
        return "tp-crosses-node", (f"TP crosses a node: tp={tp} > {g} GPUs per node (ch. 09: "
                                   f"TP's all-reduces need the node's link)")
    if model.heads % tp:
        return "heads", f"{model.heads} heads do not divide over tensor-parallel size {tp}"
    if model.n_kv_heads % tp:
        return "kv-heads", (f"{model.n_kv_heads} key/value heads do not divide over "
                            f"tensor-parallel size {tp}")
    if model.layers % pp and (model.layers + 2) % pp:
        return "layers", (f"{model.layers} layers do not split over {pp} pipeline stages "
                          f"(nor {model.layers} + 2, with the embedding and the loss as a "
                          f"layer each)")
    if model.seq % cp:
        return "seq-cp", f"sequence {model.seq} does not split over context-parallel size {cp}"
    if (model.seq // cp) % tp:
        return "seq-sp", (f"sequence parallel: {model.seq // cp} tokens per CP rank do not "
                          f"split over tensor-parallel size {tp}")
    if ep > 1 and (model.experts % ep or (dp * cp) % ep):
        return "experts", (f"expert-parallel size {ep} must divide the {model.experts} experts "
                           f"and dp x cp = {dp * cp}")
    if global_batch % dp:
        return "batch", f"global batch {global_batch} does not divide over dp={dp}"
    return "", ""


def _variant_rule(model: ModelSpec, lay: Layout, global_batch: int) -> tuple[str, str]:
    """Rules of the per-GPU choices: micro-batch, interleaving, recompute."""
    if (global_batch // lay.dp) % lay.micro_batch:
        return "micro-batch", (f"batch per replica {global_batch // lay.dp} is not a multiple "
                               f"of micro-batch {lay.micro_batch}")
    if lay.interleave > 1 and (lay.pp == 1 or stage_layers(model, lay.pp) % lay.interleave):
        return "interleave", (f"{lay.interleave} model chunks per rank need pipeline stages "
                              f"of a multiple of {lay.interleave} layers")
    if lay.cp > 1 and lay.recompute == "none":
        return "cp-recompute", ("CP runs fused (flash) attention, which keeps no s x s "
                                "scores: recompute 'none' is not a CP configuration")
    return "", ""


def evaluate(model: ModelSpec, layout: Layout, global_batch: int, gpu: GPU, topology: Topology,
             *, mfu: float = 0.5, memory_fraction: float = 0.9,
             gemm_table: GemmTable | str | None = None, check_memory: bool = True) -> Candidate:
    """Check one layout and estimate it: the reason it is rejected, or its memory
    and step-time terms. ``memory_fraction``: the share of GPU memory the model may
    use (the rest: CUDA context, communication buffers, fragmentation; ch. 06).
    ``gemm_table``: see ``plan``. ``check_memory=False``: estimate a layout that ran
    somewhere whatever the memory rule says (a published run the model thinks does
    not fit): its memory terms are there to compare with the GPU, and its step time
    is estimated anyway; the other rules still apply."""
    gemm_table = _gemm_table(gemm_table, model, gpu)
    if layout.world != topology.world_size:
        return Candidate(layout, f"dp x tp x pp x cp = {layout.world} is not the "
                                f"{topology.world_size} GPUs of the cluster", "world")
    rule, reason = _structure_rule(model, *layout.structure, global_batch, topology)
    if not rule:
        rule, reason = _variant_rule(model, layout, global_batch)
    if rule:
        return Candidate(layout, reason, rule)
    mem = dict(zip(MEMORY_TERMS, memory_terms(model, layout, global_batch)))
    budget = memory_fraction * gpu.memory
    if check_memory and sum(mem.values()) > budget:
        big = max(mem, key=mem.get)
        return Candidate(layout, f"memory {sum(mem.values()) / GB:.1f} GB > {budget / GB:.1f} GB "
                                f"usable; largest term: {big} {mem[big] / GB:.1f} GB",
                        "memory", mem)
    est = Candidate(layout, "", "", mem,
                    time_terms(model, layout, global_batch, gpu, topology, mfu, gemm_table))
    if gemm_table is not None:
        tokens = layout.micro_batch * (model.seq // layout.cp)
        est.gemm_efficiency = gemm_efficiency(model, layout.tp, tokens, gemm_table,
                                              gpu.peak_flops)
    model_flops = flops_per_token(model) * global_batch * model.seq / layout.world
    est.mfu = model_flops / (est.step_time * gpu.peak_flops)
    return est


def _gemm_table(table: GemmTable | str | None, model: ModelSpec, gpu: GPU) -> GemmTable | None:
    """The table ``plan`` prices GEMMs with, checked: measured on this GPU, for a dense model."""
    if table is None:
        return None
    if isinstance(table, str):
        table = GemmTable.load(table)        # names the tables there are if there is none
    if not isinstance(table, GemmTable):
        raise TypeError(f"gemm_table must be a GemmTable or a table's name, "
                        f"got {type(table).__name__}")
    if gpu.name.split()[0] not in table.gpu.split():
        raise ValueError(f"the GEMM table was measured on {table.gpu}, not {gpu.name}: "
                         f"measure one on that GPU with benchmarks/bench_gemm.py")
    if model.experts:
        raise ValueError(f"the measured GEMM table prices dense layers; {model.name} has "
                         f"{model.experts} experts (plan it without gemm_table)")
    return table


# ---------------------------------------------------------------------------
# Enumerate and rank
# ---------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structures(model: ModelSpec, topology: Topology, *, tp_sizes: Iterable[int] | None = None,
               pp_sizes: Iterable[int] | None = None, cp_sizes: Iterable[int] | None = None,
               ep_sizes: Iterable[int] | None = None) -> list[tuple[int, int, int, int, int]]:
    """Every (dp, tp, pp, cp, ep) with dp x tp x pp x cp = world.

    ``*_sizes``: None means every divisor that could work (CP sizes that divide
    the sequence; EP sizes that divide the experts, 1 for a dense model); a
    tuple restricts that axis (``(1,)`` switches it off)."""
    world = topology.world_size
    tps = _divisors(world) if tp_sizes is None else [t for t in tp_sizes if world % t == 0]
    pps = None if pp_sizes is None else set(pp_sizes)
    cps = ([c for c in _divisors(world) if model.seq % c == 0] if cp_sizes is None
           else list(cp_sizes))
    if ep_sizes is None:
        eps = [e for e in _divisors(model.experts) if world % e == 0] if model.experts else [1]
    else:
        eps = list(ep_sizes)
    return [(world // (tp * pp * cp), tp, pp, cp, ep)
            for tp in tps for pp in _divisors(world // tp) if pps is None or pp in pps
            for cp in cps if (world // (tp * pp)) % cp == 0 for ep in eps]


def plan(model: ModelSpec, global_batch: int, gpu: GPU, topology: Topology, *, mfu: float = 0.5,
         memory_fraction: float = 0.9, tie: float = 0.02,
         zero_stages: Iterable[int] = (0, 1, 2, 3), recomputes: Iterable[str] = RECOMPUTE_MODES,
         micro_batches: Iterable[int] = (1, 2, 4, 8), interleaves: Iterable[int] = (1, 2, 4, 8),
         tp_sizes: Iterable[int] | None = None, pp_sizes: Iterable[int] | None = None,
         cp_sizes: Iterable[int] | None = None, ep_sizes: Iterable[int] | None = None,
         gemm_table: GemmTable | str | None = None) -> Ranking:
    """Enumerate, check, estimate and rank every layout.

    ``global_batch`` in sequences of ``model.seq`` tokens. ``mfu``: the share of
    peak FLOP/s the compute achieves (0.4-0.55 for well-tuned dense training on
    H100/A100: Narayanan et al. 2021 Table 1, Dubey et al. 2024 Table 4).
    ``tie``: layouts whose step times lie in the same ``1 + tie`` band above the
    fastest rank by simplicity (``Layout.complexity``): an assumed MFU does not
    resolve differences of a percent or two, so within that the smaller
    structure wins. A structure that breaks a shape rule is rejected once, with
    its first variant's choices; variants are rejected one by one.

    ZeRO-2 is enumerated as it shards its gradients under accumulation: a
    reduce-scatter after every micro-batch. ZeRO-2 that holds whole gradients until
    the step's one reduce-scatter (``Layout.whole_grads``) costs exactly what ZeRO-1
    costs, memory and traffic, so the ZeRO-1 candidates stand for it and the ranking
    chooses between the two; ``evaluate`` prices it by name.

    ``gemm_table``: a measured ``helpers.costs.gemm.GemmTable`` (e.g.
    ``GemmTable.load("h100")``, or its name, ``"h100"``), measured on ``gpu``. None (the default) prices every FLOP at ``mfu``.
    Given, each layout's layer GEMMs run at the efficiency measured for its shapes
    (its TP size, and micro-batch x seq / cp tokens per micro-batch), so thin TP
    shards and small micro-batches cost what they cost on that GPU, and ``mfu``
    becomes the *assumed* rate of the FLOPs the table does not measure: attention's
    score and score-times-V matmuls and the output layer. The measured efficiency
    is of the GEMMs alone: memory-bound work between them (norms, activations,
    softmax, the optimizer step) is not priced at all, so a layout's MFU from it
    overshoots what the same layout achieves in practice. Dense models only (an
    MoE layer's expert GEMMs see a routed share of the tokens, which the table's
    shapes do not describe)."""
    positive_int("global_batch (sequences)", global_batch)
    gemm_table = _gemm_table(gemm_table, model, gpu)
    for name, v in (("mfu", mfu), ("memory_fraction", memory_fraction)):
        if not 0 < v <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {v!r}")
    if not tie >= 0:
        raise ValueError(f"tie must be >= 0, got {tie!r}")
    zero_stages, recomputes = tuple(zero_stages), tuple(recomputes)
    micro_batches, interleaves = tuple(micro_batches), tuple(interleaves)
    for r in recomputes:
        if r not in RECOMPUTE_MODES:
            raise ValueError(f"unknown recompute mode {r!r}; choose from {RECOMPUTE_MODES}")
    for z in zero_stages:
        if isinstance(z, bool) or z not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {z!r}")
    for name, values in (("micro-batch sizes", micro_batches), ("interleaves", interleaves)):
        if not values or any(not is_int(x) or x < 1 for x in values):
            raise ValueError(f"{name} must be positive ints, got {values!r}")
    ranked, rejected = [], []
    for st in structures(model, topology, tp_sizes=tp_sizes, pp_sizes=pp_sizes,
                         cp_sizes=cp_sizes, ep_sizes=ep_sizes):
        rule, reason = _structure_rule(model, *st, global_batch, topology)
        if rule:
            rejected.append(Candidate(Layout(*st, zero_stages[0], recomputes[0], micro_batches[0]),
                                     reason, rule))
            continue
        # interleaving only means something with a pipeline whose stages it divides
        vs = [v for v in interleaves
              if v == 1 or (st[2] > 1 and stage_layers(model, st[2]) % v == 0)]
        for z in zero_stages:
            for r in recomputes:
                for v in vs:
                    for mb in sorted(micro_batches):
                        e = evaluate(model, Layout(*st, z, r, mb, v), global_batch, gpu,
                                     topology, mfu=mfu, memory_fraction=memory_fraction,
                                     gemm_table=gemm_table)
                        (ranked if e.feasible else rejected).append(e)
                        if e.rule == "memory":
                            break   # activations grow with the micro-batch: larger ones fail too
    if ranked:
        fastest = min(e.step_time for e in ranked)
        if tie:   # band k holds step times in [fastest (1+tie)^k, fastest (1+tie)^(k+1))
            ranked.sort(key=lambda e: (int(math.log(e.step_time / fastest) / math.log1p(tie)),
                                       e.layout.complexity(), e.step_time))
        else:
            ranked.sort(key=lambda e: (e.step_time, e.layout.complexity()))
    return Ranking(model, global_batch, gpu, topology, mfu, ranked, rejected, gemm_table)


# ---------------------------------------------------------------------------
# The course's order as a decision procedure
# ---------------------------------------------------------------------------

def rungs(model: ModelSpec, topology: Topology) -> list[tuple[str, dict]]:
    """The course's escalation, each rung with the ``plan`` options it allows (each
    rung keeps what the ones before it allowed). Recompute is allowed on every rung:
    it is a knob of each GPU, not a parallel structure (ch. 13)."""
    one = (1,)
    base = dict(tp_sizes=one, pp_sizes=one, cp_sizes=one, ep_sizes=one, interleaves=one)
    out = [("DP (ch. 02-05)", dict(base, zero_stages=(0,))),
           ("+ ZeRO-1/2 (ch. 14)", dict(base, zero_stages=(0, 1, 2))),
           ("+ ZeRO-3 / FSDP (ch. 15)", dict(base)),
           ("+ TP inside a node (ch. 08-09)", dict(base, tp_sizes=None)),
           ("+ PP across nodes (ch. 11-12)", dict(base, tp_sizes=None, pp_sizes=None,
                                                  interleaves=(1, 2, 4, 8))),
           ("+ CP (ch. 10)", dict(base, tp_sizes=None, pp_sizes=None, interleaves=(1, 2, 4, 8),
                                  cp_sizes=None))]
    if model.experts:
        out.append(("+ EP (ch. 21)", dict(out[-1][1], ep_sizes=None)))
    return out


def ladder(model: ModelSpec, global_batch: int, gpu: GPU, topology: Topology,
           **kwargs) -> list[tuple[str, Ranking]]:
    """Climb ``rungs`` in order and plan on each; the first rung whose plan has a
    feasible layout is the smallest structure that fits. The rungs after it show
    what more structure buys (or costs)."""
    return [(name, plan(model, global_batch, gpu, topology, **(opts | kwargs)))
            for name, opts in rungs(model, topology)]
