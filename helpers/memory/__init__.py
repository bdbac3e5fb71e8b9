"""How many bytes does training hold? Formulas first, then measured.

Model state is 16 bytes per parameter for mixed-precision Adam in the ZeRO
paper's accounting (Rajbhandari et al. 2020, sec. 3.1: 16-bit weights and
gradients, fp32 master + m + v), 18 with fp32 gradients as Megatron-LM keeps
them with bf16 (``BYTES_PER_PARAM_BY_PRECISION``), sharded over data-parallel
ranks by ZeRO's stages; activations (Korthikanti et al. 2022, sec. 4-5, Table 2) are
s*b*h*(34 + 5*a*s/h) bytes per transformer layer, divided by tensor and
sequence parallelism and cut by recompute. Then the same bytes measured:
every tensor autograd keeps for backward, counted by a saved-tensor hook, and
derived by hand for our GPT to the byte (chapter 06).

    formulas     ``model_state_bytes``, ``activation_bytes_per_layer``,
                 ``activation_bytes_model``, ``training_memory`` (per GPU of a
                 layout), ``memory_over_step`` (the budget over one step)
    meter        ``SavedTensorCounter`` (``torch.autograd.graph.saved_tensors_hooks``),
                 ``count_saved_bytes``, ``cuda_peak_bytes`` and ``cuda_memory_views``
                 (allocated, reserved and the driver's view of a GPU)
    accounting   ``explain_saved_bytes``: the counter's total for our GPT,
                 term by term against the paper's
    plots        ``plot_memory_bars``, ``plot_memory_over_step``, ``memory_widget``

How production differs: real runs also pay for temporary buffers (a matmul's
workspace, an all-gather's output), allocator fragmentation, and the CUDA
context (~0.5-1 GB). Our counter sees none of them; on a GPU each shows in a
different view (``meter``'s docstring, torch 2.13): ``torch.cuda.max_memory_allocated``
sees the temporaries (every tensor, rounded up to the allocator's block sizes),
``torch.cuda.memory_reserved`` adds the allocator's cached free blocks
(fragmentation), and only the driver (``torch.cuda.mem_get_info``, ``nvidia-smi``)
sees the CUDA context and buffers allocated outside PyTorch (NCCL's). A memory
snapshot (``torch.cuda.memory._record_memory_history``) records the allocator's
segments and blocks with their stacks: fragmentation yes, the context no.

Bytes are decimal (1 GB = 1e9 bytes), as in the papers we compare against.
"""

from helpers.memory.accounting import ExplainedTerm, explain_saved_bytes
from helpers.memory.formulas import (BYTES_PER_PARAM_BY_PRECISION, GB, GRAD_BUFFERS,
                                     MODEL_PRESETS, OPTIMIZER_STATE, ModelStateBytes,
                                     activation_bytes_model,
                                     activation_bytes_per_layer, memory_over_step,
                                     model_state_bytes, training_memory)
from helpers.memory.meter import (SavedRecord, SavedTensorCounter, count_saved_bytes,
                                  cuda_memory_views, cuda_peak_bytes)
from helpers.memory.plots import memory_widget, plot_memory_bars, plot_memory_over_step

__all__ = ["ModelStateBytes", "model_state_bytes", "GB", "BYTES_PER_PARAM_BY_PRECISION",
           "activation_bytes_per_layer", "activation_bytes_model", "training_memory",
           "MODEL_PRESETS", "SavedRecord", "SavedTensorCounter", "count_saved_bytes",
           "ExplainedTerm", "explain_saved_bytes", "cuda_peak_bytes", "cuda_memory_views",
           "GRAD_BUFFERS", "plot_memory_bars",
           "memory_over_step", "plot_memory_over_step", "memory_widget"]
