"""What the planner judges: one parallel layout (``Layout``) and its verdict (``Candidate``).

A ``Layout`` is a way of writing the GPU count as dp x tp x pp x cp (x ep
carved out of dp x cp) with the per-GPU choices (ZeRO stage, recompute,
micro-batch, interleaving), ranks ordered as Megatron-LM's ``parallel_state``
orders them (tp fastest, then cp, then dp, then pp:
``helpers.mesh.MEGATRON_DIMS``). It converts to and from chapter 19's ``Plan``
(``helpers.frameworks.plan``) and orders itself by simplicity, the course's
order of escalation read backwards
(``Layout.complexity``). A ``Candidate`` is the planner's verdict on one
layout: the rule it broke, or its memory and step-time terms, whose names
and teaching chapters are ``MEMORY_TERMS``, ``TERMS`` and ``CHAPTER``.
"""

from __future__ import annotations

import dataclasses

from helpers.frameworks.plan import Plan
from helpers.recompute import RECOMPUTE_MODES
from helpers.validate import positive_int

__all__ = ["MEMORY_TERMS", "TERMS", "CHAPTER", "Layout", "Candidate"]

MEMORY_TERMS = ("weights", "grads", "optimizer", "gathered", "activations")
TERMS = ("compute", "bubble", "tp_comm", "pp_p2p", "cp_comm", "ep_comm", "dp_comm")
# where each term is taught
CHAPTER = {"compute": "01, 13", "bubble": "11-12", "tp_comm": "08-09", "pp_p2p": "11",
           "cp_comm": "10", "ep_comm": "21", "dp_comm": "04, 14-16", "weights": "06, 14",
           "grads": "06, 14", "optimizer": "06, 14", "gathered": "15",
           "activations": "06, 10, 13"}


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def overlap_flags(zero: int) -> dict:
    """What overlaps in every layout the planner builds: gradient reduction with
    the backward, and with any sharded optimizer state the weight all-gather
    with the forward (ZeRO-3's gathers prefetched; ZeRO-1/2's all-gather of the
    updated weights with the next step's forward, as Megatron-Core's distributed
    optimizer does with ``--overlap-param-gather``, a flag that needs
    ``--use-distributed-optimizer``, and FSDP2 with its prefetch)."""
    return {"overlap_grad_reduce": True, "overlap_param_gather": zero >= 1}


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
    # ZeRO-2 only: accumulate whole gradients and reduce-scatter once a step (then its
    # memory and traffic are ZeRO-1's) instead of a reduce-scatter per micro-batch
    whole_grads: bool = False

    def __post_init__(self):
        for f in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "interleave"):
            positive_int(f"Layout.{f}", getattr(self, f))
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero must be the ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.whole_grads, bool):
            raise ValueError(f"Layout.whole_grads must be True or False, got {self.whole_grads!r}")
        if self.whole_grads and self.zero != 2:
            raise ValueError(f"Layout.whole_grads is a ZeRO-2 choice (stages 0 and 1 always hold "
                             f"whole gradients, stage 3 reduce-scatters every micro-batch); "
                             f"got zero={self.zero}")
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
        whole = " (whole grads)" if self.whole_grads else ""
        return (" x ".join(parts)
                + f" | ZeRO-{self.zero}{whole}, {self.recompute}, mb {self.micro_batch}{v}")

    def to_plan(self, global_batch: int, **choices) -> Plan:
        """Chapter 19's ``Plan`` for this layout at ``global_batch`` sequences: the
        degrees, ZeRO stage, recompute and micro-batch carried over, gradient
        accumulation the micro-batches per replica, ZeRO-2's ``whole_grads``, and
        sequence parallelism
        whenever there is TP, gradient reduction overlapped with the backward and
        (ZeRO-1 to 3) the weight all-gather with the forward, as the planner
        assumes (``overlap_flags``). ``choices``:
        other ``Plan`` fields (precision, fp32 gradients, overlap flags); by
        default the planner's bf16 mixed-precision Adam."""
        if global_batch % (self.dp * self.micro_batch):
            raise ValueError(f"global batch {global_batch} is not a multiple of dp x micro-batch "
                             f"= {self.dp} x {self.micro_batch}")
        return Plan(**{"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.interleave,
                       "cp": self.cp, "ep": self.ep, "zero_stage": self.zero,
                       "recompute": self.recompute, "sequence_parallel": self.tp > 1,
                       "micro_batch": self.micro_batch, **overlap_flags(self.zero),
                       "whole_grads": self.whole_grads,
                       "grad_accum": global_batch // (self.dp * self.micro_batch),
                       "global_batch": global_batch, "source": f"planner: {self.short()}",
                       **choices})

    @classmethod
    def from_plan(cls, plan: Plan) -> "Layout":
        """The layout of a chapter-19 ``Plan`` (its other knobs are not the planner's)."""
        return cls(plan.dp, plan.tp, plan.pp, plan.cp, plan.ep, plan.zero_stage, plan.recompute,
                   plan.micro_batch, plan.vpp, plan.whole_grads)

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
    gemm_efficiency: float | None = None   # measured share of peak of its weight GEMMs
    step_time: float = 0.0   # sum of ``time``
    memory_total: float = 0.0  # sum of ``memory``

    def __post_init__(self):
        self.step_time = sum(self.time.values())
        self.memory_total = sum(self.memory.values())

    @property
    def feasible(self) -> bool:
        return not self.reason
