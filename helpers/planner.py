"""The smallest structure that fits: enumerate parallel layouts, reject, estimate, rank.

What
----
Given a model, a global batch, a GPU type and a cluster (chapter 07's
``Topology``), ``plan`` tries every way of writing the GPU count as

    world = dp x tp x pp x cp          (x ep carved out of dp x cp, for MoE)

together with the per-GPU choices: ZeRO stage, recompute mode, micro-batch
size and pipeline interleaving (model chunks per rank). Each candidate goes
through the rules in the course's order, and the first rule it breaks is
recorded as its reason (``Candidate.rule``, ``Candidate.reason``):

    1. TP inside a node         tp <= GPUs per node (ch. 09: four all-reduces
                                per layer, unhidden, want NVLink)
    2. shapes divide            heads and kv_heads % tp, layers % pp (or
                                layers + 2, Llama 3's embedding and loss
                                stages), seq % cp, experts % ep (ch. 08-12, 21)
    3. batch divides            global batch % dp, then % micro-batch (ch. 05)
    4. memory fits              weights + grads + optimizer + activations
                                <= ``memory_fraction`` of the GPU (ch. 06, 13, 14)

The survivors get a step-time estimate, one term per mechanism, each from the
chapter's own cost model (``helpers.memory``, ``helpers.topology``'s
``collective_cost``, ``helpers.pipeline``'s ``bubble_formula``):

    compute        model FLOPs at an assumed MFU, + recompute's extra forward
                   (ch. 01, 13; FLOPs: Narayanan et al. 2021 eq. 3)
    bubble         fill and drain, (p-1)/(v m + p-1) of the step (ch. 11-12)
    tp_comm        4 all-reduces per layer per micro-batch (6 with full
                   recompute) on the node's link (ch. 07-09)
    pp_p2p         an activation forward and a gradient backward per
                   micro-batch and chunk across a stage boundary (ch. 11)
    cp_comm        the all-gather of K and V (and reduce-scatter of their
                   gradients) per layer, Llama 3's CP (ch. 10)
    ep_comm        4 all-to-alls per MoE layer per micro-batch (ch. 21)
    dp_comm        gradient all-reduce / ZeRO reduce-scatter + all-gather,
                   exposed only where it outlasts the backward it overlaps
                   (ch. 04, 14-16)

Ranking: by step time, except that layouts within ``tie`` (2 %) of each other
go to the simpler structure (``Layout.complexity``: no EP before EP, no CP
before CP, fewer stages, less TP, lower ZeRO stage): an assumed MFU cannot
resolve a difference of a percent. ``Ranking.explain`` walks one layout term by
term, ``Ranking.decide`` names the term in which one layout pays most over
another, and ``ladder`` plans rung by rung up the course's order (DP, ZeRO-1/2,
ZeRO-3, TP in a node, PP across nodes, CP, EP): the first rung with a feasible
layout is the smallest structure that fits.

Why enumerate instead of a rule of thumb
----------------------------------------
The rule of thumb (the course's order) is the *shape* of the answer; which
rung you stop on depends on numbers: a 7B model fits on 80 GB GPUs only with
ZeRO, a 70B model needs its weights sharded before anything else matters, and
the micro-batch trades the pipeline bubble against activation memory. A 1024
GPU cluster has ~13,000 candidates; the rules are cheap, shape rules reject a
whole structure at once, and every cost is cached on the few degrees it
depends on, so the enumeration costs well under a second of CPU
(``benchmarks/bench_planner.py``).

Cost and how production differs
--------------------------------
This is a model with an assumed MFU, not a measurement. What it leaves out:
kernel efficiency that falls with smaller micro-batches or thinner TP shards
(so it likes micro-batch 1 more than practice does), activations of SwiGLU and
MoE layers (Korthikanti's count is a GPT layer's), uneven stages beyond the
embedding/loss rule, ZeRO-3's gathered-weight buffers, communication that
contends with compute or with other axes on the same NIC, the memory real
frameworks lose to buffers and fragmentation (``memory_fraction`` reserves a
share), the value of memory headroom, and stragglers. Real planners (Alpa,
Galvatron, the recipes of Megatron-LM and torchtitan, or a few hundred steps
of each shortlisted layout) search with measured per-operator costs or start
from a published recipe and measure; this one is for seeing *why* a recipe
looks the way it does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterable

from helpers.frameworks.estimate import hardware_flops_per_step, model_flops_per_step
from helpers.frameworks.plan import A100_80GB, GPU, H100_80GB, ModelSpec, Plan
from helpers.memory import GB, RECOMPUTE_MODES, activation_bytes_model, model_state_bytes
from helpers.pipeline.simulate import bubble_formula
from helpers.topology.cost import collective_cost, layout
from helpers.topology.links import Topology

__all__ = ["ModelSpec", "GPU", "Layout", "Candidate", "Ranking", "plan", "evaluate",
           "flops_per_token", "structures", "H100_80GB", "A100_80GB", "TERMS", "MEMORY_TERMS",
           "CHAPTER", "rungs", "ladder"]

MEMORY_TERMS = ("weights", "grads", "optimizer", "activations")
TERMS = ("compute", "bubble", "tp_comm", "pp_p2p", "cp_comm", "ep_comm", "dp_comm")
# where each term is taught
CHAPTER = {"compute": "01, 13", "bubble": "11-12", "tp_comm": "08-09", "pp_p2p": "11",
           "cp_comm": "10", "ep_comm": "21", "dp_comm": "04, 14-16", "weights": "06, 14",
           "grads": "06, 14", "optimizer": "06, 14", "activations": "06, 10, 13"}
BF16 = 2  # bytes of an activation, weight or gradient on the wire


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    """One candidate. Rank order (Megatron-LM's): tp fastest, then cp, then dp, then pp,
    so a TP group is tp consecutive GPUs (one node) and a pipeline stage boundary is
    the slowest-varying index (across nodes)."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    zero: int = 0
    recompute: str = "selective"
    micro_batch: int = 1
    interleave: int = 1       # virtual pipeline stages (model chunks) per rank, ch. 12

    def __post_init__(self):
        for f in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "interleave"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{f} must be a positive int, got {v!r}")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero must be the ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"Layout.recompute must be one of {RECOMPUTE_MODES}, "
                             f"got {self.recompute!r}")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def structure(self) -> tuple[int, int, int, int, int]:
        """(dp, tp, pp, cp, ep): the parallel structure without the per-GPU choices."""
        return (self.dp, self.tp, self.pp, self.cp, self.ep)

    def short(self) -> str:
        parts = [f"DP{self.dp}", f"TP{self.tp}", f"PP{self.pp}"]
        parts += [f"CP{self.cp}"] * (self.cp > 1) + [f"EP{self.ep}"] * (self.ep > 1)
        v = f", v {self.interleave}" if self.interleave > 1 else ""
        return (" x ".join(parts)
                + f" | ZeRO-{self.zero}, {self.recompute}, mb {self.micro_batch}{v}")

    def to_plan(self, global_batch: int, **choices) -> Plan:
        """Chapter 19's ``Plan`` for this layout at ``global_batch`` sequences: the
        degrees, ZeRO stage, recompute and micro-batch carried over, gradient
        accumulation the micro-batches per replica, and sequence parallelism
        whenever there is TP, gradient reduction overlapped with the backward and
        (ZeRO-3) weight gathers prefetched, as the planner assumes. ``choices``:
        other ``Plan`` fields (precision, fp32 gradients, overlap flags); by
        default the planner's bf16 mixed-precision Adam."""
        if global_batch % (self.dp * self.micro_batch):
            raise ValueError(f"global batch {global_batch} is not a multiple of dp x micro-batch "
                             f"= {self.dp} x {self.micro_batch}")
        return Plan(**{"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.interleave,
                       "cp": self.cp, "ep": self.ep, "zero_stage": self.zero,
                       "recompute": self.recompute, "sequence_parallel": self.tp > 1,
                       "micro_batch": self.micro_batch, "overlap_grad_reduce": True,
                       "overlap_param_gather": self.zero == 3,
                       "grad_accum": global_batch // (self.dp * self.micro_batch),
                       "global_batch": global_batch, "source": f"planner: {self.short()}",
                       **choices})

    @classmethod
    def from_plan(cls, plan: Plan) -> "Layout":
        """The layout of a chapter-19 ``Plan`` (its other knobs are not the planner's)."""
        return cls(plan.dp, plan.tp, plan.pp, plan.cp, plan.ep, plan.zero_stage, plan.recompute,
                   plan.micro_batch, plan.vpp)

    def complexity(self) -> tuple:
        """Smaller is simpler, in the course's order of escalation read backwards: a
        layout without EP beats one with it, then without CP, then fewer pipeline
        stages, then less TP, then a lower ZeRO stage, less recompute, fewer
        micro-batches."""
        return (self.ep, self.cp, self.pp, self.tp, self.zero,
                RECOMPUTE_MODES.index(self.recompute), self.interleave, -self.micro_batch)


@dataclasses.dataclass
class Candidate:
    """One layout as the planner judged it: the rule it broke (``rule``, ``reason``)
    or its memory and step-time terms. (Chapter 19's ``estimate`` gives the same
    layout's terms with each framework knob: ``layout.to_plan(global_batch)``.)"""

    layout: Layout
    reason: str = ""                                   # empty when feasible
    rule: str = ""                                     # short name of the broken rule
    memory: dict = dataclasses.field(default_factory=dict)   # bytes per GPU, by term
    time: dict = dataclasses.field(default_factory=dict)     # seconds per step, by term
    mfu: float = 0.0         # model FLOPs (no recompute) / (step time x peak), per GPU
    step_time: float = 0.0   # sum of ``time``
    memory_total: float = 0.0  # sum of ``memory``

    def __post_init__(self):
        self.step_time = sum(self.time.values())
        self.memory_total = sum(self.memory.values())

    @property
    def feasible(self) -> bool:
        return not self.reason


def flops_per_token(model: ModelSpec) -> float:
    """Training FLOPs per token without recompute: 6 N_active + 12 l h s.

    6 N: a multiply-add (2 FLOPs) per parameter forward, twice that backward
    (Kaplan et al. 2020, sec. 2.1). 12 l h s: the two attention matmuls (QK^T and
    attention x V), 4 l h s forward, counted over the full s x s square as the
    papers do. For a GPT with tied embeddings, N = 12 l h^2 + V h, this is
    Narayanan et al. 2021, eq. 3 divided by B s tokens, with 3/4 of their 96
    (they include a full recompute's extra forward); ``tp_layer_compute_time``
    (ch. 09) is the same count per layer. The input embedding is a lookup, not a
    matmul: an untied model's input matrix is not counted. It is three forward
    passes of ``ModelSpec.forward_flops_per_token``, the count chapter 19's
    ``estimate`` uses.
    """
    return 3 * model.forward_flops_per_token()


def _recompute_factor(model: ModelSpec, recompute: str) -> float:
    """Executed FLOPs / model FLOPs (chapter 19's ``hardware_flops_per_step``). Full
    recompute runs each layer's forward once more (4 passes instead of 3; the output
    layer is not recomputed: Narayanan et al. 2021 eq. 3, whose V/16lh term is 3
    passes of 2 h V); selective recomputes only the attention core's forward,
    4 l h s of the 12 l h s (Korthikanti et al. 2022, sec. 5)."""
    return (hardware_flops_per_step(model, 1, recompute)
            / model_flops_per_step(model, 1))


# ---------------------------------------------------------------------------
# Checks, memory and time for one layout
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
    if model.kv_heads_ % tp:
        return "kv-heads", (f"{model.kv_heads_} key/value heads do not divide over "
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
    if lay.interleave > 1 and (lay.pp == 1 or _stage_layers(model, lay.pp) % lay.interleave):
        return "interleave", (f"{lay.interleave} model chunks per rank need pipeline stages "
                              f"of a multiple of {lay.interleave} layers")
    if lay.cp > 1 and lay.recompute == "none":
        return "cp-recompute", ("CP runs fused (flash) attention, which keeps no s x s "
                                "scores: recompute 'none' is not a CP configuration")
    return "", ""


def _stage_layers(model: ModelSpec, pp: int) -> int:
    """Transformer layers on the busiest stage. When pp divides layers + 2 but not
    layers (Llama 3 405B: 126 layers on 16 stages), the embedding and the loss
    each take one layer's place on the first and the last stage (Dubey et al.
    2024, sec. 3.3.2), and the other stages hold ceil(layers / pp)."""
    return -(-model.layers // pp)


def _memory(model: ModelSpec, lay: Layout) -> tuple:
    """(weights, grads, optimizer, activations) bytes on the busiest GPU (pipeline
    stage 0): ``helpers.memory.training_memory``'s two halves, each cached on the
    few degrees it depends on.

    CP ranks hold the same weights, so ZeRO shards over dp x cp (Megatron's
    distributed optimizer does); each CP rank keeps the activations of seq / cp
    tokens. Experts are split over ep and their state is ZeRO-sharded over the
    dp x cp / ep ranks that share them."""
    w, g, o = _state(model, lay.tp * lay.pp, lay.dp * lay.cp, lay.zero, lay.ep)
    act = _activations(model, model.seq // lay.cp, lay.micro_batch, lay.tp, lay.pp, lay.recompute,
                       lay.interleave)
    return w, g, o, act


@functools.lru_cache(maxsize=None)
def _state(model: ModelSpec, model_parallel: int, dp: int, zero: int, ep: int) -> tuple:
    """Model state per GPU, bf16 mixed-precision Adam (16 bytes per parameter, ch. 06)
    as ``training_memory`` counts it: split over tp x pp, then ZeRO over dp."""
    s = model_state_bytes(model.dense_params() / model_parallel, dp=dp, zero_stage=zero)
    w, g, o = s.params, s.grads, s.optimizer
    if model.experts:
        e = model_state_bytes(model.expert_params() / (model_parallel * ep), dp=dp // ep,
                              zero_stage=zero)
        w, g, o = w + e.params, g + e.grads, o + e.optimizer
    return w, g, o


@functools.lru_cache(maxsize=None)
def _activations(model: ModelSpec, seq: int, micro_batch: int, tp: int, pp: int,
                 recompute: str, interleave: int) -> float:
    """Korthikanti et al. 2022's count (``activation_bytes_model``) for the first
    stage, sequence parallel whenever there is TP (as Megatron-LM runs it). The
    formula is a GPT layer (4h GeLU MLP): for a SwiGLU or MoE model it is an
    estimate of the same order, not that model's exact count (see MODEL_PRESETS
    in helpers.memory)."""
    return activation_bytes_model(seq, micro_batch, model.hidden, model.heads,
                                  _stage_layers(model, pp) * pp,
                                  tp=tp, pp=pp, sequence_parallel=tp > 1, recompute=recompute,
                                  vocab=model.vocab, interleave=interleave)


def _coll(topo: Topology, collective: str, nbytes: float, size: int, stride: int) -> float:
    """Seconds of one collective over ``size`` GPUs spaced ``stride`` apart (the group
    of GPU 0; every other group of that axis looks the same). Hierarchical where the
    group spans nodes with several GPUs on each, as NCCL's multi-channel rings behave
    (ch. 07); ``collective_cost`` falls back to a ring where that is the same thing."""
    if size == 1:
        return 0.0
    latency, per_byte = _affine(topo, collective, size, stride)
    return latency + per_byte * nbytes


@functools.lru_cache(maxsize=None)
def _affine(topo: Topology, collective: str, size: int, stride: int) -> tuple[float, float]:
    """(seconds at 0 bytes, seconds per byte) of ``collective_cost`` for this group.

    Every model of chapter 07 is a sum of steps alpha + n / beta with n
    proportional to the message, so its time is affine in the bytes: two calls
    give it for every size (placing the group on nodes, the slow part, runs once).
    """
    algo = "direct" if collective == "all_to_all" else "hierarchical"
    ranks = list(range(0, size * stride, stride))
    try:
        layout(topo, ranks)
    except ValueError:
        # The group lands unevenly on nodes (20 GPUs on 8-GPU nodes: 8, 8, 4). The
        # hierarchical model needs equal counts; a flat ring does not: it costs
        # 2(P-1) steps at the slowest hop whatever the split, so any placement of P
        # GPUs that crosses nodes gives its time (one GPU per node where possible).
        algo = "direct" if collective == "all_to_all" else "ring"
        m = next(m for m in range(1, size + 1) if size % m == 0 and size // m <= topo.nodes)
        ranks = [node * topo.gpus_per_node + i for node in range(size // m) for i in range(m)]
    t0 = collective_cost(topo, collective, 0.0, ranks, algo).time
    t1 = collective_cost(topo, collective, GB, ranks, algo).time
    return t0, (t1 - t0) / GB


def _time(model: ModelSpec, lay: Layout, global_batch: int, gpu: GPU, topo: Topology,
          mfu: float) -> dict:
    """Seconds per step, by term (see the module docstring)."""
    h, s, L = model.hidden, model.seq // lay.cp, _stage_layers(model, lay.pp) * lay.pp
    m = global_batch // lay.dp // lay.micro_batch          # micro-batches per replica
    tokens_mb = lay.micro_batch * s                        # one micro-batch's tokens on a CP rank
    world = lay.world
    # compute: the step's executed FLOPs spread evenly over every GPU, at the assumed MFU
    flops = (flops_per_token(model) * global_batch * model.seq
             * _recompute_factor(model, lay.recompute))
    compute = flops / world / (gpu.peak_flops * mfu)
    # bubble: idle share (p-1)/(v m + p-1) of the step (ch. 12), so the step is
    # compute / (1 - that); for v = 1 this is ch. 11's (m + p - 1) / m
    bubble = compute / (1 - bubble_formula(lay.pp, m, lay.interleave)) - compute
    # TP: per layer 2 all-reduces forward + 2 backward of a (tokens, h) activation
    # (Shoeybi et al. 2019, sec. 3); full recompute repeats the forward's 2. With SP
    # they are reduce-scatter + all-gather pairs: the same bytes on a ring.
    n_ar = 6 if lay.recompute == "full" else 4
    tp = n_ar * (L // lay.pp) * m * _coll(topo, "all_reduce", tokens_mb * h * BF16, lay.tp, 1)
    # PP: one activation forward, one gradient backward per micro-batch (SP: 1/tp of it,
    # Narayanan et al. 2021 sec. 4.1's scatter/gather), between GPUs tp*cp*dp apart.
    p2p = 0.0
    if lay.pp > 1:
        # the pipeline is as slow as its slowest hop: across nodes unless all pp
        # stages of GPU 0's pipeline share its node (as chapter 19's ``estimate``)
        stride = lay.tp * lay.cp * lay.dp
        link = topo.intra if stride * lay.pp <= topo.gpus_per_node else topo.inter
        p2p = 2 * m * lay.interleave * link.time(tokens_mb * h * BF16 / lay.tp)  # v chunks: v hops
    # CP (Dubey et al. 2024, sec. 3.3.2): all-gather K and V (kv heads / tp of them) per
    # layer forward, again in backward, and reduce-scatter their gradients; not overlapped.
    cp = 0.0
    if lay.cp > 1:
        kv = 2 * lay.micro_batch * model.seq * h * model.kv_heads_ // model.heads * BF16 / lay.tp
        per = 2 * _coll(topo, "all_gather", kv, lay.cp, lay.tp) \
            + _coll(topo, "reduce_scatter", kv, lay.cp, lay.tp)
        cp = per * (L // lay.pp) * m
    # EP: dispatch + combine forward, their transposes backward, top_k copies of each token
    ep = 0.0
    if lay.ep > 1:
        nbytes = tokens_mb * model.top_k * h * BF16 / lay.tp
        # the EP group: ep consecutive members of the dp x cp group (stride tp), so
        # that the ranks sharing an expert are every ep-th member (``_dp_exposed``)
        ep = 4 * (L // lay.pp) * m * _coll(topo, "all_to_all", nbytes, lay.ep, lay.tp)
    dp = _dp_exposed(model, lay, topo, compute / m, m)
    return {"compute": compute, "bubble": bubble, "tp_comm": tp, "pp_p2p": p2p, "cp_comm": cp,
            "ep_comm": ep, "dp_comm": dp}


def _dp_exposed(model: ModelSpec, lay: Layout, topo: Topology, t_microbatch: float,
                m: int) -> float:
    """Gradient synchronisation time that the backward does not hide.

    Stages 0-2 reduce once per step, after the last micro-batch (gradient
    accumulation, ch. 05), overlapped with that micro-batch's backward (2/3 of its
    compute; DDP's buckets, ch. 04/16): stage 0 all-reduces; stages 1-2 reduce-scatter
    the gradients and all-gather the updated weights, the same bytes (ch. 14).
    Stage 3 gathers each unit's weights before its forward and again before its
    backward and reduce-scatters its gradients, every micro-batch (ch. 15), hidden
    behind that micro-batch's compute by prefetch (ch. 16).
    """
    group, stride = lay.dp * lay.cp, lay.tp
    dense = model.dense_params() / (lay.tp * lay.pp) * BF16
    groups = [(dense, group, stride)]
    if model.experts:
        groups.append((model.expert_params() / (lay.tp * lay.pp * lay.ep) * BF16,
                       group // lay.ep, stride * lay.ep))
    if group == 1 and len(groups) == 1:
        return 0.0
    if lay.zero < 3:
        t = 0.0
        for nbytes, size, st in groups:
            if lay.zero == 0:
                t += _coll(topo, "all_reduce", nbytes, size, st)
            else:
                t += _coll(topo, "reduce_scatter", nbytes, size, st) \
                    + _coll(topo, "all_gather", nbytes, size, st)
        return max(0.0, t - 2 / 3 * t_microbatch)
    per_mb = sum(2 * _coll(topo, "all_gather", nb, size, st)
                 + _coll(topo, "reduce_scatter", nb, size, st) for nb, size, st in groups)
    return max(0.0, per_mb - t_microbatch) * m


def evaluate(model: ModelSpec, layout: Layout, global_batch: int, gpu: GPU, topology: Topology,
             *, mfu: float = 0.5, memory_fraction: float = 0.9) -> Candidate:
    """Check one layout and estimate it: the reason it is rejected, or its memory
    and step-time terms. ``memory_fraction``: the share of GPU memory the model may
    use (the rest: CUDA context, communication buffers, fragmentation; ch. 06)."""
    if layout.world != topology.world_size:
        return Candidate(layout, f"dp x tp x pp x cp = {layout.world} is not the "
                                f"{topology.world_size} GPUs of the cluster", "world")
    rule, reason = _structure_rule(model, *layout.structure, global_batch, topology)
    if not rule:
        rule, reason = _variant_rule(model, layout, global_batch)
    if rule:
        return Candidate(layout, reason, rule)
    mem = dict(zip(MEMORY_TERMS, _memory(model, layout)))
    budget = memory_fraction * gpu.memory
    if sum(mem.values()) > budget:
        big = max(mem, key=mem.get)
        return Candidate(layout, f"memory {sum(mem.values()) / GB:.1f} GB > {budget / GB:.1f} GB "
                                f"usable; largest term: {big} {mem[big] / GB:.1f} GB",
                        "memory", mem)
    est = Candidate(layout, "", "", mem, _time(model, layout, global_batch, gpu, topology, mfu))
    model_flops = flops_per_token(model) * global_batch * model.seq / layout.world
    est.mfu = model_flops / (est.step_time * gpu.peak_flops)
    return est


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


@dataclasses.dataclass
class Ranking:
    """The planner's answer, a ranking of candidate layouts: ``ranked`` (feasible,
    fastest first) and ``rejected`` (each with the rule it broke). Not chapter 19's
    ``Plan``: that is one job's configuration, which ``Layout.to_plan`` builds."""

    model: ModelSpec
    global_batch: int
    gpu: GPU
    topology: Topology
    mfu: float
    ranked: list[Candidate]
    rejected: list[Candidate]

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            raise ValueError(f"no layout of {self.model.name} fits {self.topology.world_size} x "
                             f"{self.gpu.name}; most common reasons: {self.reasons(3)}")
        return self.ranked[0]

    def structures(self) -> list[Candidate]:
        """The best estimate of each (dp, tp, pp, cp, ep), fastest first."""
        seen, out = set(), []
        for e in self.ranked:
            if e.layout.structure not in seen:
                seen.add(e.layout.structure)
                out.append(e)
        return out

    def find(self, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> Candidate:
        """The best feasible variant of a structure; if there is none, the rejected
        variant that got furthest (its reason says what stopped it)."""
        key = (dp, tp, pp, cp, ep)
        for e in self.ranked:
            if e.layout.structure == key:
                return e
        mine = [e for e in self.rejected if e.layout.structure == key]
        if not mine:
            raise ValueError(f"DP{dp} x TP{tp} x PP{pp} x CP{cp} x EP{ep} was not enumerated "
                             f"(degrees must multiply to {self.topology.world_size})")
        return min(mine, key=lambda e: (e.rule != "memory", e.memory_total or math.inf))

    def rank_of(self, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> int | None:
        """1-based rank of a structure among structures (None if no variant is feasible)."""
        for i, e in enumerate(self.structures(), 1):
            if e.layout.structure == (dp, tp, pp, cp, ep):
                return i
        return None

    def reasons(self, k: int | None = None) -> list[tuple[str, int]]:
        """(rule, how many candidates it rejected), most common first."""
        counts: dict[str, int] = {}
        for e in self.rejected:
            counts[e.rule] = counts.get(e.rule, 0) + 1
        return sorted(counts.items(), key=lambda kv: -kv[1])[:k]

    def decide(self, a: Candidate, b: Candidate) -> tuple[str, float]:
        """(term, seconds): the term in which b pays most over a (the largest
        b - a): what makes b slower than a. The other terms' differences may
        partly offset it; all of them sum to b.step_time - a.step_time."""
        diffs = {t: b.time.get(t, 0.0) - a.time.get(t, 0.0) for t in TERMS}
        term = max(diffs, key=diffs.get)
        return term, diffs[term]

    def explain(self, est: Candidate | None = None) -> str:
        """One estimate, term by term, with the chapter that teaches each term."""
        e = est or self.best
        lines = [f"{self.model.name} on {self.topology.world_size} x {self.gpu.name}, global batch "
                 f"{self.global_batch} x {self.model.seq} tokens: {e.layout.short()}"]
        if not e.feasible:
            return lines[0] + f"\n  rejected: {e.reason}"
        lines.append(f"  memory per GPU {e.memory_total / GB:6.1f} GB of {self.gpu.memory / GB:g}:")
        for t in MEMORY_TERMS:
            lines.append(f"    {t:<12}{e.memory[t] / GB:8.2f} GB   (ch. {CHAPTER[t]})")
        lines.append(f"  step time {e.step_time:.3f} s (MFU {e.mfu:.1%} at an assumed "
                     f"{self.mfu:.0%} for the compute alone):")
        for t in TERMS:
            if e.time[t] or t in ("compute", "bubble", "dp_comm"):
                share = e.time[t] / e.step_time
                lines.append(f"    {t:<12}{e.time[t]:8.3f} s  {share:6.1%}   (ch. {CHAPTER[t]})")
        return "\n".join(lines)

    def table(self, k: int = 8, per_structure: bool = True) -> str:
        rows = self.structures() if per_structure else self.ranked
        head = f"{'#':>3}  {'layout':<48}{'GB/GPU':>8}{'step s':>9}{'MFU':>7}"
        out = [head]
        for i, e in enumerate(rows[:k], 1):
            out.append(f"{i:>3}  {e.layout.short():<48}{e.memory_total / GB:8.1f}"
                       f"{e.step_time:9.3f}{e.mfu:7.1%}")
        return "\n".join(out)


def plan(model: ModelSpec, global_batch: int, gpu: GPU, topology: Topology, *, mfu: float = 0.5,
         memory_fraction: float = 0.9, tie: float = 0.02,
         zero_stages: Iterable[int] = (0, 1, 2, 3), recomputes: Iterable[str] = RECOMPUTE_MODES,
         micro_batches: Iterable[int] = (1, 2, 4, 8), interleaves: Iterable[int] = (1, 2, 4, 8),
         tp_sizes: Iterable[int] | None = None, pp_sizes: Iterable[int] | None = None,
         cp_sizes: Iterable[int] | None = None, ep_sizes: Iterable[int] | None = None) -> Ranking:
    """Enumerate, check, estimate and rank every layout.

    ``global_batch`` in sequences of ``model.seq`` tokens. ``mfu``: the share of
    peak FLOP/s the compute achieves (0.4-0.55 for well-tuned dense training on
    H100/A100: Narayanan et al. 2021 Table 1, Dubey et al. 2024 Table 4).
    ``tie``: layouts whose step times lie in the same ``1 + tie`` band above the
    fastest rank by simplicity (``Layout.complexity``): an assumed MFU does not
    resolve differences of a percent or two, so within that the smaller
    structure wins. A structure that breaks a shape rule is rejected once, with
    its first variant's choices; variants are rejected one by one."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive int (sequences), got {global_batch!r}")
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
        if not values or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                             for x in values):
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
              if v == 1 or (st[2] > 1 and _stage_layers(model, st[2]) % v == 0)]
        for z in zero_stages:
            for r in recomputes:
                for v in vs:
                    for mb in sorted(micro_batches):
                        e = evaluate(model, Layout(*st, z, r, mb, v), global_batch, gpu,
                                     topology, mfu=mfu, memory_fraction=memory_fraction)
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
    return Ranking(model, global_batch, gpu, topology, mfu, ranked, rejected)


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
