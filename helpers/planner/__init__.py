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
    4. memory fits              weights + grads + optimizer (+ ZeRO-3's gathered
                                layers) + activations <= ``memory_fraction`` of
                                the GPU (ch. 06, 13, 14, 15)

The survivors get a step-time estimate, one term per mechanism, each from the
course's per-term cost library ``helpers.costs`` (which chapter 19's
``estimate`` calls too; collectives timed as NCCL's ring on each group's
nodes): compute, the pipeline bubble, and the communication of TP, PP, CP, EP
and DP that the compute does not hide (``cost`` lists each term with its source).

Ranking: by step time, except that layouts within ``tie`` (2 %) of each other
go to the simpler structure (``Layout.complexity``: no EP before EP, no CP
before CP, fewer stages, less TP, lower ZeRO stage): an assumed MFU cannot
resolve a difference of a percent. ``Ranking.explain`` walks one layout term by
term, ``Ranking.decide`` names the term in which one layout pays most over
another, and ``ladder`` plans rung by rung up the course's order (DP, ZeRO-1/2,
ZeRO-3, TP in a node, PP across nodes, CP, EP): the first rung with a feasible
layout is the smallest structure that fits.

Modules
-------
    layouts   ``Layout`` (one candidate) and ``Candidate`` (the verdict on it),
              the term names ``TERMS``, ``MEMORY_TERMS``, ``CHAPTER``
    cost      memory and step time of one layout, term by term
    search    the rules, ``evaluate``, ``structures``, ``plan``, ``rungs``, ``ladder``
    rank      ``Ranking``: the answer, with ``explain``, ``decide``, ``table``

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
This is a model with an assumed MFU, not a measurement. What it leaves out by
default: kernel efficiency that falls with smaller micro-batches or thinner TP
shards (so it likes micro-batch 1 more than practice does). ``plan(...,
gemm_table="h100")`` puts that back for the layers' weight GEMMs, from
throughput measured on one H100 (``helpers.costs.gemm``), and keeps the assumed
MFU for attention's own matmuls and the output layer; memory-bound kernels
(norms, activations, softmax, the optimizer) stay unpriced either way, so the
MFU it gives runs above what a real step reaches. Also left out: an MoE token's k
experts (its activations count one expert's MLP), uneven stages beyond the
embedding/loss rule, schedules other than Megatron's (1F1B and interleaved 1F1B
decide how many micro-batches the first stage holds), communication that
contends with compute or with other axes on the same NIC, the memory real
frameworks lose to buffers and fragmentation (``memory_fraction`` reserves a
share), the value of memory headroom, and stragglers. Real planners (Alpa,
Galvatron, the recipes of Megatron-LM and torchtitan, or a few hundred steps
of each shortlisted layout) search with measured per-operator costs or start
from a published recipe and measure; this one is for seeing *why* a recipe
looks the way it does.
"""

from helpers.frameworks.plan import A100_80GB, GPU, H100_80GB, ModelSpec
from helpers.planner.cost import flops_per_token
from helpers.planner.layouts import CHAPTER, MEMORY_TERMS, TERMS, Candidate, Layout
from helpers.planner.rank import Ranking
from helpers.planner.search import evaluate, ladder, plan, rungs, structures

__all__ = ["ModelSpec", "GPU", "Layout", "Candidate", "Ranking", "plan", "evaluate",
           "flops_per_token", "structures", "H100_80GB", "A100_80GB", "TERMS", "MEMORY_TERMS",
           "CHAPTER", "rungs", "ladder"]
