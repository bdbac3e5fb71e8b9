"""The frameworks' own memory figures next to the ZeRO paper's formula.

DeepSpeed ships calculators for model-state memory
(``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``
and ``deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs``;
the ``..._all_cold`` variants only print them for a parameter count).
Megatron-LM's documentation gives bytes per parameter for its distributed
optimizer (Megatron Core user guide, "Distributed Optimizer":
https://docs.nvidia.com/megatron-core/developer-guide/latest/distrib_optimizer.html).
Their numbers differ from Rajbhandari et al. 2020's 16 bytes per parameter,
for reasons that are worth knowing:

* an fp32 gradient. ZeRO's optimizer steps on fp32 partitions, so each rank
  keeps an fp32 copy of its gradient shard: 4 more bytes per parameter in
  the sharded part. The paper's K = 12 (master weights, m, v) leaves it out;
  DeepSpeed's ZeRO-2 figure is 2 + 18/N = 2 (16-bit weights) + (2 16-bit
  gradients + 4 fp32 gradients + 4 master + 8 Adam) / N.
* ZeRO-3 working memory: the layer being computed is gathered whole. DeepSpeed
  adds 4 bytes x the largest layer (its 16-bit weights and gradients), and
  counts 18 / N for the sharded state: the same 18 as stage 2, where the
  complete list (2 weights + 2 + 4 gradients + 12) would be 20: the
  estimator's stage-3 sum leaves one 16-bit shard out.
* Megatron keeps gradients in a buffer the size of the model, in fp32 when
  the model is bf16 (they are accumulated over micro-batches and reduced in
  fp32), and does not shard it: bf16 with the distributed optimizer is
  6 + 12/d bytes, not the paper's stage 1 (4 + 12/d).

``deepspeed_gpu_bytes`` computes DeepSpeed's numbers from the parts above with
``helpers.memory.model_state_bytes``; ``run_deepspeed_estimators`` calls
DeepSpeed's own functions when the optional extra is installed
(``pip install -e ".[frameworks]"``).
"""

from __future__ import annotations

from helpers.memory import model_state_bytes

__all__ = ["paper_gpu_bytes", "deepspeed_gpu_bytes", "run_deepspeed_estimators",
           "MEGATRON_DOCS_BYTES_PER_PARAM", "megatron_bytes_per_param", "deepspeed_available"]


def paper_gpu_bytes(n_params: float, gpus: int, stage: int) -> float:
    """Rajbhandari et al. 2020, sec. 3.1 / Fig. 1: (2 + 2 + 12) Psi, sharded by stage."""
    return model_state_bytes(n_params, dp=gpus, zero_stage=stage).total


def deepspeed_gpu_bytes(n_params: float, gpus: int, stage: int,
                        largest_layer_params: float = 0.0) -> float:
    """DeepSpeed's estimator (no offload), rebuilt from named parts.

    stage 2: 16-bit weights whole, 16-bit + fp32 gradients, master, m, v
    sharded (2 + 18/N). stage 3: the 18/N of stage 2's sharded state plus
    4 bytes per parameter of the largest layer gathered (16-bit weights + grads).
    """
    if stage == 2:
        return model_state_bytes(n_params, dp=gpus, zero_stage=2, param_bytes=2, grad_bytes=2,
                                 optimizer_bytes=16).total
    if stage == 3:
        sharded = model_state_bytes(n_params, dp=gpus, zero_stage=3, param_bytes=0,
                                    grad_bytes=2, optimizer_bytes=16).total
        return sharded + 4 * largest_layer_params
    raise ValueError(f"DeepSpeed ships estimators for stages 2 and 3, not {stage}")


def deepspeed_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


def run_deepspeed_estimators(n_params: int, gpus_per_node: int, nodes: int,
                             largest_layer_params: int) -> dict[int, float]:
    """{stage: GPU bytes} from DeepSpeed's own functions (no offload). Needs the
    ``frameworks`` extra; imports DeepSpeed (several seconds)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu2 = estimate_zero2_model_states_mem_needs(n_params, gpus_per_node, nodes,
                                                    cpu_offload=False)
    _, gpu3, _ = estimate_zero3_model_states_mem_needs(n_params, largest_layer_params,
                                                       gpus_per_node, nodes, cpu_offload=False)
    return {2: float(gpu2), 3: float(gpu3)}


# Megatron Core user guide, "Distributed Optimizer" (URL above): bytes per parameter,
# (param dtype, grad dtype) -> (non-distributed, distributed as (fixed, per-d)).
MEGATRON_DOCS_BYTES_PER_PARAM = {
    ("fp16", "fp16"): (20, (4, 16)),
    ("bf16", "fp32"): (18, (6, 12)),
    ("fp32", "fp32"): (16, (8, 8)),
}


def megatron_bytes_per_param(param: str, grad: str, d: int, distributed: bool) -> float:
    """Megatron's bytes per parameter from its buffers, via ``model_state_bytes``:
    weights and the gradient buffer are never sharded by the distributed optimizer
    (it is ZeRO stage 1); the optimizer holds fp32 master weights (unless the model
    is fp32), Adam's m and v, and for 16-bit gradients an fp32 copy of them."""
    w = 4 if param == "fp32" else 2
    g = 4 if grad == "fp32" else 2
    opt = 8 + (0 if param == "fp32" else 4) + (4 if grad != "fp32" else 0)
    return model_state_bytes(1, dp=d, zero_stage=1 if distributed else 0, param_bytes=w,
                             grad_bytes=g, optimizer_bytes=opt).total
