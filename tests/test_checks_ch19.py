"""Lab 19 checks: pass on the solution, fail on the lab's stub and on plausible mistakes."""

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch19
from helpers.costs import activations
from helpers.frameworks import Plan
from helpers.frameworks.estimate import bytes_per_param
from helpers.memory import activation_bytes_model, model_state_bytes


def _translate_dp_without_pp(flags, world):
    tp = int(flags.get("--tensor-model-parallel-size", 1))
    pp = int(flags.get("--pipeline-model-parallel-size", 1))
    micro = int(flags.get("--micro-batch-size", 1))
    dp = world // tp                                       # wrong: pp also takes GPUs
    glob = int(flags.get("--global-batch-size", micro * dp))
    return Plan(dp=dp, tp=tp, pp=pp, micro_batch=micro, grad_accum=glob // (micro * dp),
                zero_stage=1 if "--use-distributed-optimizer" in flags else 0,
                sequence_parallel="--sequence-parallel" in flags,
                recompute=flags.get("--recompute-granularity", "none"))


def _translate(precision_rule):
    """The right translation but for the number format: ``precision_rule(flags)`` ->
    (precision, main_grads_fp32, loss_scaling)."""
    def translate(flags, world):
        tp = int(flags.get("--tensor-model-parallel-size", 1))
        pp = int(flags.get("--pipeline-model-parallel-size", 1))
        dp = world // (tp * pp)
        micro = int(flags.get("--micro-batch-size", 1))
        glob = int(flags.get("--global-batch-size", micro * dp))
        precision, main_fp32, scaling = precision_rule(flags)
        return Plan(dp=dp, tp=tp, pp=pp, micro_batch=micro, grad_accum=glob // (micro * dp),
                    global_batch=glob,
                    zero_stage=1 if "--use-distributed-optimizer" in flags else 0,
                    sequence_parallel="--sequence-parallel" in flags,
                    recompute=flags.get("--recompute-granularity", "none"),
                    precision=precision, main_grads_fp32=main_fp32, loss_scaling=scaling)
    return translate


def _float_division(flags, world):
    plan = _translate(lambda f: (_fmt(f), _fmt(f) == "bf16", _scaling(f)))(flags, world)
    tp = int(flags.get("--tensor-model-parallel-size", 1))
    pp = int(flags.get("--pipeline-model-parallel-size", 1))
    return plan.replace(dp=world / (tp * pp))


def _fmt(flags):
    return "bf16" if "--bf16" in flags else "fp16" if "--fp16" in flags else "fp32"


def _scaling(flags):
    return "dynamic" if "--fp16" in flags else None


def _memory_16_bytes(plan, model):   # 2 + 2 + 12 whatever the plan's precision
    states = model_state_bytes(model.total_params() / (plan.tp * plan.pp),
                               dp=plan.shard_ranks, zero_stage=plan.zero_stage).total
    act = activations(model, model.seq, plan.micro_batch, plan.tp, plan.pp,
                      plan.sequence_parallel, plan.recompute, plan.vpp, plan.precision,
                      own_shapes=True)
    return states + act


def _memory_gpt_layers(plan, model):   # every layer counted as a GPT layer
    w, g, o = bytes_per_param(plan)
    states = model_state_bytes(model.total_params() / (plan.tp * plan.pp),
                               dp=plan.shard_ranks, zero_stage=plan.zero_stage,
                               param_bytes=w, grad_bytes=g, optimizer_bytes=o).total
    act = activation_bytes_model(model.seq, plan.micro_batch, model.hidden, model.heads,
                                 model.layers, tp=plan.tp, pp=plan.pp,
                                 sequence_parallel=plan.sequence_parallel,
                                 recompute=plan.recompute, vocab=model.vocab)
    return states + act


def _ring(nics="share", counts="min", factor="right", latency="split"):
    """The ring model with one deliberate mistake (the keyword names it)."""
    def ring_seconds(topo, collective, nbytes, size, stride=1):
        if size == 1 or nbytes == 0:
            return 0.0
        per_node = {}
        for i in range(size):
            per_node[i * stride // topo.gpus_per_node] = per_node.get(
                i * stride // topo.gpus_per_node, 0) + 1
        n = len(per_node)
        m = min(per_node.values()) if counts == "min" else max(per_node.values())
        steps = 2 * (size - 1) if collective == "all_reduce" else size - 1
        inter = 2 * (n - 1) if collective == "all_reduce" else n - 1
        if latency == "split":
            lat = (steps - inter) * topo.intra.latency + inter * topo.inter.latency
        elif latency == "all network":
            lat = steps * (topo.inter.latency if n > 1 else topo.intra.latency)
        else:
            lat = 0.0
        if n == 1:
            busbw = topo.intra.bandwidth
        else:
            share = {"share": topo.nics_per_node * m / topo.gpus_per_node, "one": 1,
                     "all": topo.nics_per_node}[nics]
            bw = topo.inter.bandwidth * share
            busbw = bw if max(per_node.values()) == 1 else min(topo.intra.bandwidth, bw)
        f = steps / size if factor == "right" else 2 * (size - 1) / size
        return lat + f * nbytes / busbw
    return ring_seconds


def _memory(forget_optimizer=False, forget_activations=False):
    def per_gpu_memory(plan, model):
        w, g, o = bytes_per_param(plan)
        states = model_state_bytes(model.total_params() / (plan.tp * plan.pp),
                                   dp=plan.shard_ranks, zero_stage=plan.zero_stage,
                                   param_bytes=w, grad_bytes=g,
                                   optimizer_bytes=0 if forget_optimizer else o).total
        act = activations(model, model.seq, plan.micro_batch, plan.tp, plan.pp,
                          plan.sequence_parallel, plan.recompute, plan.vpp, plan.precision,
                          own_shapes=True)
        return states + (0 if forget_activations else act)
    return per_gpu_memory


def _unsplit(plan, model):  # as if TP and PP did not divide the model
    return _memory()(plan.replace(tp=1, pp=1, dp=plan.dp, sequence_parallel=False), model)


def _via_from_megatron(flags, world):   # chapter 19's reader, one call
    from helpers.frameworks import from_megatron
    args = []
    for k, v in flags.items():
        args += [k] if v is True else [k, str(v)]
    return from_megatron(args, world)


def _via_estimate(plan, model):   # chapter 19's estimate on a cluster of the right size
    from helpers.frameworks import Cluster, estimate
    world = plan.dp * plan.tp * plan.pp * plan.cp
    return estimate(plan, model, Cluster.a100(world // 8)).memory_total


def _via_ring_time(topo, collective, nbytes, size, stride=1):   # the course's own model
    from helpers.costs.network import ring_time
    return ring_time(topo, collective, nbytes, size, stride)


class TestChapter19(ChapterChecks):
    lab, sol = "labs/19_frameworks_lab.ipynb", "solutions/19_frameworks_solution.ipynb"
    checks = {
        "translate": Check(ch19.check_translate),
        "per_gpu_memory": Check(ch19.check_per_gpu_memory),
        "ring_time": Check(ch19.check_ring_time, "ring_seconds"),
    }
    wrong = [
        Wrong("translate", _translate_dp_without_pp, "dp forgets the pipeline's GPUs",
              says="dp should be 8, got 128"),
        Wrong("translate", _float_division, "dp with / (a float)", says="use //"),
        Wrong("translate", _translate(lambda f: ("bf16", True, None)),
              "precision left at the Plan's default", says="precision should be 'fp32'"),
        Wrong("translate", _translate(lambda f: (_fmt(f), False, _scaling(f))),
              "bf16 gradients in bf16 (4 + 12/d)", says="main_grads_fp32 should be True"),
        Wrong("translate", _translate(lambda f: (_fmt(f), _fmt(f) != "fp32", _scaling(f))),
              "fp32 main gradients for fp16 too", says="main_grads_fp32 should be False"),
        Wrong("per_gpu_memory", _memory_gpt_layers, "a GPT layer's activations for Llama 2",
              says="SwiGLU"),
        Wrong("per_gpu_memory", _memory_16_bytes, "16 bytes per parameter whatever the plan",
              says="gradients counted at 2 bytes"),
        Wrong("ring_time", _ring(nics="one"), "flat ring through one NIC",
              says="over 16 GPUs 2 apart"),
        Wrong("ring_time", _ring(nics="all"), "every NIC of the node for any group",
              says="over 4 GPUs 8 apart"),
        Wrong("ring_time", _ring(counts="max"), "most GPUs per node of an uneven group",
              says="over 20 GPUs 1 apart"),
        Wrong("ring_time", _ring(factor="all-reduce's"), "2(P-1)/P for every collective",
              says="reduce_scatter"),
        Wrong("ring_time", _ring(latency="all network"), "every step a network latency",
              says="expected .* ms"),
        Wrong("ring_time", _ring(latency="none"), "no latency", says="expected .* ms"),
        Wrong("ring_time", lambda *a: None, "returns None", says="a number"),
        Wrong("per_gpu_memory", _memory(forget_optimizer=True), "forgets the optimizer state",
              says="optimizer state is missing"),
        Wrong("per_gpu_memory", _memory(forget_activations=True), "forgets the activations",
              says="activations are missing"),
        Wrong("per_gpu_memory", _unsplit, "no model-parallel split", says="expected"),
        Wrong("translate", _via_from_megatron, "from_megatron called",
              says="switched off in this check"),
        Wrong("per_gpu_memory", _via_estimate, "estimate called",
              says="switched off in this check"),
        Wrong("ring_time", _via_ring_time, "helpers.costs.network.ring_time called",
              says="switched off in this check"),
    ]
    right = [
        Right("per_gpu_memory", _memory(), "the reference shape of the answer"),
        Right("ring_time", _ring(), "the mistake-free version of the table's ring"),
    ]
