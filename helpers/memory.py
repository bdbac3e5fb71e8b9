"""How many bytes does training hold? Formulas first, then measured.

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

Measured, not guessed: ``SavedTensorCounter`` installs
``torch.autograd.graph.saved_tensors_hooks`` and sees every tensor autograd
keeps for backward, attributed to the module that saved it, de-duplicated by
storage (two views of one buffer cost one buffer), parameters excluded (they
are model state, counted above). ``explain_saved_bytes`` is the same number
derived by hand for our GPT, term by term, with every difference from the
paper's model named (chapter 06 shows the two agree to the byte).

How production differs: real runs also pay for temporary buffers (a matmul's
workspace, an all-gather's output), allocator fragmentation, and the CUDA
context (~0.5-1 GB); ``torch.cuda.max_memory_allocated`` and
``torch.cuda.memory._record_memory_history`` see those, our counter does not.

Bytes are decimal (1 GB = 1e9 bytes), as in the papers we compare against.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["ModelStateBytes", "model_state_bytes", "GB", "RECOMPUTE_MODES",
           "activation_bytes_per_layer", "activation_bytes_model", "training_memory",
           "MODEL_PRESETS", "SavedRecord", "SavedTensorCounter", "count_saved_bytes",
           "ExplainedTerm", "explain_saved_bytes", "cuda_peak_bytes", "plot_memory_bars",
           "memory_over_step", "plot_memory_over_step", "memory_widget"]

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

    Defaults are mixed-precision Adam: 2 + 2 + 12 = 16 bytes per parameter.
    ``zero_stage`` 1/2/3 divides the optimizer / + gradients / + weights by ``dp``.
    """
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp (data-parallel ranks) must be a positive int, got {dp!r}")
    # bool is an int in Python (True == 1): refuse it rather than read True as stage 1
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, int) \
            or zero_stage not in (0, 1, 2, 3):
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

RECOMPUTE_MODES = ("none", "selective", "full")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


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
        _positive_int(name, value)
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
    _positive_int("layers", layers)
    _positive_int("pp", pp)
    _positive_int("interleave", interleave)
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
        _positive_int("vocab", vocab)
        sv = seq * batch * vocab
        total += 4 * sbh / (tp if sequence_parallel else 1)   # final LN + projection inputs
        total += 4 * sv / tp                                   # fp32 logits, vocab-parallel
    return total


# Published shapes for the calculator. Parameter counts are the nominal ones
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

# bytes per parameter of (weights, gradients, fp32 master copy); optimizer state per param
PRECISIONS = {"bf16 mixed": (2, 2, 4), "fp32": (4, 4, 0)}
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
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {sorted(OPTIMIZER_STATE)}")
    w, g, master = PRECISIONS[precision]
    states = model_state_bytes(n_params / (tp * pp), dp=dp, zero_stage=zero_stage, param_bytes=w,
                               grad_bytes=g, optimizer_bytes=master + OPTIMIZER_STATE[optimizer])
    act = activation_bytes_model(seq, micro_batch, hidden, heads, layers, tp=tp, pp=pp,
                                 sequence_parallel=sequence_parallel, recompute=recompute,
                                 vocab=vocab)
    act *= 2 if precision == "fp32" else 1
    return {"weights": states.params, "grads": states.grads, "optimizer": states.optimizer,
            "activations": act, "total": states.total + act}


def memory_over_step(budget: dict[str, float], layers: int) -> list[tuple[str, dict[str, float]]]:
    """Live bytes of each part at each point of one training step, from a
    ``training_memory`` budget: the parts are not all alive at once.

    * start: weights and optimizer state; no gradients, since the previous
      step's ``zero_grad(set_to_none=True)`` (PyTorch's default) freed them;
    * forward, after layer i of ``layers``: i / layers of the activations;
    * backward, after layer i from the top: the activations of the layers
      not yet reached, plus the gradients of the layers already done (a layer's
      saved tensors are freed by its backward, its gradients appear there);
    * optimizer step: weights, gradients and optimizer state;
    * after zero_grad: back to the start.

    Within backward the live total is linear in i, so the peak is
    weights + optimizer + max(activations, gradients), not the sum of all four
    parts. A model, not a measurement: it leaves out temporaries (a layer's
    backward workspace, the logits, Adam's update buffers), the CUDA context and
    fragmentation, and ZeRO-2/3's full-size gradient buckets before their
    reduce-scatter; ``torch.cuda.max_memory_allocated`` sees those too.
    """
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"layers must be a positive int, got {layers!r}")
    w, g, o, a = (float(budget[k]) for k in ("weights", "grads", "optimizer", "activations"))
    points = [("start", {"weights": w, "grads": 0.0, "optimizer": o, "activations": 0.0})]
    for i in range(1, layers + 1):
        points.append((f"forward {i}", {"weights": w, "grads": 0.0, "optimizer": o,
                                        "activations": a * i / layers}))
    for i in range(1, layers + 1):
        points.append((f"backward {i}", {"weights": w, "grads": g * i / layers, "optimizer": o,
                                         "activations": a * (layers - i) / layers}))
    points.append(("optimizer step", {"weights": w, "grads": g, "optimizer": o, "activations": 0.0}))
    points.append(("after zero_grad", dict(points[0][1])))
    return points


def plot_memory_over_step(budgets: dict[str, dict[str, float]], layers: int,
                          gpu_gb: float | None = 80.0):
    """One panel per budget: the parts of ``memory_over_step`` stacked over the step,
    with the sum of all parts (the bar chart's total) dashed for comparison."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.2), squeeze=False)
    for ax, (name, budget) in zip(axes[0], budgets.items()):
        points = memory_over_step(budget, layers)
        gap = max(2, layers // 2)  # room for the optimizer step's label after backward
        xs = list(range(2 * layers + 1)) + [2 * layers + gap, 2 * layers + 2 * gap]
        ax.stackplot(xs, *[[pt[part] / GB for _, pt in points] for part in _PARTS],
                     labels=_PARTS, colors=[_COLORS[p] for p in _PARTS])
        ax.axhline(sum(budget[p] for p in _PARTS) / GB, color="grey", ls=":", lw=1,
                   label="sum of parts")
        if gpu_gb:
            ax.axhline(gpu_gb, color="k", ls="--", lw=1, label=f"{gpu_gb:g} GB GPU")
        ax.axvspan(layers, 2 * layers, color="0.9", zorder=0)  # backward
        ax.set_xticks([0, layers, 2 * layers, 2 * layers + gap],
                      ["start", "end of\nforward", "end of\nbackward", "optimizer\nstep"],
                      fontsize=8)
        ax.set_title(name.replace("\n", " "), fontsize=9)
        ax.set_ylabel("GB per GPU")
    axes[0][0].legend(fontsize=7, loc="upper left")
    plt.tight_layout()
    return axes[0]


# ---------------------------------------------------------------------------
# Measured: what autograd actually keeps
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SavedRecord:
    """One tensor handed to autograd for backward."""

    module: str            # innermost module running when it was saved ("<top>" if none)
    shape: tuple
    dtype: torch.dtype
    nbytes: int            # bytes it adds: 0 for a parameter or a storage already counted
    storage_bytes: int     # bytes of the whole storage it keeps alive
    is_param: bool         # a parameter (or a tensor in ``exclude``): not counted
    in_backward: bool      # saved while backward ran (a recompute), not by the forward


class _Held:
    """What the pack hook returns: owning it is owning the saved tensor, so its
    death (autograd frees saved tensors as soon as their node has run) tells
    us when the bytes are released."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _storage(t: torch.Tensor) -> tuple[int, int]:
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse)
        return id(t), t.numel() * t.element_size()


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class SavedTensorCounter:
    """Count the bytes autograd saves for backward, per module or per owner.

        with SavedTensorCounter(model) as c:
            loss = model(x, y)[1]
        c.total_bytes, c.by_module()
        loss.backward()        # inside or outside the block
        c.peak_bytes           # most bytes held at once (forward + recompute in backward)

    Counted once per storage (views share memory), parameters excluded (model
    state, not activations), and any tensor in ``exclude`` too (a batch that
    lives whatever happens). ``total_bytes`` is what the forward leaves for
    backward; ``peak_bytes`` also sees tensors a recompute saves during
    backward, released as backward consumes them. Keep the backward call inside
    the ``with`` block to let the counter see the recompute.

    Owners (the pipeline's stash, chapter 12): ``with c.saving(owner):``
    counts what autograd saves inside the block as ``owner``'s (for example
    ``(micro-batch, chunk)``), and ``c.hold(owner, t)`` counts a tensor the
    caller keeps itself until that tensor object dies. A storage belongs to
    the owner that first made it alive. Every time a storage becomes alive or
    dies, ``log`` gets ``(owner, +bytes or -bytes)``; ``unit_bytes`` and
    ``peaks`` read it (see ``helpers.pipeline.stash``).
    """

    def __init__(self, model: nn.Module | None = None, exclude=()):
        self.model = model
        self.records: list[SavedRecord] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.log: list[tuple] = []               # (owner, +bytes | -bytes), in time order
        self._live: dict[int, list] = {}          # storage ptr -> [holders alive, bytes, owner]
        self._seen_forward: set[int] = set()
        self._stack = ["<top>"]
        self._owner = None                        # set inside saving(owner)
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._skip: set[int] = {_storage(t)[0] for t in exclude}

    # -- context manager --------------------------------------------------
    def __enter__(self) -> "SavedTensorCounter":
        if self.model is not None:
            self._skip |= {_storage(p)[0] for p in self.model.parameters()}
            for name, mod in self.model.named_modules():
                if not name:
                    continue
                self._handles.append(mod.register_forward_pre_hook(
                    lambda m, args, name=name: self._stack.append(name)))
                self._handles.append(mod.register_forward_hook(
                    lambda m, args, out: self._pop(), always_call=True))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pop(self) -> None:
        self._stack.pop()   # returns None, so the module's output is left alone

    @contextlib.contextmanager
    def saving(self, owner):
        """Count what autograd saves inside this block as ``owner``'s."""
        outer, self._owner = self._owner, owner
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._owner = outer

    def hold(self, owner, t: torch.Tensor) -> None:
        """Count ``t`` as ``owner``'s until the tensor object is freed."""
        ptr, size = _storage(t)
        if ptr in self._skip or size == 0:
            return
        self._acquire(ptr, size, owner)
        weakref.finalize(t, self._release, ptr)

    # -- hooks ------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        ptr, size = _storage(t)
        skipped = ptr in self._skip or size == 0
        backward = _in_backward()
        new = not skipped and not backward and ptr not in self._seen_forward
        if new:
            self._seen_forward.add(ptr)
        self.records.append(SavedRecord(self._stack[-1], tuple(t.shape), t.dtype,
                                        size if new else 0, size, skipped, backward))
        if skipped:
            return t
        # hold a detached alias (same memory): the tensor itself may be the output
        # of the op that saves it, and holding it would tie our handle, the tensor
        # and its graph into a cycle the collector cannot see through autograd
        held = _Held(t.detach())
        self._acquire(ptr, size, self._stack[-1] if self._owner is None else self._owner)
        weakref.finalize(held, self._release, ptr)
        return held

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _acquire(self, ptr: int, size: int, owner) -> None:
        entry = self._live.setdefault(ptr, [0, size, owner])
        if entry[0] == 0:
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.log.append((entry[2], size))
        entry[0] += 1

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            self.log.append((entry[2], -entry[1]))
            del self._live[ptr]

    # -- results ----------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        """Bytes the forward pass left for backward (unique storages, no parameters)."""
        return sum(r.nbytes for r in self.records)

    def by_module(self, depth: int | None = None) -> dict[str, int]:
        """{module name: bytes}, in forward order; ``depth`` truncates dotted names
        (depth=2: ``blocks.0.attn.c_attn`` -> ``blocks.0``)."""
        out: dict[str, int] = {}
        for r in self.records:
            if r.nbytes:
                key = ".".join(r.module.split(".")[:depth]) if depth else r.module
                out[key] = out.get(key, 0) + r.nbytes
        return out

    def unit_bytes(self, group: Callable = lambda owner: owner[1]) -> dict:
        """Bytes one owner's forward made alive, per group of owners (default:
        per chunk, for owners (micro-batch, chunk)); the largest owner of each."""
        full: dict = {}
        for owner, delta in self.log:
            if delta > 0:
                full[owner] = full.get(owner, 0) + delta
        units: dict = {}
        for owner, b in full.items():
            units[group(owner)] = max(units.get(group(owner), 0), b)
        return units

    def peaks(self, group: Callable = lambda owner: owner[1]) -> tuple[int, float]:
        """(most bytes alive at once, most owners' worth alive at once), where an
        owner counts by the share of its group's unit (``unit_bytes``) still alive."""
        units = self.unit_bytes(group)
        live = dict.fromkeys(units, 0)      # bytes alive per group
        total = peak_bytes = 0
        peak_units = 0.0
        for owner, delta in self.log:
            live[group(owner)] += delta
            total += delta
            peak_bytes = max(peak_bytes, total)
            peak_units = max(peak_units, sum(live[g] / units[g] for g in units))
        return peak_bytes, peak_units


def count_saved_bytes(model: nn.Module, *args, **kwargs) -> SavedTensorCounter:
    """Run ``model(*args, **kwargs)`` (forward only) under a counter and return it."""
    with SavedTensorCounter(model) as counter:
        model(*args, **kwargs)
    return counter


@dataclasses.dataclass(frozen=True)
class ExplainedTerm:
    module: str      # where our GPT saves it (matches SavedTensorCounter.by_module())
    tensor: str      # what it is
    paper: str       # the matching term of Korthikanti et al.'s count, or why it has none
    nbytes: int


def explain_saved_bytes(cfg, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16,
                        device_type: str = "cpu", with_loss: bool = True) -> list[ExplainedTerm]:
    """Every tensor our GPT (``helpers.model``, manual attention) saves for backward,
    derived by hand, in forward order; sum the ``nbytes`` to predict
    ``SavedTensorCounter.total_bytes`` exactly.

    Differences from the paper's layer (Korthikanti et al. 2022, sec. 4.1):

    * dropout masks: a CUDA build keeps a 1-byte bool mask (as the paper
      assumes); PyTorch's CPU dropout multiplies by a scaled noise tensor of the
      activation's dtype and keeps that (2 bytes in bf16). With dropout = 0
      there is no mask at all, and the dropped-out attention probabilities are
      the softmax output itself (one buffer, not two).
    * LayerNorm also keeps its per-row mean and 1/std: 2 * s * b numbers
      (activation dtype on CPU, fp32 on CUDA). The paper drops these small terms.
    * our causal mask is a fresh s x s bool tensor per layer (``masked_fill``
      keeps it); Megatron's fused softmax builds the mask inside the kernel.
    * q, k, v are copied into contiguous per-head buffers for the batched
      matmuls (3 x 2sbh, exactly the paper's Q, K and V terms).

    ``device_type="cuda"`` gives the CUDA variant (bool masks, fp32 LN
    statistics); it is what we expect there, tested only where a GPU is lent.
    """
    if getattr(cfg, "attention", "manual") != "manual":
        raise ValueError("explain_saved_bytes covers attention='manual' only; the fused sdpa "
                         "kernel saves its own, smaller set of tensors")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    _positive_int("batch", batch)
    _positive_int("seq", seq)
    if seq > cfg.block_size:
        raise ValueError(f"seq={seq} exceeds the model's block_size={cfg.block_size}")
    e = torch.empty((), dtype=dtype).element_size()
    dropout = cfg.dropout > 0
    mask_b = (1 if device_type == "cuda" else e) if dropout else 0
    stat_b = 4 if device_type == "cuda" else e
    s, b, h, a, v = seq, batch, cfg.n_embd, cfg.n_head, cfg.vocab_size
    f = cfg.mlp_ratio * h
    sbh = s * b * h
    rows: list[ExplainedTerm] = []
    add = lambda *t: rows.append(ExplainedTerm(*t))  # noqa: E731

    def layer_norm(name: str) -> None:
        add(name, "input", "LayerNorm input: 2sbh", sbh * e)
        add(name, "mean and 1/std per row", "not counted by the paper", 2 * s * b * stat_b)

    def dropout_mask(name: str, numel: int, paper: str) -> None:
        if dropout:
            add(name, "dropout mask" + (" (scaled noise, activation dtype)"
                                        if device_type == "cpu" else " (bool)"), paper,
                numel * mask_b)

    add("wte", "token ids (int64)", "not counted (sec. 4.3 keeps only the dropout mask)",
        b * s * 8)
    add("wpe", "positions (int64)", "not counted", s * 8)
    dropout_mask("drop", sbh, "embedding dropout mask: sbh (sec. 4.3)")
    for i in range(cfg.n_layer):
        p = f"blocks.{i}"
        layer_norm(f"{p}.ln_1")
        add(f"{p}.attn.c_attn", "input", "QKV matmul input: 2sbh", sbh * e)
        add(f"{p}.attn", "k^T, contiguous copy", "Q and K: 4sbh (half)", sbh * e)
        add(f"{p}.attn", "q, contiguous copy", "Q and K: 4sbh (half)", sbh * e)
        add(f"{p}.attn", "causal mask s x s (bool)", "not counted (fused into the kernel)", s * s)
        add(f"{p}.attn", "softmax output", "softmax output: 2as^2b", a * s * s * b * e)
        dropout_mask(f"{p}.attn.attn_dropout", a * s * s * b, "softmax dropout mask: as^2b")
        add(f"{p}.attn", "v, contiguous copy", "V: 2sbh", sbh * e)
        if dropout:
            add(f"{p}.attn", "dropped-out probabilities", "dropout output: 2as^2b",
                a * s * s * b * e)
        add(f"{p}.attn.c_proj", "input", "projection input: 2sbh", sbh * e)
        dropout_mask(f"{p}.attn.resid_dropout", sbh, "attention dropout mask: sbh")
        layer_norm(f"{p}.ln_2")
        add(f"{p}.mlp.c_fc", "input", "first MLP matmul input: 2sbh", sbh * e)
        add(f"{p}.mlp.gelu", "input (4h wide)", "GeLU input: 8sbh", s * b * f * e)
        add(f"{p}.mlp.c_proj", "input (4h wide)", "second MLP matmul input: 8sbh", s * b * f * e)
        dropout_mask(f"{p}.mlp.dropout", sbh, "MLP dropout mask: sbh")
    layer_norm("ln_f")
    add("lm_head", "input", "output layer input (sec. 4.3)", sbh * e)
    if with_loss:
        add("<top>", "log-softmax of the logits", "cross-entropy logits: 4sbv in fp32 (sec. 4.3)",
            s * b * v * e)
        add("<top>", "targets (int64)", "not counted", s * b * 8)
        add("<top>", "total weight (1 element)", "not counted", e)
    return rows


def cuda_peak_bytes(fn: Callable[[], object], device=None) -> int | None:
    """``torch.cuda.max_memory_allocated`` around ``fn()``; None without CUDA.

    The allocator's view: activations *plus* weights, gradients, temporaries
    and rounding to its block sizes. Subtract the bytes held before ``fn``.
    """
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# ---------------------------------------------------------------------------
# Pictures and the calculator
# ---------------------------------------------------------------------------

_PARTS = ("weights", "grads", "optimizer", "activations")
_COLORS = {"weights": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
           "activations": "#c44e52"}


def plot_memory_bars(budgets: dict[str, dict[str, float]], ax=None, gpu_gb: float | None = 80.0):
    """Stacked bars, one per configuration, of ``training_memory``'s parts in GB."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.3 * len(budgets), 3.6))
    labels = list(budgets)
    bottom = [0.0] * len(labels)
    for part in _PARTS:
        vals = [budgets[k].get(part, 0.0) / GB for k in labels]
        ax.bar(labels, vals, bottom=bottom, label=part, color=_COLORS[part])
        bottom = [b + v for b, v in zip(bottom, vals)]
    if gpu_gb:
        ax.axhline(gpu_gb, color="k", ls="--", lw=1)
        ax.text(len(labels) - 0.5, gpu_gb, f" {gpu_gb:g} GB GPU", va="bottom", ha="right")
    ax.set_ylabel("GB per GPU")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, never on them
    ax.tick_params(axis="x", labelsize=10)  # long budget names side by side
    return ax


def memory_widget(preset: str = "70B (Llama 2)"):
    """An ipywidgets calculator over ``training_memory`` with a stacked bar.

    Every control maps to one argument of the plain function; the function,
    not the widget, is what the tests check.
    """
    import ipywidgets as W
    import matplotlib.pyplot as plt

    from helpers.plots import show_widget

    style = {"description_width": "110px"}
    c = dict(
        model=W.Dropdown(options=list(MODEL_PRESETS), value=preset, description="model",
                         style=style),
        precision=W.Dropdown(options=list(PRECISIONS), description="precision", style=style),
        optimizer=W.Dropdown(options=list(OPTIMIZER_STATE), description="optimizer",
                             style=style),
        zero_stage=W.IntSlider(value=0, min=0, max=3, description="ZeRO stage", style=style),
        dp=W.Dropdown(options=[1, 2, 4, 8, 16, 32, 64, 128], value=8, description="DP",
                      style=style),
        tp=W.Dropdown(options=[1, 2, 4, 8], value=1, description="TP", style=style),
        pp=W.Dropdown(options=[1, 2, 4, 8], value=1, description="PP", style=style),
        seq=W.Dropdown(options=[512, 1024, 2048, 4096, 8192], value=2048, description="seq len",
                       style=style),
        micro_batch=W.IntSlider(value=1, min=1, max=16, description="micro-batch", style=style),
        sp=W.Checkbox(value=False, description="sequence parallel"),
        # selective: what a fused attention kernel without dropout keeps (no s x s scores)
        recompute=W.Dropdown(options=list(RECOMPUTE_MODES), value="selective",
                             description="recompute", style=style),
    )
    out = W.Output()

    def draw():
        m = MODEL_PRESETS[c["model"].value]
        try:
            parts = training_memory(
                m["n_params"], seq=c["seq"].value, micro_batch=c["micro_batch"].value,
                hidden=m["hidden"], heads=m["heads"], layers=m["layers"], vocab=m["vocab"],
                precision=c["precision"].value, optimizer=c["optimizer"].value,
                zero_stage=c["zero_stage"].value, dp=c["dp"].value, tp=c["tp"].value,
                pp=c["pp"].value, sequence_parallel=c["sp"].value,
                recompute=c["recompute"].value)
        except ValueError as exc:
            print("impossible configuration:", exc)
            return
        fig, ax = plt.subplots(figsize=(4.5, 4))
        plot_memory_bars({"per GPU": parts}, ax=ax)
        ax.set_title(f"{parts['total'] / GB:,.1f} GB per GPU")
        plt.show()

    def redraw(*_):
        with out:
            out.clear_output(wait=True)
            draw()

    for w in c.values():
        w.observe(redraw, names="value")
    redraw()
    box = W.HBox([W.VBox(list(c.values())), out])
    show_widget(box, draw)  # with a picture of the first bar for a notebook not run yet
    return box
