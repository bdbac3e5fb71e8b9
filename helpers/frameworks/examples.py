"""Three configurations modelled on published runs, with the models and clusters they ran on.

* ``megatron-gpt3-175b``: GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers,
  width 12288, 96 heads, context 2048; vocabulary 51200 as padded by Megatron)
  on 1024 A100s, as in Narayanan et al. 2021, sec. 5.1 (batch 1536).
* ``deepspeed-zero3-llama2-70b``: Llama 2 70B (Touvron et al. 2023, Table 1 and
  sec. 2.2: 80 layers, width 8192, 64 heads, 8 key/value heads, SwiGLU width
  28672, vocabulary 32000, context 4096, 4M-token batches = 1024 sequences)
  with DeepSpeed ZeRO-3 on 64 A100 80GB; the config follows DeepSpeed's
  ZeRO-3 documentation (https://www.deepspeed.ai/docs/config-json/).
* ``torchtitan-llama3-8b``: Llama 3 8B (Dubey et al. 2024, Table 3: 32 layers,
  width 4096, 32 heads, 8 key/value heads, SwiGLU width 14336, vocabulary
  128256; sequence 8192) with torchtitan's FSDP2 x TP on 64 H100s.

``load(name)`` returns (plan, model, cluster) ready for ``estimate``.
"""

from __future__ import annotations

from helpers.frameworks.plan import Cluster, ModelSpec, Plan
from helpers.frameworks.readers import from_deepspeed, from_megatron, from_torchtitan

__all__ = ["EXAMPLES", "MODELS", "load"]

MODELS = {
    "GPT-3 175B": ModelSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048,
                            name="GPT-3 175B"),
    "Llama 2 70B": ModelSpec(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                             gated_mlp=True, vocab=32000, seq=4096, name="Llama 2 70B"),
    "Llama 3 8B": ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                            gated_mlp=True, vocab=128256, seq=8192, name="Llama 3 8B"),
}

# name -> (config file, reader, model, cluster)
EXAMPLES = {
    "megatron-gpt3-175b": ("megatron_gpt3_175b.args", from_megatron, "GPT-3 175B",
                           lambda: Cluster.a100(128)),
    "deepspeed-zero3-llama2-70b": ("deepspeed_zero3_llama2_70b.json", from_deepspeed,
                                   "Llama 2 70B", lambda: Cluster.a100(8)),
    "torchtitan-llama3-8b": ("torchtitan_llama3_8b.toml", from_torchtitan, "Llama 3 8B",
                             lambda: Cluster.h100(8)),
}


def load(name: str) -> tuple[Plan, ModelSpec, Cluster]:
    """(plan read from the shipped config, model, cluster) of one example."""
    from helpers.frameworks import config_path

    if name not in EXAMPLES:
        raise ValueError(f"unknown example {name!r}; choose from {sorted(EXAMPLES)}")
    file, reader, model, cluster = EXAMPLES[name]
    cluster = cluster()
    path = config_path(file)
    if reader is from_megatron:
        with open(path) as f:
            plan = reader(f.read(), cluster.world_size)
    else:
        plan = reader(path, cluster.world_size)
    return plan, MODELS[model], cluster
