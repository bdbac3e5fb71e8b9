"""FP8 formats and per-tensor scaling: current, delayed, and the amax all-reduce.

FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", sec. 3,
Table 1): two formats of one byte,

    E4M3  4 exponent, 3 mantissa bits, max 448     weights and activations (forward)
    E5M2  5 exponent, 2 mantissa bits, max 57344   gradients (backward: range over precision)

Eight bits hold too little range for raw tensors, so each tensor gets a
scale (the paper's sec. 2 leaves how to pick it to software): x8 =
cast(x * scale), x ~ x8 / scale, with scale = fp8_max / amax so the largest
magnitude lands at the top of the format. Computing amax needs a pass over
the tensor before casting it; *delayed scaling* (NVIDIA Transformer Engine's
``DelayedScaling`` recipe) instead uses the amax of *previous* steps, kept in a
short history. Which recipe Transformer Engine picks by default depends on the GPU
(``get_default_fp8_recipe``, ``transformer_engine/pytorch/quantization.py``, read at
v2.18): ``MXFP8BlockScaling`` where MXFP8 runs (compute capability 10.x),
``Float8CurrentScaling`` on 12.0 and later, ``DelayedScaling`` elsewhere, Hopper and
Ada included. The delayed rule:

    scale_t = fp8_max / max(amax_history) / 2^margin     (algo "max")
    scale_t = fp8_max / amax_{t-1} / 2^margin           (algo "most_recent")

and records this step's amax into the history afterwards. A spike larger
than the history saturates (clamps to +-fp8_max) for one step. ``quantize``
clamps before it casts: torch 2.13's cast to E4M3 happens to saturate by
itself (``fp8e4m3fn_from_fp32_value`` in ``torch/headeronly/util/Float8_e4m3fn.h``
maps every value above 448, inf included, to 448), but an earlier version of
the same function (``c10/util/Float8_e4m3fn.h``) returned NaN for them, so the
saturation belongs to the quantizer.

Every rank of a tensor- or data-parallel group should use one scale for
the same tensor: ``all_reduce_amax`` takes the largest amax over the group
(Transformer Engine's ``reduce_amax``).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist

from helpers.comm import world_size
from helpers.validate import positive_int

__all__ = ["E4M3", "E5M2", "FP8_MAX", "check_fp8", "fp8_scale", "quantize", "dequantize",
           "fp8_round_trip", "cast_and_amax", "update_delayed_scale", "DelayedScaling",
           "all_reduce_amax"]


E4M3 = torch.float8_e4m3fn   # "fn": finite, no inf; max 448 (Micikevicius et al. 2022, Table 1)
E5M2 = torch.float8_e5m2     # IEEE-like, has inf; max 57344
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def check_fp8(dtype) -> float:
    """The format's largest finite value; refuses a dtype that is not FP8."""
    if dtype not in FP8_MAX:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return FP8_MAX[dtype]


def fp8_scale(amax: float | torch.Tensor, dtype=E4M3, margin: int = 0) -> torch.Tensor:
    """scale = fp8_max / amax / 2^margin (1.0 when amax is 0 or not finite), fp32 scalar."""
    fmax = check_fp8(dtype)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, fmax / amax / 2.0 ** margin, torch.ones_like(amax))


def quantize(x: torch.Tensor, dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """x * scale, clamped to the format's range (saturate, never inf), cast to FP8."""
    fmax = check_fp8(dtype)
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def dequantize(x8: torch.Tensor, scale: torch.Tensor | float,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (x8.float() / scale).to(dtype)


def fp8_round_trip(x: torch.Tensor, dtype=E4M3) -> torch.Tensor:
    """Quantize with the tensor's own amax (current scaling) and back."""
    scale = fp8_scale(x.abs().max(), dtype)
    return dequantize(quantize(x, dtype, scale), scale, x.dtype)


def update_delayed_scale(amax_history: torch.Tensor, new_amax, scale, *, fp8_max: float,
                         margin: int = 0, algo: str = "max") -> tuple[torch.Tensor, torch.Tensor]:
    """One delayed-scaling step, as in Transformer Engine's ``DelayedScaling`` recipe
    (amax_history_len, amax_compute_algo "max" / "most_recent", margin). Pure function.

    amax_history: (H,) most recent first. Returns (history with ``new_amax``
    pushed in front and the oldest dropped, scale for the next step):
    fp8_max / amax / 2^margin where amax = max(history) ("max") or
    history[0] ("most_recent"). If that amax is 0 or not finite the previous
    ``scale`` is kept.
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    if amax_history.dim() != 1 or amax_history.numel() < 1:
        raise ValueError("amax_history must be a non-empty 1-D tensor")
    history = torch.roll(amax_history, 1)
    history[0] = torch.as_tensor(new_amax, dtype=history.dtype)
    amax = history.max() if algo == "max" else history[0]
    scale = torch.as_tensor(scale, dtype=torch.float32)
    ok = torch.isfinite(amax) & (amax > 0)
    new_scale = torch.where(ok, fp8_max / amax.float() / 2.0 ** margin, scale)
    return history, new_scale


def _cast_and_amax(x: torch.Tensor, scale: torch.Tensor, dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize(x, dtype, scale), x.abs().amax().float()


_COMPILED: dict[str, object] = {}
# CPU only: (shape, input dtype, FP8 dtype) -> did the compiled function give eager's bits?
_CPU_CHECKED: dict[tuple, bool] = {}


def cast_and_amax(x: torch.Tensor, scale: torch.Tensor, dtype, fused: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x cast to FP8 with ``scale``, amax of x): what delayed scaling does to each tensor.

    Eagerly that is two passes over x (and a third for the fp32 copy of a bf16 x),
    each a kernel reading x from memory: for a layer's activations that traffic can
    cost more than the FP8 GEMM saves. ``fused=True`` runs the same function through
    ``torch.compile``, whose Inductor backend can emit the scale-clamp-cast and the
    amax reduction from one read of x (Transformer Engine's cast kernels compute the
    amax while they cast, for the same reason). The result is the same bits either
    way: multiply, clamp, cast and max are each exactly rounded, in any order.
    The first call compiles (tens of seconds on a CPU, seconds on a GPU).

    On a CPU the compiled code is C++ that Inductor writes for the CPU's vector ISA,
    and in torch 2.13 that code is not right everywhere: built for AVX2 (a laptop
    without AVX-512) its E4M3 cast gives zeros and its amax misses elements, and
    without vectors it does not compile. So on a CPU the first call for each shape
    also runs the eager function and compares the bits; where they differ (or the
    compile fails) that shape stays eager, with a warning. On a GPU (Triton's code)
    nothing is compared: that would read the result back to the host."""
    if not fused:
        return _cast_and_amax(x, scale, dtype)
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(_cast_and_amax, fullgraph=True)
    compiled = _COMPILED["fn"]
    if x.device.type != "cpu":
        return compiled(x, scale, dtype)
    key = (tuple(x.shape), x.dtype, dtype)
    if key not in _CPU_CHECKED:
        want = _cast_and_amax(x, scale, dtype)
        try:
            got = compiled(x, scale, dtype)
            ok = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and \
                torch.equal(got[1], want[1])
        except Exception:  # noqa: BLE001 - a compile that fails is the same verdict
            ok = False
        _CPU_CHECKED[key] = ok
        if not ok:
            warnings.warn(f"torch.compile's CPU code for the FP8 cast of a {tuple(x.shape)} "
                          f"{x.dtype} tensor gave other bits than eager on this CPU: that "
                          f"shape is cast eagerly (same result, one more pass over memory)")
        return want
    return compiled(x, scale, dtype) if _CPU_CHECKED[key] else _cast_and_amax(x, scale, dtype)


@dataclasses.dataclass
class DelayedScaling:
    """The scale of one tensor (e.g. a layer's input) across steps."""

    dtype: torch.dtype = E4M3
    history_len: int = 16
    margin: int = 0
    algo: str = "max"
    device: torch.device | str | None = None   # where the history and scale live
    fused: bool = False   # cast and amax in one compiled kernel (``cast_and_amax``)

    def __post_init__(self) -> None:
        check_fp8(self.dtype)
        positive_int("history_len", self.history_len)
        if self.algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {self.algo!r}")
        self.amax_history = torch.zeros(self.history_len, device=self.device)
        self.scale = torch.tensor(1.0, device=self.device)
        self.steps = 0

    def _follow(self, device: torch.device) -> None:
        """Keep the history and scale on the tensor's device (moved once, on first use),
        so that a step on a GPU never copies them between host and device."""
        if self.amax_history.device != device:
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)

    def quantize(self, x: torch.Tensor, scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cast with the scale from earlier steps, then record this tensor's amax.

        First call: no history yet, so the tensor's own amax sets the scale
        (Transformer Engine instead starts at scale 1 and lets the first step
        saturate). With ``scale`` given, as when a recompute replays an
        earlier forward, cast with it and record nothing: the history
        advances once per pass, not once more per recompute.
        Returns (x8, the scale used)."""
        if scale is not None:
            return quantize(x.detach(), self.dtype, scale.to(x.device)), scale
        self._follow(x.device)
        if self.steps == 0:   # no history yet: this tensor's own amax sets the first scale
            self.scale = fp8_scale(x.detach().abs().amax().float(), self.dtype, self.margin)
        scale = self.scale
        # amax stays on the device: reading it on the host (.item(), .cpu()) would
        # make the CPU wait for the GPU three times per layer per step.
        x8, amax = cast_and_amax(x.detach(), scale, self.dtype, self.fused)
        self.amax_history, self.scale = update_delayed_scale(
            self.amax_history, amax, self.scale, fp8_max=FP8_MAX[self.dtype],
            margin=self.margin, algo=self.algo)
        self.steps += 1
        return x8, scale


def all_reduce_amax(amax: torch.Tensor, group=None) -> torch.Tensor:
    """In place: the largest amax over the ranks of ``group`` (no-op on one rank).

    Transformer Engine reduces amaxes across the data- and tensor-parallel
    group (``reduce_amax``) so that every rank derives the same scale: under
    tensor parallelism the shards of one weight or activation then sit on one
    grid, and under data parallelism replicas quantize identically. One small
    all-reduce (MAX) per step for all amaxes together.
    """
    if world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax
