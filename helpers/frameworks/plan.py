"""A training job as one bundle of choices: ``Plan``, ``ModelSpec``, ``Cluster``.

Megatron-LM, DeepSpeed and torchtitan look different (command-line flags, a
JSON file, a TOML file) but every one of them answers the same questions,
each of which an earlier chapter taught:

    how are the GPUs split?       dp x tp x pp (x cp), ep inside dp x cp     ch. 02, 08-12, 10, 21
    who keeps which state?        ZeRO stage / distributed optimizer, offload ch. 14-15
    in which number format?       bf16, fp16 with loss scaling, fp8           ch. 13
    what is kept for backward?    recompute none / selective / full, SP      ch. 10, 13
    how big is a step?            micro-batch x accumulation x dp = global   ch. 05
    what runs at the same time?   overlap of gradient reduce / param gather  ch. 16
    how is it saved?              checkpoint format                          ch. 17

``Plan`` holds those answers and nothing framework-specific; the readers in
``helpers.frameworks.readers`` fill one from each framework's configuration,
and ``helpers.frameworks.estimate`` turns a plan, a model and a cluster into
memory, communication and time. ``Plan.validate`` applies the rules every
framework checks at start-up (the degrees multiply to the world size, the
batch identity holds, layers / heads / experts / sequence divide) and names
the rule a plan breaks, before any GPU is touched.

Rank order. The degrees multiply in Megatron-LM's order, tensor-parallel
fastest (tp, then cp, then dp, then pp: ``RankGenerator`` in
megatron/core/parallel_state.py; ``helpers.mesh.MEGATRON_DIMS``, the course's
one rank-order rule), so a TP group is consecutive GPUs (inside a
node, chapter 09), a DP group is strided by tp * cp, and PP is the slowest
axis. Expert parallelism does not add GPUs: it splits the dp * cp ranks that
hold the same layer (Megatron-Core's expert-data-parallel group; torchtitan
borrows it from dp_shard * cp the same way).

How production differs: each framework has hundreds more knobs (kernels,
fused optimizers, logging, data loading). The readers keep every knob they do
not map in ``Plan.unmapped``, with the reason, so nothing is silently dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from helpers.modelspec import ModelSpec
from helpers.recompute import RECOMPUTE_MODES
from helpers.topology import A100_80GB, GPU, H100_80GB, Topology, a100_cluster, h100_cluster
from helpers.validate import int_at_least, positive_int

__all__ = ["Plan", "ModelSpec", "GPU", "Cluster", "H100_80GB", "A100_80GB", "PLAN_PRECISIONS",
           "OFFLOADS"]

PLAN_PRECISIONS = ("bf16", "fp16", "fp8", "fp32")  # the number formats a Plan may train in
OFFLOADS = ("none", "optimizer", "optimizer+params")




# GPU, H100_80GB, A100_80GB: chapter 07's hardware table (helpers.topology.gpus), re-exported.


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Chapter 07's ``Topology`` plus what a GPU holds and computes.

    ``gpu_memory`` in bytes (decimal GB, as the papers), ``peak_flops`` the
    dense 16-bit Tensor Core peak, ``matmul_efficiency`` the fraction of it the
    matmuls reach (chapter 09's cost model uses one half; published runs reach
    0.4-0.55 end to end: Narayanan et al. 2021, Table 1; Dubey et al. 2024,
    Table 4).
    """

    topology: Topology
    gpu_memory: float
    peak_flops: float
    matmul_efficiency: float = 0.5
    name: str = ""
    gpu_name: str = ""

    def __post_init__(self):
        if not isinstance(self.topology, Topology):
            raise TypeError(f"Cluster.topology must be a Topology, got "
                            f"{type(self.topology).__name__}")
        if not self.gpu_memory > 0 or not self.peak_flops > 0:
            raise ValueError("gpu_memory and peak_flops must be positive")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency must be in (0, 1], got "
                             f"{self.matmul_efficiency}")

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def gpu(self) -> GPU:
        """The cluster's GPU type (what the planner takes)."""
        return GPU(self.gpu_name or self.name, self.gpu_memory, self.peak_flops)

    @classmethod
    def of(cls, gpu: GPU, topology: Topology, matmul_efficiency: float = 0.5,
           name: str = "") -> "Cluster":
        """``topology.world_size`` GPUs of type ``gpu``."""
        return cls(topology, gpu.memory, gpu.peak_flops, matmul_efficiency,
                   name or f"{topology.world_size} x {gpu.name}", gpu.name)

    @classmethod
    def h100(cls, nodes: int, **kw) -> "Cluster":
        """DGX H100 nodes: ``H100_80GB`` on chapter 07's ``h100_cluster``."""
        return cls.of(H100_80GB, h100_cluster(nodes), name=f"{nodes} x 8 H100 80GB", **kw)

    @classmethod
    def a100(cls, nodes: int, **kw) -> "Cluster":
        """DGX A100 nodes: ``A100_80GB`` on chapter 07's ``a100_cluster``."""
        return cls.of(A100_80GB, a100_cluster(nodes), name=f"{nodes} x 8 A100 80GB", **kw)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every choice of a training job that an earlier chapter teaches.

    Degrees: ``dp`` data-parallel replicas, ``tp`` tensor-parallel, ``pp``
    pipeline stages, ``vpp`` model chunks per pipeline rank (interleaved 1F1B,
    1 = plain), ``cp`` context-parallel, ``ep`` expert-parallel (splits
    dp * cp, adds no GPUs). ``zero_stage``: 0 plain DP, 1 optimizer state
    sharded (Megatron's distributed optimizer is stage 1), 2 + gradients, 3 +
    weights (FSDP's full sharding), over ``dp_shard`` * cp ranks (``dp_shard``
    defaults to dp; smaller for hybrid sharding, HSDP, which replicates the
    shards dp / dp_shard times).
    ``whole_grads`` (ZeRO-2 only): the step's micro-batches accumulate whole
    gradients, reduce-scattered once at its end (FSDP with
    ``set_requires_gradient_sync(False)`` on all but the last micro-batch, as torch
    2.13's pipelining runs it), instead of a reduce-scatter after every micro-batch
    that keeps only the shard (DeepSpeed's ZeRO-2); see ``helpers.costs.axes``.
    ``main_grads_fp32``: gradients accumulated and reduced in fp32 (Megatron's
    default with bf16). ``optimizer_grads_fp32``: the optimizer keeps an fp32
    copy of its gradient shard (DeepSpeed ZeRO, Megatron's fp16 optimizer).
    ``params_fp32``: weights stored in fp32 and cast to 16 bits for each use
    (FSDP2's mixed precision): they are the master copy, no second one.
    ``offload``: state moved to CPU memory.
    ``loss_scaling``: "dynamic" or "static" (fp16 only). ``recompute``: none,
    selective (attention scores) or full (keep each layer's input).
    ``sequence_parallel``: Megatron SP inside the TP group.
    ``micro_batch`` x ``grad_accum`` x ``dp`` = ``global_batch`` sequences.
    ``unmapped``: (knob, value, why) for each knob a reader did not map.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    zero_stage: int = 0
    dp_shard: Optional[int] = None
    main_grads_fp32: bool = False
    optimizer_grads_fp32: bool = False
    params_fp32: bool = False
    offload: str = "none"
    precision: str = "bf16"
    loss_scaling: Optional[str] = None
    recompute: str = "none"
    sequence_parallel: bool = False
    micro_batch: int = 1
    grad_accum: int = 1
    global_batch: Optional[int] = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    whole_grads: bool = False
    checkpoint_format: str = "torch"
    source: str = ""
    unmapped: tuple = ()

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks the ZeRO / FSDP state is sharded over: dp_shard (default dp) x cp."""
        return (self.dp_shard or self.dp) * self.cp

    @property
    def sequences_per_step(self) -> int:
        """The global batch in sequences: ``global_batch``, or micro_batch x grad_accum x dp
        when not given."""
        return self.global_batch or self.micro_batch * self.grad_accum * self.dp

    def replace(self, **changes) -> "Plan":
        return dataclasses.replace(self, **changes)

    def validate(self, world_size: int, model: ModelSpec | None = None) -> "Plan":
        """Raise ValueError naming the first rule this plan breaks; return the plan."""
        for f in ("dp", "tp", "pp", "vpp", "cp", "ep", "micro_batch", "grad_accum"):
            positive_int(f, getattr(self, f))
        positive_int("world_size", world_size)
        if self.dp_shard is not None:
            positive_int("dp_shard", self.dp_shard)
            if self.dp % self.dp_shard:
                raise ValueError(f"hybrid sharding replicates shards of dp_shard ranks: "
                                 f"dp_shard={self.dp_shard} does not divide dp={self.dp}")
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.whole_grads and self.zero_stage != 2:
            raise ValueError("whole_grads is a ZeRO-2 choice: stages 0 and 1 always hold whole "
                             "gradients, and stage 3 reduce-scatters every micro-batch; set "
                             f"zero_stage=2 or whole_grads=False (zero_stage={self.zero_stage})")
        if self.precision not in PLAN_PRECISIONS:
            raise ValueError(f"precision must be one of {PLAN_PRECISIONS}, got "
                             f"{self.precision!r}")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {OFFLOADS}, got {self.offload!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got "
                             f"{self.recompute!r}")
        if self.world_size != world_size:
            raise ValueError(
                f"degrees must multiply to the world size: dp {self.dp} x tp {self.tp} x "
                f"pp {self.pp} x cp {self.cp} = {self.world_size}, not {world_size} GPUs")
        if self.global_batch is not None and \
                self.global_batch != self.micro_batch * self.grad_accum * self.dp:
            raise ValueError(
                f"global batch = micro-batch x accumulation x dp: {self.micro_batch} x "
                f"{self.grad_accum} x {self.dp} = "
                f"{self.micro_batch * self.grad_accum * self.dp}, not {self.global_batch}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"expert parallelism splits the dp x cp = {self.dp * self.cp} "
                             f"ranks that hold the same layer: ep={self.ep} does not divide it")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("virtual pipeline stages (interleaving) need pp > 1")
        if self.precision == "fp16" and self.loss_scaling is None:
            raise ValueError("fp16 needs loss scaling (its gradients underflow without it, "
                             "chapter 13): set loss_scaling='dynamic' or 'static'")
        if self.precision != "fp16" and self.loss_scaling is not None:
            raise ValueError(f"loss scaling is for fp16 only; precision is {self.precision}")
        if self.offload == "optimizer+params" and self.zero_stage != 3:
            raise ValueError("offloading parameters needs ZeRO stage 3 (only sharded "
                             "parameters can live on the CPU between uses)")
        if self.offload != "none" and self.zero_stage == 0:
            raise ValueError("offload moves the sharded optimizer state: it needs ZeRO stage "
                             ">= 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism splits along the TP group: it needs tp > 1")
        if model is not None:
            self._validate_model(model)
        return self

    def _validate_model(self, m: ModelSpec) -> None:
        if m.layers % (self.pp * self.vpp):
            raise ValueError(f"{m.layers} layers do not split over pp {self.pp} x "
                             f"vpp {self.vpp} = {self.pp * self.vpp} model chunks")
        if m.heads % self.tp:
            raise ValueError(f"{m.heads} heads do not divide over tensor-parallel size "
                             f"{self.tp}")
        if m.n_kv_heads % self.tp and self.tp % m.n_kv_heads:
            raise ValueError(f"{m.n_kv_heads} key/value heads neither divide over nor "
                             f"replicate onto tensor-parallel size {self.tp}")
        if self.ep > 1 and not m.experts:
            raise ValueError(f"ep={self.ep} but the model has no experts")
        if m.experts and m.experts % self.ep:
            raise ValueError(f"{m.experts} experts do not divide over expert-parallel size "
                             f"{self.ep}")
        if self.cp > 1 and m.seq % (2 * self.cp):
            raise ValueError(f"causal context parallelism cuts the sequence into 2 x cp = "
                             f"{2 * self.cp} chunks (one early, one late per rank, for "
                             f"balance): seq={m.seq} is not divisible by {2 * self.cp}")
        if self.sequence_parallel and (m.seq // self.cp) % self.tp:
            raise ValueError(f"sequence parallelism splits each rank's {m.seq // self.cp} "
                             f"tokens over tp={self.tp}: not divisible")
