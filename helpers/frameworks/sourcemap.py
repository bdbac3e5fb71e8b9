"""Where each mechanism lives in Megatron-LM, DeepSpeed and torchtitan, and its course module.

Read a framework by component, not from ``pretrain_gpt.py`` or ``engine.py``
downwards: pick a mechanism you built in this course, open the framework's
file for it, and look for the same few moves (the hook that fires when a
gradient is ready, the bucket, the reduce-scatter, the stash). The paths are
those of the snapshots read for this chapter (Megatron-LM ``main`` and
DeepSpeed ``master``, August 2026); files move between versions, the split
by component stays. torchtitan (``TORCHTITAN_MAP``, version 0.2.2, snapshot of
August 2026) builds every mechanism from PyTorch's own parts (DeviceMesh,
DTensor, FSDP2's ``fully_shard``, ``torch.distributed.pipelining``, DCP), so
its files show those parts composed rather than reimplemented.
"""

from __future__ import annotations

__all__ = ["SOURCE_MAP", "TORCHTITAN_MAP"]

# component -> (Megatron-LM path, DeepSpeed path, course module, chapter notebook)
SOURCE_MAP: dict[str, tuple[str, str, str, str]] = {
    "rank grid / process groups": (
        "megatron/core/parallel_state.py", "deepspeed/runtime/pipe/topology.py",
        "helpers.topology (grid_layout, mesh_groups)", "07_nccl_topology"),
    "data parallel, gradient buckets": (
        "megatron/core/distributed/distributed_data_parallel.py, param_and_grad_buffer.py",
        "deepspeed/runtime/engine.py (allreduce_gradients)", "helpers.ddp",
        "04_ddp_buckets"),
    "sharded optimizer (ZeRO-1/2)": (
        "megatron/core/optimizer/distrib_optimizer.py",
        "deepspeed/runtime/zero/stage_1_and_2.py", "helpers.zero", "14_zero_stages"),
    "sharded weights (ZeRO-3 / FSDP)": (
        "megatron/core/distributed/fsdp/ (Megatron-FSDP)",
        "deepspeed/runtime/zero/stage3.py, partition_parameters.py, "
        "partitioned_param_coordinator.py", "helpers.fsdp", "15_fsdp"),
    "offload": (
        "megatron/core/optimizer/cpu_offloading/",
        "deepspeed/runtime/zero/offload_config.py, deepspeed/ops/adam/ (CPU Adam)",
        "(not built in the course)", "14_zero_stages"),
    "tensor parallel layers, f and g": (
        "megatron/core/tensor_parallel/layers.py, mappings.py, cross_entropy.py",
        "deepspeed/runtime/tensor_parallel/ (AutoTP)", "helpers.tp",
        "08_tensor_parallel_basics"),
    "sequence / context parallel": (
        "megatron/core/tensor_parallel/mappings.py (SP), "
        "megatron/core/extensions/transformer_engine.py (CP attention)",
        "deepspeed/sequence/layer.py (Ulysses all-to-all)", "helpers.sp",
        "10_sequence_parallel"),
    "pipeline schedules and p2p": (
        "megatron/core/pipeline_parallel/schedules.py, p2p_communication.py",
        "deepspeed/runtime/pipe/schedule.py, engine.py, p2p.py", "helpers.pipeline",
        "12_pipeline_schedules"),
    "activation recompute": (
        "megatron/core/transformer/transformer_block.py, megatron/core/tensor_parallel/random.py",
        "deepspeed/runtime/activation_checkpointing/checkpointing.py", "helpers.recompute",
        "13_recompute_and_precision"),
    "precision: loss scaling, FP8": (
        "megatron/core/optimizer/grad_scaler.py, megatron/core/fp8_utils.py",
        "deepspeed/runtime/fp16/loss_scaler.py, deepspeed/runtime/bf16_optimizer.py",
        "helpers.precision", "13_recompute_and_precision"),
    "mixture of experts": (
        "megatron/core/transformer/moe/ (router.py, token_dispatcher.py, experts.py)",
        "deepspeed/moe/ (sharded_moe.py, layer.py)", "helpers.moe", "21_expert_parallelism"),
    "checkpoints": (
        "megatron/core/dist_checkpointing/",
        "deepspeed/checkpoint/ (universal_checkpoint.py), deepspeed/runtime/checkpoint_engine/",
        "helpers.checkpoint", "17_checkpoint_resume"),
}

# component -> torchtitan path (same components as SOURCE_MAP)
TORCHTITAN_MAP: dict[str, str] = {
    "rank grid / process groups": "torchtitan/distributed/parallel_dims.py (ParallelDims: one "
                                  "DeviceMesh, init_device_mesh)",
    "data parallel, gradient buckets": "torchtitan/distributed/fsdp.py (the dp_replicate mesh "
                                       "dimension of FSDP2)",
    "sharded optimizer (ZeRO-1/2)": "(no separate stage: FSDP2 shards the optimizer state "
                                    "with the weights)",
    "sharded weights (ZeRO-3 / FSDP)": "torchtitan/distributed/fsdp.py, "
                                       "torchtitan/models/llama3/parallelize.py (fully_shard)",
    "offload": "torchtitan/distributed/fsdp.py (FSDP2's CPUOffloadPolicy)",
    "tensor parallel layers, f and g": "torchtitan/distributed/tensor_parallel.py, "
                                       "torchtitan/models/llama3/sharding.py (DTensor plans)",
    "sequence / context parallel": "torchtitan/models/llama3/sharding.py (SequenceParallel), "
                                   "torchtitan/distributed/context_parallel/api.py",
    "pipeline schedules and p2p": "torchtitan/distributed/pipeline_parallel.py "
                                  "(torch.distributed.pipelining schedules)",
    "activation recompute": "torchtitan/distributed/activation_checkpoint.py",
    "precision: loss scaling, FP8": "torchtitan/distributed/fsdp.py (MixedPrecisionPolicy), "
                                    "torchtitan/components/quantization/float8.py",
    "mixture of experts": "torchtitan/models/common/moe.py, "
                          "torchtitan/components/optimizer/optimizer.py (expert-bias update)",
    "checkpoints": "torchtitan/components/checkpointer/dcp.py",
}
assert TORCHTITAN_MAP.keys() == SOURCE_MAP.keys()
