"""What a plan costs: per-GPU memory, bytes per step per axis, step time.

``estimate(plan, model, cluster)`` composes the course's own models; every
term carries the chapter that derived it, and none is a second copy:

memory (bytes on the busiest GPU, the first pipeline stage)
    weights / gradients / optimizer   ``helpers.memory.model_state_bytes`` (ch. 06, 14):
        the parameters a GPU owns (1 / (tp pp) of the dense ones, experts also / ep)
        at the plan's bytes per parameter, sharded over ``plan.shard_ranks`` by
        the ZeRO stage; offloaded parts move to ``cpu_bytes``
    gathered unit (stage 3)           chapter 15: one layer all-gathered, plus the
        next one prefetched when the gather overlaps
    activations                        ``helpers.memory.activation_bytes_model``
        (Korthikanti et al. 2022, Table 2 and sec. 4.2.3; ch. 06, 10, 13) on
        seq / cp tokens, with TP, SP, recompute and interleaving

communication (bytes each GPU sends per step; time from chapter 07's models)
    tp    4 all-reduces of a layer's activation per layer per micro-batch
          (chapter 09's ``tp_comm_bytes``; 6 with full recompute, whose
          re-run forward repeats the forward two), timed by chapter 09's
          ``tp_layer_comm_time`` on the link the TP group spans
    dp    gradients reduced once per step (all-reduce, or reduce-scatter +
          all-gather of the weights with a sharded optimizer: the same
          bytes); stage 3 gathers weights in forward and backward and
          reduce-scatters gradients for every micro-batch (chapter 14-15)
    pp    one activation forward, one gradient back per micro-batch per
          model chunk (chapter 11), 1/t of it with sequence parallelism
    cp    ring attention: each rank passes its K and V blocks cp - 1 times
          forward, K, V and their gradients backward (chapter 10)
    ep    dispatch and combine all-to-alls, forward and backward (chapter 21)

step time
    compute   hardware FLOPs (Narayanan et al. 2021, sec. 5.1, eq. 3: 96 B s l h^2
              (1 + s/6h + V/16lh) with full recompute, 3/4 of the layer part
              without, plus the recomputed attention with selective) / GPUs /
              (peak x matmul efficiency)
    bubble    compute x (p-1) / (v m) (chapter 12's ``bubble_formula``)
    exposed   communication not hidden: TP always (it sits between matmuls),
              PP's fill and drain hops, DP beyond what overlap hides behind the
              last micro-batch's backward / the first forward (chapter 16), EP
              always; CP is assumed hidden behind the attention blocks

How production differs: allocator fragmentation, temporary buffers, the CUDA
context and NCCL's own buffers add several GB; kernels reach different
efficiencies per shape; schedules overlap more than this model credits (TP
overlap, PP sends). Use it to compare plans and to find the term that
decides, not to promise a step time.
"""

from __future__ import annotations

import dataclasses

from helpers.frameworks.plan import Cluster, ModelSpec, Plan
from helpers.memory import GB, activation_bytes_model, model_state_bytes
from helpers.model import GPTConfig
from helpers.pipeline.simulate import bubble_formula
from helpers.topology import collective_cost
from helpers.tp.cost import tp_layer_comm_time
from helpers.tp.transformer import tp_comm_bytes

__all__ = ["Term", "Estimate", "estimate", "bytes_per_param", "model_flops_per_step",
           "hardware_flops_per_step", "narayanan_params", "narayanan_flops",
           "narayanan_training_days"]


@dataclasses.dataclass(frozen=True)
class Term:
    """One labelled number of an estimate: bytes or seconds, and where it comes from."""

    name: str
    value: float
    chapter: str
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Estimate:
    plan: Plan
    model: ModelSpec
    cluster: Cluster
    memory: tuple          # Terms, bytes per GPU
    cpu_bytes: float       # offloaded state, per GPU's share of host memory
    comm: tuple            # Terms, bytes each GPU sends per step, name = axis
    comm_time: tuple       # Terms, seconds of each axis's collectives per step
    time: tuple            # Terms, seconds: compute, bubble, exposed communication

    @property
    def memory_total(self) -> float:
        return sum(t.value for t in self.memory)

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.cluster.gpu_memory

    @property
    def step_time(self) -> float:
        return sum(t.value for t in self.time)

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recompute) per second per GPU / peak: Chowdhery et al. 2022, App. B."""
        flops = model_flops_per_step(self.model, self.plan.global_batch_)
        return flops / (self.step_time * self.cluster.world_size * self.cluster.peak_flops)

    def memory_gb(self) -> dict[str, float]:
        return {t.name: t.value / GB for t in self.memory}

    def table(self) -> str:
        """The estimate as printable lines, each term with its chapter."""
        lines = [f"per-GPU memory {self.memory_total / GB:8.1f} GB of "
                 f"{self.cluster.gpu_memory / GB:.0f} GB"
                 + ("" if self.fits else "   DOES NOT FIT")]
        lines += [f"  {t.name:<22}{t.value / GB:8.2f} GB   ch. {t.chapter}"
                  + (f"  ({t.note})" if t.note else "") for t in self.memory]
        if self.cpu_bytes:
            lines.append(f"  {'(offloaded to CPU)':<22}{self.cpu_bytes / GB:8.2f} GB   ch. 14")
        lines.append("bytes sent per GPU per step, and their time")
        times = {t.name: t.value for t in self.comm_time}
        lines += [f"  {t.name:<22}{t.value / GB:8.2f} GB  {times[t.name] * 1e3:9.1f} ms   "
                  f"ch. {t.chapter}" for t in self.comm]
        lines.append(f"step time {self.step_time:8.2f} s   (MFU {self.mfu:.0%})")
        lines += [f"  {t.name:<22}{t.value:8.3f} s    ch. {t.chapter}"
                  + (f"  ({t.note})" if t.note else "") for t in self.time]
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Bytes and FLOPs
# ---------------------------------------------------------------------------

def bytes_per_param(plan: Plan) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter before sharding.

    Mixed precision with Adam (Rajbhandari et al. 2020, sec. 3.1, K = 12): 16-bit
    weights and gradients, fp32 master weights + m + v; gradients kept in fp32
    (Megatron's main_grad) cost 4. FP8 training keeps bf16 weights and runs
    FP8 GEMMs on transient casts (chapter 13), so its state is bf16's. fp32:
    4 + 4 + 8 (no master copy). ``optimizer_grads_fp32``: the optimizer keeps
    an fp32 copy of its gradient shard, 4 more bytes in the sharded part
    (DeepSpeed's ZeRO partitions, Megatron's fp16 optimizer): the bytes the
    paper's K = 12 leaves out and the frameworks' own calculators count.
    ``params_fp32`` (FSDP2): 4-byte weights that are the master copy, so the
    optimizer holds only m and v.
    """
    if plan.precision == "fp32":
        return 4.0, 4.0, 8.0
    if plan.params_fp32:     # the stored fp32 weights are the master copy
        return 4.0, 4.0 if plan.main_grads_fp32 else 2.0, 8.0
    return (2.0, 4.0 if plan.main_grads_fp32 else 2.0,
            12.0 + (4.0 if plan.optimizer_grads_fp32 else 0.0))


def model_flops_per_step(model: ModelSpec, global_batch: int) -> float:
    """Forward + backward FLOPs of one step without recompute: 3 forward passes."""
    return 3 * model.forward_flops_per_token() * model.seq * global_batch


def hardware_flops_per_step(model: ModelSpec, global_batch: int, recompute: str) -> float:
    """What the GPUs execute: full recompute re-runs each layer's forward (Narayanan
    et al. 2021, sec. 5.1: 4 passes for the layers, 3 for the output layer);
    selective re-runs only the attention scores and their product with V
    (Korthikanti et al. 2022, sec. 5: 4 s h FLOPs per token per layer)."""
    tokens = model.seq * global_batch
    extra = 0.0
    if recompute == "full":
        extra = model.forward_flops_per_token() - 2 * model.hidden * model.vocab
    elif recompute == "selective":
        extra = 4 * model.seq * model.hidden * model.layers
    return model_flops_per_step(model, global_batch) + extra * tokens


def narayanan_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Narayanan et al. 2021, sec. 5.1, eq. 2: P = 12 l h^2 (1 + 13/12h + (V + s)/12lh)."""
    l, h = layers, hidden
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * l * h))


def narayanan_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, sec. 5.1, eq. 3 (full recompute):
    F = 96 B s l h^2 (1 + s/6h + V/16lh)."""
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def narayanan_training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Narayanan et al. 2021, sec. 5.1, eq. 4: time ~ 8 T P / (n X) (full recompute)."""
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86400


# ---------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------

def _group(stride: int, size: int) -> list[int]:
    """GPU ids of the group of ``size`` ranks at ``stride`` that contains GPU 0
    (Megatron's order: tp fastest, then cp, then dp, then pp)."""
    return [i * stride for i in range(size)]


def _time(cluster: Cluster, op: str, nbytes: float, ranks: list[int]) -> float:
    if len(ranks) == 1 or nbytes == 0:
        return 0.0
    return collective_cost(cluster.topology, op, nbytes, ranks,
                           "direct" if op == "all_to_all" else "ring").time


def estimate(plan: Plan, model: ModelSpec, cluster: Cluster) -> Estimate:
    """Memory, communication and step time of ``plan`` for ``model`` on ``cluster``."""
    plan.validate(cluster.world_size, model)
    p, m = plan, model
    s_local = m.seq // p.cp                               # tokens of a sequence on one rank
    w_b, g_b, o_b = bytes_per_param(p)

    # -- memory ------------------------------------------------------------
    dense = m.dense_params()
    experts = m.total_params() - dense
    owned_dense = dense / (p.tp * p.pp)
    owned_expert = experts / (p.tp * p.pp * p.ep)
    states = model_state_bytes(owned_dense, dp=p.shard_ranks, zero_stage=p.zero_stage,
                               param_bytes=w_b, grad_bytes=g_b, optimizer_bytes=o_b)
    if owned_expert:
        # experts are replicated over dp x cp / ep ranks, and sharded over those
        e = model_state_bytes(owned_expert, dp=max(1, p.shard_ranks // p.ep),
                              zero_stage=p.zero_stage, param_bytes=w_b, grad_bytes=g_b,
                              optimizer_bytes=o_b)
        states = type(states)(states.params + e.params, states.grads + e.grads,
                              states.optimizer + e.optimizer)
    cpu = 0.0
    weights, grads, optimizer = states.params, states.grads, states.optimizer
    if p.offload != "none":       # ZeRO-Offload: optimizer state (and its fp32 step) on CPU
        cpu += optimizer
        optimizer = 0.0
    if p.offload == "optimizer+params":
        cpu += weights
        weights = 0.0
    grad_note = "fp32 main grads" if g_b == 4 else ""
    memory = [Term("weights", weights, "06, 14"),
              Term("gradients", grads, "06, 14", grad_note),
              Term("optimizer state", optimizer, "06, 14",
                   "fp32 master + Adam m, v" + (", offloaded" if p.offload != "none" else ""))]
    if p.zero_stage == 3:
        layer = m.layer_params() / p.tp * (4 if p.precision == "fp32" else 2)  # compute dtype
        units = 2 if p.overlap_param_gather else 1
        memory.append(Term("gathered layers", units * layer, "15",
                           f"{units} layer(s) all-gathered at a time"))
    act = activation_bytes_model(s_local, p.micro_batch, m.hidden, m.heads, m.layers, tp=p.tp,
                                 pp=p.pp, sequence_parallel=p.sequence_parallel,
                                 recompute=p.recompute, vocab=m.vocab, interleave=p.vpp)
    act *= 2 if p.precision == "fp32" else 1
    memory.append(Term("activations", act, "06, 10, 13",
                       f"Korthikanti Table 2, recompute={p.recompute}"
                       + (", SP" if p.sequence_parallel else "")))

    # -- communication -------------------------------------------------------
    topo = cluster.topology
    layers_here = m.layers // p.pp
    micro = p.grad_accum
    act_bytes = s_local * p.micro_batch * m.hidden * 2    # one layer's 16-bit activation
    comm, comm_time = [], []

    # tensor parallel: chapter 09's count (4 per layer), x 1.5 with full recompute
    rerun = 1.5 if p.recompute == "full" else 1.0
    tp_cfg = GPTConfig(vocab_size=m.vocab, block_size=s_local, n_layer=layers_here,
                       n_head=m.heads, n_embd=m.hidden)
    tp_payload = sum(v for (name, _), v in tp_comm_bytes(tp_cfg, p.micro_batch, s_local, p.tp,
                                                         dtype_bytes=2).items()
                     if name.startswith("blocks."))
    # a ring all-reduce sends 2(t-1)/t of its payload from each rank
    tp_sent = 2 * (p.tp - 1) / p.tp * tp_payload * rerun * micro
    tp_group = _group(1, p.tp)
    n_nodes = len({topo.node_of(g) for g in tp_group})
    link = topo.intra if n_nodes == 1 else topo.inter
    tp_t = (tp_layer_comm_time(m.hidden, s_local * p.micro_batch, p.tp, link)
            * layers_here * rerun * micro) if p.tp > 1 else 0.0
    comm.append(Term("tp", tp_sent, "08, 09"))
    comm_time.append(Term("tp", tp_t, "07, 09"))

    # data parallel (over dp x cp, stride tp): gradients, and weights for sharded optimizers
    dp_group = _group(p.tp, p.dp * p.cp)
    local_params = (owned_dense + owned_expert)
    grad_bytes = local_params * g_b
    if p.zero_stage == 3:
        per_micro = [("all_gather", local_params * w_b), ("all_gather", local_params * w_b),
                     ("reduce_scatter", grad_bytes)]
        dp_ops = [(op, b) for op, b in per_micro for _ in range(micro)]
    elif p.zero_stage == 0:
        dp_ops = [("all_reduce", grad_bytes)]
    else:  # stage 1/2, distributed optimizer: reduce-scatter grads, all-gather updated weights
        dp_ops = [("reduce_scatter", grad_bytes), ("all_gather", local_params * w_b)]
    n = len(dp_group)
    share = (n - 1) / n
    dp_sent = sum((2 if op == "all_reduce" else 1) * share * b for op, b in dp_ops)
    dp_t = sum(_time(cluster, op, b, dp_group) for op, b in dp_ops)
    comm.append(Term("dp", dp_sent, "02, 14, 15"))
    comm_time.append(Term("dp", dp_t, "03, 07"))

    # pipeline: activation forward + gradient backward per micro-batch per chunk
    pp_msg = act_bytes / (p.tp if p.sequence_parallel else 1)
    pp_sent = 2 * micro * p.vpp * pp_msg if p.pp > 1 else 0.0
    stage_stride = p.tp * p.cp * p.dp
    pp_link = topo.intra if stage_stride * p.pp <= topo.gpus_per_node else topo.inter
    pp_hop = pp_link.time(pp_msg) if p.pp > 1 else 0.0
    comm.append(Term("pp", pp_sent, "11, 12"))
    comm_time.append(Term("pp", 2 * micro * p.vpp * pp_hop, "07, 11"))

    # context parallel: K and V blocks round the ring
    kv = 2 * s_local * p.micro_batch * m.hidden * m.kv_heads_ // m.heads * 2
    cp_sent = (p.cp - 1) * kv * 3 * layers_here * micro if p.cp > 1 else 0.0
    cp_group = _group(p.tp, p.cp)
    cp_link = topo.intra if len({topo.node_of(g) for g in cp_group}) == 1 else topo.inter
    comm.append(Term("cp", cp_sent, "10"))
    comm_time.append(Term("cp", cp_sent / cp_link.bandwidth if p.cp > 1 else 0.0, "07, 10"))

    # expert parallel: 4 all-to-alls of the routed tokens per MoE layer per micro-batch
    ep_bytes = s_local * p.micro_batch * m.top_k * m.hidden * 2
    ep_group = _group(p.tp, p.ep)
    ep_n = 4 * layers_here * micro if (m.experts and p.ep > 1) else 0
    comm.append(Term("ep", ep_n * (p.ep - 1) / p.ep * ep_bytes, "21"))
    comm_time.append(Term("ep", ep_n * _time(cluster, "all_to_all", ep_bytes, ep_group), "07, 21"))

    # -- step time -------------------------------------------------------------
    achieved = cluster.peak_flops * cluster.matmul_efficiency
    flops = hardware_flops_per_step(m, p.global_batch_, p.recompute)
    compute = flops / (cluster.world_size * achieved)
    f = bubble_formula(p.pp, micro, p.vpp)
    bubble = compute * f / (1 - f)
    per_micro = compute / micro                  # one micro-batch's forward + backward
    backward = per_micro * 2 / 3                 # t_b = 2 t_f (chapter 12's convention)
    if p.zero_stage == 3:
        exposed_dp = dp_t - (min(dp_t, compute) if p.overlap_param_gather and
                             p.overlap_grad_reduce else 0.0)
    else:
        hidden_by = (backward if p.overlap_grad_reduce else 0.0)
        reduce_t = _time(cluster, dp_ops[0][0], dp_ops[0][1], dp_group)
        gather_t = dp_t - reduce_t
        exposed_dp = max(0.0, reduce_t - hidden_by) + \
            max(0.0, gather_t - (per_micro / 3 if p.overlap_param_gather else 0.0))
    time = [Term("compute", compute, "01, 09, 13",
                 f"{flops / 1e15:,.0f} PFLOP at {cluster.matmul_efficiency:.0%} of peak"),
            Term("pipeline bubble", bubble, "12", f"(p-1)/(v m) with m={micro}, v={p.vpp}"),
            Term("tp (exposed)", tp_t, "09", "between matmuls, not overlapped"),
            Term("dp (exposed)", exposed_dp, "16",
                 "overlapped with backward" if p.overlap_grad_reduce else "not overlapped"),
            Term("pp (exposed)", 2 * (p.pp - 1) * p.vpp * pp_hop, "11",
                 "fill and drain hops only"),
            Term("ep (exposed)", comm_time[-1].value, "21")]
    return Estimate(p, m, cluster, tuple(memory), cpu, tuple(comm), tuple(comm_time), tuple(time))
