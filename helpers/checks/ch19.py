"""Checks for lab 19: translate Megatron-LM flags into a Plan; predict per-GPU memory;
time one collective of a parallel axis as NCCL prices its ring."""

from __future__ import annotations

from helpers.checks import CheckFailed, attempt, passed
from helpers.checks.course_answers import refusing
from helpers.frameworks import Cluster, Plan, estimate, from_megatron
from helpers.frameworks.examples import MODELS
from helpers.memory import GB

__all__ = ["check_translate", "check_per_gpu_memory", "check_ring_time", "TRANSLATE_FIELDS"]

TRANSLATE_FIELDS = ("dp", "tp", "pp", "zero_stage", "sequence_parallel", "recompute",
                    "micro_batch", "grad_accum", "global_batch", "precision",
                    "main_grads_fp32")

# each command line is there for a mistake (check_translate's docstring)
_FLAG_CASES = [
    ({"--tensor-model-parallel-size": 8, "--pipeline-model-parallel-size": 16,
      "--micro-batch-size": 1, "--global-batch-size": 1536, "--sequence-parallel": True,
      "--use-distributed-optimizer": True, "--recompute-granularity": "selective",
      "--bf16": True}, 1024),
    ({"--tensor-model-parallel-size": 2, "--micro-batch-size": 4,
      "--global-batch-size": 64}, 8),
    ({"--pipeline-model-parallel-size": 4, "--micro-batch-size": 2,
      "--global-batch-size": 512, "--recompute-granularity": "full", "--fp16": True}, 64),
    ({"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 3,
      "--micro-batch-size": 1, "--global-batch-size": 48, "--bf16": True}, 24),
    ({}, 4),
]


# the course's own answers to the exercises, switched off while the learner's code runs
_READERS = {"helpers.frameworks.readers.from_megatron": "it is chapter 19's answer to this "
            "exercise: read the flags yourself"}
_ESTIMATORS = {"helpers.frameworks.estimate.estimate": "it is chapter 19's answer to this "
               "exercise: add the terms yourself"}
_RINGS = {f"helpers.costs.network.{name}": "it is the course's network model, the answer to "
          "this exercise: build it yourself"
          for name in ("ring_time", "collective_time", "bus_bandwidth", "ring_latency",
                       "placement", "nic_share", "_ring")}


def _as_args(flags: dict) -> list[str]:
    out = []
    for k, v in flags.items():
        out += [k] if v is True else [k, str(v)]
    return out


def check_translate(learner_fn) -> None:
    """``learner_fn(flags: dict, world_size) -> Plan`` agrees with ``from_megatron`` on
    the fields in TRANSLATE_FIELDS.

    Mistakes it is built to catch: dp = world / tp (the pipeline's GPUs forgotten:
    every case with pp > 1); a batch identity without dp; the precision left at the
    Plan's default bf16 (Megatron without --bf16 / --fp16 trains in fp32: the
    8- and 4-GPU lines); bf16 without fp32 main gradients (Megatron accumulates and
    reduces a bf16 model's gradients in fp32, 6 + 12/d bytes per parameter with the
    distributed optimizer, not 4 + 12/d); main gradients fp32 for fp16 too (the fp16
    optimizer keeps 16-bit gradients and copies them); a pp of 3 on 24 GPUs so that
    a hard-coded power of two fails; a float count (world / (tp x pp) with /) or an
    int where a bool belongs, equal by == but not the type the Plan field holds;
    ``from_megatron`` itself called: switched off while it runs."""
    for flags, world in _FLAG_CASES:
        want = from_megatron(_as_args(flags), world)
        with refusing(exercise="your reader", paths=_READERS):
            got = attempt(learner_fn, dict(flags), world, what="translate")
        if not isinstance(got, Plan):
            raise CheckFailed(f"return a Plan, got {type(got).__name__}")
        for f in TRANSLATE_FIELDS:
            g, w = getattr(got, f), getattr(want, f)
            if type(w) in (int, bool) and type(g) is not type(w):
                # 8.0 == 8 and 1 == True: equal here, wrong in the next cell's arithmetic
                raise CheckFailed(f"flags {flags} on {world} GPUs: {f} should be the "
                                  f"{type(w).__name__} {w!r}, got {type(g).__name__} {g!r}"
                                  + (" (use // for a count of GPUs or micro-batches)"
                                     if isinstance(g, float) else ""))
            if g != w:
                hint = ""
                if f == "dp":
                    hint = " (dp is what the world leaves after tp x pp)"
                elif f == "grad_accum":
                    hint = " (global = micro x accumulation x dp)"
                elif f == "precision":
                    hint = " (--bf16, --fp16, or neither: Megatron then trains in fp32)"
                elif f == "main_grads_fp32":
                    hint = (" (Megatron accumulates and reduces a bf16 model's gradients in "
                            "fp32 by default; an fp16 model keeps 16-bit gradients)")
                raise CheckFailed(f"flags {flags} on {world} GPUs: {f} should be {w!r}, "
                                  f"got {g!r}{hint}")
    passed(f"Megatron flags translated: {', '.join(TRANSLATE_FIELDS)} agree with "
           f"from_megatron on {len(_FLAG_CASES)} command lines")


def _memory_cases():
    gpt3, llama = MODELS["GPT-3 175B"], MODELS["Llama 2 70B"]
    a100 = Cluster.a100(128)
    yield ("GPT-3 175B, tp 8 x pp 16 x dp 8, distributed optimizer, SP, selective",
           Plan(dp=8, tp=8, pp=16, micro_batch=1, grad_accum=192, zero_stage=1,
                main_grads_fp32=True, sequence_parallel=True, recompute="selective"),
           gpt3, a100)
    yield ("GPT-3 175B, same without the distributed optimizer, full recompute",
           Plan(dp=8, tp=8, pp=16, micro_batch=1, grad_accum=192, main_grads_fp32=True,
                sequence_parallel=True, recompute="full"), gpt3, a100)
    yield ("Llama 2 70B, dp 64, ZeRO-2, full recompute",
           Plan(dp=64, micro_batch=1, grad_accum=16, zero_stage=2, recompute="full"),
           llama, Cluster.a100(8))
    yield ("Llama 2 70B, tp 8 x dp 8, ZeRO-1, micro-batch 2, no recompute",
           Plan(dp=8, tp=8, micro_batch=2, grad_accum=8, zero_stage=1,
                sequence_parallel=True), llama, Cluster.a100(8))


def _gpt_layer_activations(plan, model) -> float:
    from helpers.costs import activations
    return activations(model, model.seq, plan.micro_batch, plan.tp, plan.pp,
                       plan.sequence_parallel, plan.recompute, plan.vpp, plan.precision)


def check_per_gpu_memory(learner_fn) -> None:
    """``learner_fn(plan, model) -> bytes`` on the busiest GPU: weights + gradients +
    optimizer state (after tp x pp splitting and ZeRO sharding) + activations.

    Mistakes it is built to catch: the optimizer state or the activations left out;
    the model state not split over tp x pp; 16 bytes per parameter whatever the plan
    (the GPT-3 plans keep fp32 main gradients: 2 + 4 + 12); ZeRO ignored (the ZeRO-1
    and ZeRO-2 plans); Llama 2's layers counted as GPT layers (a 4h GeLU MLP and a
    key/value pair per head instead of SwiGLU 3.5h and 8 key/value heads); chapter 19's
    ``estimate`` itself called: switched off while it runs."""
    for what, plan, model, cluster in _memory_cases():
        est = estimate(plan, model, cluster)
        want = est.memory_total
        with refusing(exercise="your estimate", paths=_ESTIMATORS):
            got = attempt(learner_fn, plan, model, what="per_gpu_memory")
        parts = {t.name: t.value for t in est.memory}
        try:
            got = float(got)
        except (TypeError, ValueError):
            raise CheckFailed(f"{what}: return a number of bytes, got {got!r}") from None
        # same terms summed in another order: float64 rounding only, far below 1e-9
        if abs(got - want) <= 1e-9 * want:
            continue
        hint = ""
        two_byte_grads = want - parts["gradients"] / 2 if plan.main_grads_fp32 else None
        if two_byte_grads is not None and abs(got - two_byte_grads) <= 1e-6 * want:
            hint = (" (gradients counted at 2 bytes: this plan keeps fp32 main gradients, "
                    "4 bytes each; bytes_per_param(plan) has them)")
        elif abs(got - (want - parts["activations"] + _gpt_layer_activations(plan, model))) \
                <= 1e-9 * want and model.gated_mlp:
            hint = (" (the activations counted as GPT layers: this model's MLP is SwiGLU, "
                    "with its own width, and its keys and values have fewer heads: "
                    "own_shapes=True)")
        elif abs(got - (want - parts["optimizer state"])) <= 1e-6 * want:
            hint = " (the optimizer state is missing: fp32 master weights + Adam m and v)"
        elif abs(got - (want - parts["activations"])) <= 1e-6 * want:
            hint = " (the activations are missing)"
        elif got > want:
            hint = " (is the model state split over tp x pp and sharded by the ZeRO stage?)"
        raise CheckFailed(f"{what}: expected {want / GB:,.3f} GB, got {got / GB:,.3f} GB{hint}")
    passed("per-GPU memory predicted for 4 plans (GPT-3 175B, Llama 2 70B) as estimate() does")


# (cluster, collective, MB, group size, stride): each placement is there for a mistake
def _ring_cases():
    from helpers.topology import a100_cluster, h100_cluster, pcie_cluster
    h100, a100, pcie = h100_cluster(4), a100_cluster(3), pcie_cluster(4)
    return [
        (h100, "all_reduce", 64, 8, 1),        # one node: NVLink only, no network step
        (h100, "reduce_scatter", 64, 4, 8),    # one GPU per node (DP over TP 8): one NIC
        (h100, "all_gather", 64, 16, 2),       # 4 GPUs per node: half the node's NICs
        (h100, "all_reduce", 64, 16, 1),       # 2 whole nodes: all 8 NICs, min with NVLink
        (a100, "reduce_scatter", 48, 20, 1),   # 8, 8, 4 GPUs per node: the 4 limit it
        (a100, "all_reduce", 48, 3, 8),        # an odd group, one GPU on each of 3 nodes
        (pcie, "all_gather", 32, 4, 8),        # one NIC per node shared by its 8 GPUs
        (pcie, "all_reduce", 1e-6, 32, 1),     # 1 byte: almost all latency
    ]


def check_ring_time(ring_seconds) -> None:
    """``ring_seconds(topo, collective, nbytes, size, stride)`` -> seconds of one NCCL ring
    collective on the group {0, stride, ..., (size-1) stride}, against
    ``helpers.costs.network.ring_time`` (NCCL's tuning.cc model, one ring per NIC).

    Mistakes it is built to catch (one placement each in ``_ring_cases``): the flat
    ring through one NIC whatever the placement (a packed group owns all the node's
    NICs); every NIC of the node for a strided group (each GPU has 1/g of them, one on
    a DGX, 1/8 on a one-NIC PCIe node); the largest per-node count of an uneven group
    instead of the smallest; the all-reduce's 2(P-1)/P for reduce-scatter and
    all-gather; every ring step charged a network latency (only 2(n-1), or n-1, wait
    for one), or none; ``helpers.costs.network``'s own functions called instead of
    built: switched off while it runs."""
    from helpers.costs.network import ring_time

    for topo, coll, mb, size, stride in _ring_cases():
        nbytes = mb * 1e6
        case = (f"{coll} of {nbytes:,.0f} bytes over {size} GPUs {stride} apart on "
                f"{topo.name}")
        want = ring_time(topo, coll, nbytes, size, stride)
        with refusing(exercise="ring_seconds", paths=_RINGS):
            got = attempt(ring_seconds, topo, coll, nbytes, size, stride, what=case)
        try:
            ok = abs(float(got) - want) <= 1e-9 * want    # the same formula, another order
        except (TypeError, ValueError):
            raise CheckFailed(f"{case}: return seconds as a number, got {got!r}") from None
        if not ok:
            raise CheckFailed(f"{case}: expected {want * 1e3:.4f} ms, got {float(got) * 1e3:.4f} "
                              f"ms. Which GPUs of the group share a node decides the NICs "
                              f"its ring owns (k m / g); only the ring's steps that leave a "
                              f"node wait for a network latency.")
    passed(f"ring time as NCCL prices it on {len(_ring_cases())} placements (one node, strided, "
           f"packed, uneven, odd, one-NIC nodes, latency-bound)")
