"""Memory formulas: model-state bytes (ZeRO) and activation bytes (Korthikanti et al.).

Model state (Rajbhandari et al. 2020, "ZeRO", sec. 3.1): mixed-precision
training with Adam keeps, per parameter,

    2 bytes   bf16/fp16 weights used in forward and backward
    2 bytes   bf16/fp16 gradients
    12 bytes  optimizer state: fp32 master weights (4) + Adam m (4) + v (4)
    --------
    16 bytes  ("K = 12" in the paper's notation)

so a 70B-parameter model needs 70e9 * 16 = 1,120 GB before one activation is
stored: fourteen 80 GB GPUs. ZeRO shards these three parts over N_d
data-parallel ranks, one more part per stage:

    stage 0 (DP)   (2 + 2 + 12) * Psi
    stage 1        2 Psi + 2 Psi + 12 Psi / N_d      (optimizer state sharded)
    stage 2        2 Psi + (2 + 12) Psi / N_d        (+ gradients)
    stage 3        (2 + 2 + 12) Psi / N_d            (+ weights)

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", sec. 4 and Table 2): one transformer layer with
16-bit activations and 1-byte dropout masks saves, for backward,

    s*b*h*(34 + 5*a*s/h) bytes        s sequence, b micro-batch, h hidden, a heads

34 sbh is everything that grows like the hidden size (layer-norm inputs, the
Q/K/V and projection inputs, the 4h MLP tensors, the dropout masks); 5 a s^2 b
is attention's score-sized tensors (softmax output, its dropout mask, the
dropped-out probabilities). Tensor parallelism (t ranks) divides the 24 sbh and
the 5 a s^2 b that live inside the parallel region; sequence parallelism
divides the remaining 10 sbh too; selective recompute drops the 5 a s^2 b;
full recompute keeps only the layer input, 2 sbh, or 2 sbh/t with sequence
parallelism, where that input is already split along the sequence (a deviation
from Table 2, explained in ``activation_bytes_per_layer``).

``training_memory`` adds the two for one GPU of a parallel layout (model state
split over tp x pp, then ZeRO over dp), and ``memory_over_step`` spreads that
budget over one training step: the parts are not all alive at once.

Bytes are decimal (1 GB = 1e9 bytes), as in the papers we compare against.
"""

from __future__ import annotations

import dataclasses

from helpers.recompute import RECOMPUTE_MODES
from helpers.validate import is_int, positive_int

__all__ = ["GB", "ModelStateBytes", "model_state_bytes",
           "activation_bytes_per_layer", "activation_bytes_model", "MODEL_PRESETS",
           "BYTES_PER_PARAM_BY_PRECISION", "OPTIMIZER_STATE", "training_memory", "memory_over_step",
           "GRAD_BUFFERS"]

GB = 1e9  # decimal gigabyte, as in the ZeRO and Megatron papers


@dataclasses.dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank bytes of each part of the model state."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def in_gb(self) -> dict[str, float]:
        return {k: v / GB for k, v in (("params", self.params), ("grads", self.grads),
                                      ("optimizer", self.optimizer), ("total", self.total))}


def model_state_bytes(n_params: float, *, dp: int = 1, zero_stage: int = 0,
                      param_bytes: float = 2, grad_bytes: float = 2,
                      optimizer_bytes: float = 12) -> ModelStateBytes:
    """Per-rank bytes of weights, gradients and optimizer state.

    Defaults are ZeRO's accounting of mixed-precision Adam (Rajbhandari et al.
    2020, sec. 3.1, written for fp16): 2-byte weights + 2-byte gradients + 12
    bytes of fp32 master weights, m and v = 16 bytes per parameter (K = 12).
    With bf16 weights Megatron accumulates and reduces gradients in fp32: 2 + 4
    + 12 = 18 bytes (``grad_bytes=4``; "float16 param, fp32 grads: 18" in
    Megatron-LM's ``docs/source/api-guide/dist_optimizer.md`` at commit 50b073c), which
    ``BYTES_PER_PARAM_BY_PRECISION["bf16, fp32 grads"]`` names.
    ``zero_stage`` 1/2/3 divides the optimizer / + gradients / + weights by ``dp``.
    """
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    positive_int("dp (data-parallel ranks)", dp)
    # bool is an int in Python (True == 1): refuse it rather than read True as stage 1
    if not is_int(zero_stage) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be the int 0, 1, 2 or 3, got {zero_stage!r}")
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    shard = lambda stage: dp if zero_stage >= stage else 1  # noqa: E731
    return ModelStateBytes(params=n_params * param_bytes / shard(3),
                           grads=n_params * grad_bytes / shard(2),
                           optimizer=n_params * optimizer_bytes / shard(1))


# ---------------------------------------------------------------------------
# Activations: Korthikanti et al. 2022
# ---------------------------------------------------------------------------


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, *, tp: int = 1,
                               sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2).

    16-bit activations, 1-byte dropout masks, s = seq, b = batch (micro-batch),
    h = hidden, a = heads, t = tp:

        no parallelism               sbh (34 + 5as/h)                 sec. 4.1
        tensor parallel              sbh (10 + 24/t + 5as/(ht))       sec. 4.2.1
        tensor + sequence parallel   sbh/t (34 + 5as/h)               sec. 4.2.2
        TP + selective recompute     sbh (10 + 24/t)                  sec. 5
        TP + SP + selective          sbh/t * 34                       sec. 5
        full recompute               2 sbh (the layer input only)     sec. 5
        full recompute + SP          2 sbh / t    (ours, not Table 2: see below)

    The "10 sbh" outside the tensor-parallel region are the two LayerNorm
    inputs (4 sbh), the two residual dropout masks (2 sbh) and the inputs of
    the QKV and first MLP matmuls (4 sbh); sequence parallelism shards them
    too.

    Full recompute with sequence parallelism deviates from Table 2 on
    purpose. Table 2 lists 2sbh for full recompute whatever the parallelism,
    and sec. 5 notes that keeping only a 1/t slice of the input would cost an
    extra all-gather per layer, so the paper does not count it. With sequence
    parallelism the layer input already *is* sequence-sharded (it leaves the
    previous layer's reduce-scatter in pieces of s/t), so keeping it costs
    2sbh/t and no extra communication; that is what we return.
    """
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads),
                        ("tp", tp)):
        positive_int(name, value)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode {recompute!r}; choose from {RECOMPUTE_MODES}")
    if heads % tp:
        raise ValueError(f"{heads} heads do not divide over tensor-parallel size {tp}")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    if sequence_parallel and seq % tp:
        raise ValueError(f"sequence parallel splits the sequence: seq={seq} is not divisible "
                         f"by tensor-parallel size {tp}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    attention_scores = 0.0 if recompute == "selective" else 5 * a * s * s * b / t
    outside = 10 * sbh / (t if sequence_parallel else 1)   # LN inputs, residual masks, ...
    inside = 24 * sbh / t                                  # Q/K/V, projections, MLP 4h tensors
    return outside + inside + attention_scores


def activation_bytes_model(seq: int, batch: int, hidden: int, heads: int, layers: int, *,
                           tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", vocab: int | None = None,
                           interleave: int = 1) -> float:
    """Activation bytes on the busiest GPU: the first pipeline stage.

    Korthikanti et al. 2022, sec. 4.2.3: with a 1F1B schedule the first of
    ``pp`` stages holds ``layers / pp`` layers for ``pp`` micro-batches in
    flight, i.e. ``layers`` layers' worth, whatever ``pp`` is; the
    interleaved schedule with ``interleave`` = m chunks per stage multiplies
    that by (1 + (p - 1) / (p m)).

    Sec. 4.3 adds what lies outside the layers: the embedding's dropout mask,
    s b h p bytes (p micro-batches in flight; /t only with sequence
    parallelism), and when there is no pipeline (stage 1 is also the last)
    the output layer: the final LayerNorm input (2sbh), the output
    projection's input (2sbh) and the fp32 logits the cross-entropy keeps
    (4sbv). The paper writes their sum as 4sbh/t (1 + v/h) because it assumes
    sequence parallelism throughout; without it the two sbh-sized inputs are
    whole on every tensor-parallel rank and only the logits are split (the
    output layer and its cross-entropy are vocabulary-parallel), so we use
    4sbh + 4sbv/t there.
    """
    positive_int("layers", layers)
    positive_int("pp", pp)
    positive_int("interleave", interleave)
    if layers % (pp * interleave):
        raise ValueError(f"{layers} layers do not split over {pp} pipeline stages x "
                         f"{interleave} interleaved chunks")
    per_layer = activation_bytes_per_layer(seq, batch, hidden, heads, tp=tp,
                                           sequence_parallel=sequence_parallel,
                                           recompute=recompute)
    factor = 1 + (pp - 1) / (pp * interleave) if interleave > 1 else 1.0
    total = per_layer * layers * factor
    sbh = seq * batch * hidden
    total += sbh * pp / (tp if sequence_parallel else 1)     # embedding dropout mask
    if pp == 1 and vocab is not None:
        positive_int("vocab", vocab)
        sv = seq * batch * vocab
        total += 4 * sbh / (tp if sequence_parallel else 1)   # final LN + projection inputs
        total += 4 * sv / tp                                   # fp32 logits, vocab-parallel
    return total


# Published shapes for chapter 06's calculator: keyword arguments of
# ``training_memory``, not a model description of their own (the course's
# runnable model is ``helpers.model.GPTConfig``, chapters 19-20's paper-scale
# one ``helpers.frameworks.ModelSpec``). Parameter counts are the nominal ones
# (70e9, as in the "70B -> 1,120 GB" arithmetic). The activation formula is
# Korthikanti's GPT layer, so the "Llama 2" rows are Llama 2's s/h/a/L/v run
# through a GPT layer: a 4h GeLU MLP (2 + 8 + 8 + 1 sbh of the 34). Llama 2's
# own MLP is SwiGLU with three matrices and width 11008 (7B, ~2.7h) or 28672
# (70B, 3.5h), which saves different tensors, and 70B's grouped-query
# attention shrinks K and V; neither is modelled here.
MODEL_PRESETS: dict[str, dict] = {
    "7B (Llama 2)": dict(n_params=7e9, hidden=4096, heads=32, layers=32, vocab=32000),
    "70B (Llama 2)": dict(n_params=70e9, hidden=8192, heads=64, layers=80, vocab=32000),
    "175B (GPT-3)": dict(n_params=175e9, hidden=12288, heads=96, layers=96, vocab=51200),
}

# precision -> bytes per parameter of (weights, gradients, fp32 master copy);
# optimizer -> bytes of optimizer state per parameter
# (weight, gradient, fp32 master) bytes per parameter; the optimizer's own state is added
# from OPTIMIZER_STATE. "bf16 mixed" is ZeRO's 16-bit accounting (16 B/param with Adam);
# "bf16, fp32 grads" is Megatron's bf16 recipe (18 B/param with Adam, see model_state_bytes).
BYTES_PER_PARAM_BY_PRECISION = {"bf16 mixed": (2, 2, 4), "bf16, fp32 grads": (2, 4, 4),
                                "fp32": (4, 4, 0)}
OPTIMIZER_STATE = {"adam": 8, "sgd+momentum": 4, "sgd": 0}


def training_memory(n_params: float, *, seq: int, micro_batch: int, hidden: int, heads: int,
                    layers: int, vocab: int | None = None, precision: str = "bf16 mixed",
                    optimizer: str = "adam", zero_stage: int = 0, dp: int = 1, tp: int = 1,
                    pp: int = 1, sequence_parallel: bool = False,
                    recompute: str = "none") -> dict[str, float]:
    """Per-GPU bytes: weights, grads, optimizer state (incl. master copy), activations.

    Model state is split over tp * pp first (each GPU owns a slice of the
    layers), then ZeRO shards it over dp. Activations follow
    ``activation_bytes_model`` (16-bit; fp32 training doubles them).
    """
    if precision not in BYTES_PER_PARAM_BY_PRECISION:
        raise ValueError(f"unknown precision {precision!r}; choose from {sorted(BYTES_PER_PARAM_BY_PRECISION)}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {sorted(OPTIMIZER_STATE)}")
    w, g, master = BYTES_PER_PARAM_BY_PRECISION[precision]
    states = model_state_bytes(n_params / (tp * pp), dp=dp, zero_stage=zero_stage, param_bytes=w,
                               grad_bytes=g, optimizer_bytes=master + OPTIMIZER_STATE[optimizer])
    act = activation_bytes_model(seq, micro_batch, hidden, heads, layers, tp=tp, pp=pp,
                                 sequence_parallel=sequence_parallel, recompute=recompute,
                                 vocab=vocab)
    act *= 2 if precision == "fp32" else 1
    return {"weights": states.params, "grads": states.grads, "optimizer": states.optimizer,
            "activations": act, "total": states.total + act}


GRAD_BUFFERS = ("none", "view", "copy")


def memory_over_step(budget: dict[str, float], layers: int, *,
                     grad_buffer: bool | str = False) -> list[tuple[str, dict[str, float]]]:
    """Live bytes of each part at each point of one training step, from a
    ``training_memory`` budget: the parts are not all alive at once.

    ``grad_buffer`` says who else holds gradient bytes (``GRAD_BUFFERS``):

    * ``"none"`` (or False): nobody. The previous step's
      ``zero_grad(set_to_none=True)`` (PyTorch's default) freed the gradients;
      they appear in backward and live until the next ``zero_grad``. A plain
      optimizer, or ZeRO-3/FSDP, whose full gradients are freed once
      reduce-scattered;
    * ``"view"`` (or True): a gradient buffer allocated once and kept for the
      whole run, the ``.grad`` tensors being views into it: DDP with
      ``gradient_as_bucket_view=True`` (torch 2.13,
      ``torch/nn/parallel/distributed.py``: it saves "the total gradients
      size"), Megatron-LM's contiguous gradient buffer (its
      ``docs/source/api-guide/dist_optimizer.md``). Gradients count in full at
      every point, once;
    * ``"copy"``: DDP's default (``gradient_as_bucket_view=False``): the Reducer's
      gradient-sized buckets live for the whole run *and* autograd's ``.grad``
      tensors are separate, copied into the buckets and back, alive from backward
      to ``zero_grad``. Returned under a fifth key, ``"buckets"``.

    The points:

    * start: weights, optimizer state, and the buffers above;
    * forward, after layer i of ``layers``: i / layers of the activations;
    * backward, after layer i from the top: the activations of the layers
      not yet reached, plus the gradients of the layers already done (a layer's
      saved tensors are freed by its backward, its gradients appear there);
    * optimizer step: weights, gradients and optimizer state;
    * after zero_grad: back to the start.

    Within backward the live total is linear in i, so with ``"none"`` the peak is
    weights + optimizer + max(activations, gradients), less than the sum of the
    four parts; with ``"view"`` it is the sum; with ``"copy"`` it is weights +
    optimizer + gradients + max(activations, gradients), *more* than the sum
    whenever the gradients outweigh the activations: the gradients are held twice
    at the end of backward. A model, not a measurement: it leaves out temporaries
    (a layer's backward workspace, the logits, Adam's update buffers), the CUDA
    context and fragmentation, and ZeRO-2/3's full-size gradient buckets before
    their reduce-scatter. On a GPU, ``torch.cuda.max_memory_allocated`` sees the
    temporaries (every tensor the caching allocator hands out, rounded up to its
    block sizes); fragmentation shows in ``torch.cuda.memory_reserved`` only, the
    CUDA context in the driver's view only (``meter.cuda_memory_views``).
    """
    positive_int("layers", layers)
    mode = {False: "none", True: "view"}.get(grad_buffer, grad_buffer) \
        if isinstance(grad_buffer, bool) else grad_buffer
    if mode not in GRAD_BUFFERS:
        raise ValueError(f"grad_buffer must be one of {GRAD_BUFFERS} (or False / True), "
                         f"got {grad_buffer!r}")
    w, g, o, a = (float(budget[k]) for k in ("weights", "grads", "optimizer", "activations"))
    g0 = g if mode == "view" else 0.0  # gradient bytes alive before backward writes any
    extra = {"buckets": g} if mode == "copy" else {}  # DDP's buckets beside the .grad copies

    def point(grads: float, acts: float) -> dict[str, float]:
        return {"weights": w, "grads": grads, "optimizer": o, "activations": acts, **extra}

    points = [("start", point(g0, 0.0))]
    for i in range(1, layers + 1):
        points.append((f"forward {i}", point(g0, a * i / layers)))
    for i in range(1, layers + 1):
        points.append((f"backward {i}", point(max(g0, g * i / layers), a * (layers - i) / layers)))
    points.append(("optimizer step", point(g, 0.0)))
    points.append(("after zero_grad", dict(points[0][1])))
    return points
