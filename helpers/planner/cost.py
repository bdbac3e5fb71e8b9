"""The planner's cost model: memory and step time of one layout, one term per mechanism.

Every number the planner ranks by comes from this module; each term is the
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

Memory (``memory_terms``): weights, gradients and optimizer state from
``helpers.memory.model_state_bytes`` (Rajbhandari et al. 2020, sec. 3.1: bf16
mixed-precision Adam, 16 bytes per parameter, ZeRO-sharded over dp x cp),
activations from ``activation_bytes_model`` (Korthikanti et al. 2022, sec. 4
and Table 2) on the busiest (first) pipeline stage; ``time_terms`` gives the
seconds per step, by term, as the list above.

Chapter 19's ``helpers.frameworks.estimate`` prices a framework
configuration with its own cost code; the two agree term by term where they
model the same thing (``tests/test_plan_consistency.py``). They are kept
apart for now; every cost the planner uses lives here, so replacing it with
a shared per-term cost library changes this module only.
"""

from __future__ import annotations

import functools

from helpers.frameworks.estimate import hardware_flops_per_step, model_flops_per_step
from helpers.frameworks.plan import GPU, ModelSpec
from helpers.memory import GB, activation_bytes_model, model_state_bytes
from helpers.pipeline.simulate import bubble_formula
from helpers.planner.layouts import Layout
from helpers.topology.cost import collective_cost, layout
from helpers.topology.links import Topology

__all__ = ["BF16", "flops_per_token", "stage_layers", "memory_terms", "time_terms"]

BF16 = 2  # bytes of an activation, weight or gradient on the wire


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
# Memory and time for one layout
# ---------------------------------------------------------------------------

def stage_layers(model: ModelSpec, pp: int) -> int:
    """Transformer layers on the busiest stage. When pp divides layers + 2 but not
    layers (Llama 3 405B: 126 layers on 16 stages), the embedding and the loss
    each take one layer's place on the first and the last stage (Dubey et al.
    2024, sec. 3.3.2), and the other stages hold ceil(layers / pp)."""
    return -(-model.layers // pp)


def memory_terms(model: ModelSpec, lay: Layout) -> tuple:
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
                                  stage_layers(model, pp) * pp,
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


def time_terms(model: ModelSpec, lay: Layout, global_batch: int, gpu: GPU, topo: Topology,
               mfu: float) -> dict:
    """Seconds per step, by term (see the module docstring)."""
    h, s, L = model.hidden, model.seq // lay.cp, stage_layers(model, lay.pp) * lay.pp
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
