"""What a plan costs: per-GPU memory, bytes per step per axis, step time.

``estimate(plan, model, cluster)`` reads a framework's ``Plan`` into the terms
of the course's per-term cost library, ``helpers.costs`` (which chapter 20's
planner calls too, so both chapters print one number for each term); every
term carries the chapter that derived it:

memory (bytes on the busiest GPU, the first pipeline stage)
    weights / gradients / optimizer   ``costs.model_state`` (ch. 06, 14): the
        parameters a GPU owns (1 / (tp pp) of the dense ones, experts also / ep)
        at the plan's bytes per parameter, sharded over ``plan.shard_ranks`` by
        the ZeRO stage; offloaded parts move to ``cpu_bytes``
    gathered unit (stage 3)           ``costs.gathered_layers`` (ch. 15): one layer
        all-gathered, plus the next one prefetched when the gather overlaps
    activations                        ``costs.activations`` (Korthikanti et al.
        2022, Table 2 and sec. 4.2.3; ch. 06, 10, 13) on seq / cp tokens, with TP,
        SP, recompute and interleaving, each layer with the model's own MLP
        (SwiGLU or GeLU, its width) and key/value heads, at most the plan's
        micro-batches per replica (its gradient accumulation) in flight

communication (bytes each GPU sends per step, seconds of its collectives:
``helpers.costs.axes``, each collective on NCCL's ring as ``costs.network``
prices it, on the group's placement in Megatron's rank order)
    tp    4 all-reduces of a layer's activation per layer per micro-batch
          (chapter 09's count; 6 with full recompute, whose re-run forward
          repeats the forward two)
    dp    gradients reduced once per step (all-reduce, or reduce-scatter +
          all-gather of the weights with a sharded optimizer); stage 2
          reduce-scatters every micro-batch's gradients unless ``whole_grads``
          holds them whole until the step's one reduce-scatter (then its
          gradient memory is whole too); stage 3 gathers weights in forward and
          backward and reduce-scatters gradients for every micro-batch (chapter
          14-15); experts over the ranks that share them
    pp    one activation forward, one gradient back per micro-batch per model
          chunk (chapter 11), 1/t of it with sequence parallelism
    cp    K and V all-gathered forward and backward, their gradients
          reduce-scattered, per layer per micro-batch (chapter 10)
    ep    dispatch and combine all-to-alls, forward and backward (chapter 21)

step time
    compute   hardware FLOPs (the weight matmuls as Narayanan et al. 2021, sec.
              5.1, eq. 3 count them: 4 passes over the layers with full recompute,
              3 without; attention's own matmuls as the kernel executes them, a
              fused causal kernel about half the s x s square unless the scores
              are stored: ``costs.compute``) / GPUs /
              (peak x matmul efficiency); with a measured ``gemm_table``, the
              layers' weight GEMMs at the efficiency measured for the plan's
              TP size and micro-batch tokens, the rest (attention's matmuls, the
              output layer) at the cluster's assumed matmul efficiency
    bubble    compute x (p-1) / (v m) (chapter 12's ``bubble_formula``)
    exposed   communication not hidden: TP, PP, CP and EP always; DP beyond what
              overlap hides behind the last micro-batch's backward / the first
              forward, or (ZeRO-3, prefetched) behind the step (chapter 16)

How production differs: allocator fragmentation, temporary buffers, the CUDA
context and NCCL's own buffers add several GB; kernels reach different
efficiencies per shape; schedules overlap more than this model credits (TP
overlap, PP sends, ring attention). Use it to compare plans and to find the
term that decides, not to promise a step time.
"""

from __future__ import annotations

import dataclasses

from helpers import costs
from helpers.costs import hardware_flops_per_step, model_flops_per_step
from helpers.costs.gemm import GemmTable, matmul_efficiency
from helpers.frameworks.plan import Cluster, ModelSpec, Plan
from helpers.memory import GB

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
        flops = model_flops_per_step(self.model, self.plan.sequences_per_step)
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
    """(weights, gradients, optimizer state) bytes per parameter of ``plan`` before
    sharding: ``helpers.costs.bytes_per_param`` of its precision knobs (bf16 mixed
    Adam 2 + 2 + 12; fp32 main grads 4; DeepSpeed's fp32 gradient shard +4; FSDP2's
    fp32 weights as the master copy; fp32 4 + 4 + 8)."""
    return costs.bytes_per_param(plan.precision, main_grads_fp32=plan.main_grads_fp32,
                                 optimizer_grads_fp32=plan.optimizer_grads_fp32,
                                 params_fp32=plan.params_fp32)


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

def estimate(plan: Plan, model: ModelSpec, cluster: Cluster,
             gemm_table: GemmTable | None = None) -> Estimate:
    """Memory, communication and step time of ``plan`` for ``model`` on ``cluster``.

    ``gemm_table`` (``GemmTable.load("h100")``): price the layers' weight GEMMs at
    the efficiency measured for this plan's shapes instead of the cluster's assumed
    ``matmul_efficiency``, which then prices only attention's matmuls and the output
    layer. The table measures GEMMs alone: memory-bound kernels and attention are
    not in it, so the MFU it gives is an upper side of what the plan achieves."""
    plan.validate(cluster.world_size, model)
    p, m, topo = plan, model, cluster.topology
    s_local = m.seq // p.cp                               # tokens of a sequence on one rank
    w_b, g_b, o_b = bytes_per_param(p)
    wire = costs.wire_bytes(p.precision)                  # activations, gathered weights

    # -- memory ------------------------------------------------------------
    weights, grads, optimizer = costs.model_state(m, p.tp * p.pp, p.shard_ranks, p.zero_stage,
                                                  p.ep, (w_b, g_b, o_b),
                                                  p.whole_grads and p.grad_accum > 1)
    cpu = 0.0
    if p.offload != "none":       # ZeRO-Offload: optimizer state (and its fp32 step) on CPU
        cpu += optimizer
        optimizer = 0.0
    if p.offload == "optimizer+params":
        cpu += weights
        weights = 0.0
    grad_note = ", ".join(n for n, on in (
        ("fp32 main grads", g_b == 4),
        ("ZeRO-2 held whole across micro-batches", p.whole_grads and p.grad_accum > 1)) if on)
    memory = [Term("weights", weights, "06, 14"),
              Term("gradients", grads, "06, 14", grad_note),
              Term("optimizer state", optimizer, "06, 14",
                   "fp32 master + Adam m, v" + (", offloaded" if p.offload != "none" else ""))]
    if p.zero_stage == 3:
        units = 2 if p.overlap_param_gather else 1
        memory.append(Term("gathered layers",
                           costs.gathered_layers(m, p.tp, units, p.precision, p.ep),
                           "15", f"{units} layer(s) all-gathered at a time"))
    act = costs.activations(m, s_local, p.micro_batch, p.tp, p.pp, p.sequence_parallel,
                            p.recompute, p.vpp, p.precision, own_shapes=True,
                            micro_batches=p.grad_accum)
    memory.append(Term("activations", act, "06, 10, 13",
                       f"Korthikanti's terms, this model's MLP and K/V, recompute={p.recompute}"
                       + (", SP" if p.sequence_parallel else "")))

    # -- compute ---------------------------------------------------------------
    micro = p.grad_accum
    gemm_eff = None
    if gemm_table is not None:
        if m.experts:
            raise ValueError(f"the measured GEMM table prices dense layers; {m.name} has "
                             f"{m.experts} experts")
        gemm_eff = matmul_efficiency(m, p.tp, s_local * p.micro_batch, gemm_table,
                                     cluster.peak_flops)
    compute = costs.compute_time(m, p.sequences_per_step, p.recompute, cluster.world_size,
                                 cluster.peak_flops * cluster.matmul_efficiency,
                                 None if gemm_eff is None else cluster.peak_flops * gemm_eff)
    bubble = costs.bubble_time(compute, p.pp, micro, p.vpp)

    # -- communication, per axis -------------------------------------------------
    layers = costs.stage_layers(m, p.pp)
    tokens = s_local * p.micro_batch                      # one micro-batch on one CP rank
    axes = {
        "tp": costs.tp_cost(topo, tp=p.tp, tokens=tokens, hidden=m.hidden, layers=layers,
                            micro_batches=micro, recompute=p.recompute, dtype_bytes=wire),
        "dp": costs.dp_cost(m, topo, dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                            zero=p.zero_stage, micro_batches=micro,
                            micro_batch_time=compute / micro, shard=p.shard_ranks,
                            grad_bytes=g_b, weight_bytes=wire,
                            overlap_grad_reduce=p.overlap_grad_reduce,
                            overlap_param_gather=p.overlap_param_gather,
                            whole_grads=p.whole_grads),
        "pp": costs.pp_cost(topo, tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, interleave=p.vpp,
                            tokens=tokens, hidden=m.hidden, micro_batches=micro,
                            sequence_parallel=p.sequence_parallel, dtype_bytes=wire),
        "cp": costs.cp_cost(m, topo, tp=p.tp, cp=p.cp, micro_batch=p.micro_batch,
                            layers=layers, micro_batches=micro, dtype_bytes=wire),
        "ep": costs.ep_cost(m, topo, tp=p.tp, ep=p.ep, tokens=tokens, layers=layers,
                            micro_batches=micro, sequence_parallel=p.sequence_parallel,
                            dtype_bytes=wire),
    }
    sources = {"tp": ("08, 09", "07, 09"), "dp": ("02, 14, 15", "03, 07"),
               "pp": ("11, 12", "07, 11"), "cp": ("10", "07, 10"), "ep": ("21", "07, 21")}
    comm = [Term(a, c.sent, sources[a][0]) for a, c in axes.items()]
    comm_time = [Term(a, c.time, sources[a][1]) for a, c in axes.items()]

    # -- step time -------------------------------------------------------------
    flops = hardware_flops_per_step(m, p.sequences_per_step, p.recompute)
    rate = (f"{cluster.matmul_efficiency:.0%} of peak" if gemm_eff is None else
            f"layer GEMMs {gemm_eff:.0%} of peak (measured), the rest "
            f"{cluster.matmul_efficiency:.0%} (assumed)")
    time = [Term("compute", compute, "01, 09, 13", f"{flops / 1e15:,.0f} PFLOP at {rate}"),
            Term("pipeline bubble", bubble, "12", f"(p-1)/(v m) with m={micro}, v={p.vpp}"),
            Term("tp (exposed)", axes["tp"].exposed, "09", "between matmuls, not overlapped"),
            Term("dp (exposed)", axes["dp"].exposed, "16",
                 "overlapped with backward" if p.overlap_grad_reduce else "not overlapped"),
            Term("pp (exposed)", axes["pp"].exposed, "11", "each hop waits for its receive"),
            Term("cp (exposed)", axes["cp"].exposed, "10", "K, V gathered before attention"),
            Term("ep (exposed)", axes["ep"].exposed, "21")]
    return Estimate(p, m, cluster, tuple(memory), cpu, tuple(comm), tuple(comm_time), tuple(time))
