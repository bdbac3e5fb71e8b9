"""Lab 13 checks: pass on the solution, fail on the lab's stub and on plausible mistakes."""

import torch

from checks_harness import ChapterChecks, Check, Right, Wrong
from helpers.checks import ch13
from tools.nbtool import exercise

SOL = "solutions/13_recompute_and_precision_solution.ipynb"


class NoRngRestore(torch.autograd.Function):
    """Recomputes, but dropout draws a fresh mask the second time."""

    @staticmethod
    def forward(ctx, run_fn, x):
        ctx.run_fn = run_fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.run_fn(x)
        torch.autograd.backward(y, grad_out)
        return None, x.grad


class KeepsGraph(torch.autograd.Function):
    """'Checkpoints' by saving the output too: correct gradients, no memory saved."""

    @staticmethod
    def forward(ctx, run_fn, x):
        ctx.run_fn, ctx.rng = run_fn, torch.get_rng_state()
        y = run_fn(x)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, _ = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                y = ctx.run_fn(x)
        torch.autograd.backward(y, grad_out)
        return None, x.grad


class RestoresWithoutFork(torch.autograd.Function):
    """Right gradients, but rewinds the global RNG: training's dropout repeats."""

    @staticmethod
    def forward(ctx, run_fn, x):
        ctx.run_fn, ctx.rng = run_fn, torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        torch.set_rng_state(ctx.rng)
        with torch.enable_grad():
            y = ctx.run_fn(x)
        torch.autograd.backward(y, grad_out)
        return None, x.grad


class OneGradient(torch.autograd.Function):
    """Returns only x's gradient: forward took two inputs (run_fn, x)."""

    @staticmethod
    def forward(ctx, run_fn, x):
        ctx.run_fn, ctx.rng = run_fn, torch.get_rng_state()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                y = ctx.run_fn(x)
        torch.autograd.backward(y, grad_out)
        return x.grad


class RngStateSaved(torch.autograd.Function):
    """Right: the RNG state kept with save_for_backward, next to the input."""

    @staticmethod
    def forward(ctx, run_fn, x):
        ctx.run_fn = run_fn
        ctx.save_for_backward(x, torch.get_rng_state())
        with torch.no_grad():
            return run_fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        x, rng = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng)
            with torch.enable_grad():
                y = ctx.run_fn(x)
        torch.autograd.backward(y, grad_out)
        return None, x.grad


class ReseedsInitialSeed(torch.autograd.Function):
    """Keeps torch.initial_seed() and reseeds with it in backward: the same mask only when
    forward drew first after torch.manual_seed."""

    @staticmethod
    def forward(ctx, run_fn, x):
        ctx.run_fn, ctx.seed = run_fn, torch.initial_seed()
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            with torch.enable_grad():
                y = ctx.run_fn(x)
        torch.autograd.backward(y, grad_out)
        return None, x.grad


class ReseedsSameSeed(torch.autograd.Function):
    """Seeds the caller's stream with torch.initial_seed() before forward and again before
    the recompute: one mask both times, but not the stream's own next mask."""

    @staticmethod
    def forward(ctx, run_fn, x):
        ctx.run_fn, ctx.seed = run_fn, torch.initial_seed()
        ctx.save_for_backward(x)
        torch.manual_seed(ctx.seed)
        with torch.no_grad():
            return run_fn(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(ctx.seed)
            with torch.enable_grad():
                y = ctx.run_fn(x)
        torch.autograd.backward(y, grad_out)
        return None, x.grad


def _delayed(*args):  # the solution's update (the course's own is refused inside the check)
    return exercise(SOL, "update_delayed_scale")(*args)


def _scale_only(hist, new_amax, scale, fp8_max, margin=0):  # returns the scale, no history
    return _delayed(hist, new_amax, scale, fp8_max, margin)[1]


def _per_entry_scale(hist, new_amax, scale, fp8_max, margin=0):  # a scale per history entry
    h, _ = _delayed(hist, new_amax, scale, fp8_max, margin)
    return h, fp8_max / h.clamp(min=1e-12) / 2 ** margin


def _course_delayed(hist, new_amax, scale, fp8_max, margin=0):  # the chapter's own, one line
    from helpers.precision import update_delayed_scale
    return update_delayed_scale(hist, new_amax, scale, fp8_max=fp8_max, margin=margin)


def _no_zero_guard(hist, new_amax, scale, fp8_max, margin=0):  # divides by an all-zero history
    hist = torch.roll(hist, 1)
    hist[0] = new_amax
    return hist, fp8_max / hist.max() / 2 ** margin


def _mx(x, *, clamp="clamp", cast="to", floor=True):
    """MXFP8 with one step varied: how it saturates ("clamp", "where", None) and casts
    ("to", "copy_"), or the exponent rounded instead of floored."""
    R, C = x.shape
    b = x.float().reshape(R, C // 32, 32)
    amax = b.abs().amax(-1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.floor(torch.log2(safe)) if floor else torch.round(torch.log2(safe))
    s = torch.where(amax > 0, torch.exp2(8 - e), torch.ones_like(amax))
    y = b * s[..., None]
    if clamp == "clamp":
        y = y.clamp(-448, 448)
    elif clamp == "where":
        y = torch.where(y.abs() > 448, torch.sign(y) * 448, y)
    if cast == "to":
        y8 = y.to(torch.float8_e4m3fn)
    else:
        y8 = torch.empty(y.shape, dtype=torch.float8_e4m3fn)
        y8.copy_(y)
    return y8.reshape(R, C), s


def _float32_values(x):  # right scales, values left in float32
    x8, s = _mx(x)
    return x8.float(), s


def _no_clamp(x):  # no saturation: torch 2.13's cast clamps for it, so the bits are right
    return _mx(x, clamp=None)


def _no_clamp_copy(x):  # no saturation, cast by copying into an FP8 buffer
    return _mx(x, clamp=None, cast="copy_")


def _where_clamp(x):  # right: saturation written with torch.where
    return _mx(x, clamp="where")


def _course_mx(x):  # the chapter's own quantizer, one line
    from helpers.precision import mx_quantize
    return mx_quantize(x)


def _course_block_quantize(x):  # the chapter's general block quantizer, MX settings
    from helpers.precision import E4M3, block_quantize
    return block_quantize(x, E4M3, (1, 32), power_of_two=True)


def _current_scaling(hist, new_amax, scale, fp8_max, margin=0):  # the latest amax, no history
    hist = torch.roll(hist, 1)
    hist[0] = new_amax
    return hist, torch.tensor(fp8_max / new_amax / 2 ** margin if new_amax else scale)


def _no_margin(hist, new_amax, scale, fp8_max, margin=0):  # the solution, margin ignored
    return exercise(SOL, "update_delayed_scale")(hist, new_amax, scale, fp8_max, 0)


def _no_roll(hist, new_amax, scale, fp8_max, margin=0):  # overwrites the newest entry
    hist = hist.clone()
    hist[0] = new_amax
    return hist, torch.as_tensor(fp8_max / hist.max() / 2 ** margin if hist.max() else scale)


def _one_scale(x):  # per-tensor current scaling: one scale for everything
    from helpers.precision import E4M3, fp8_scale, quantize
    s = fp8_scale(x.abs().max(), E4M3)
    return quantize(x, E4M3, s), s.reshape(1)


def _not_power_of_two(x):  # per-block fp8_max/amax: DeepSeek-style, not MX
    R, C = x.shape
    b = x.float().reshape(R, C // 32, 32)
    amax = b.abs().amax(-1)
    s = torch.where(amax > 0, 448.0 / torch.where(amax > 0, amax, torch.ones_like(amax)),
                    torch.ones_like(amax))
    return (b * s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(R, C), s


def _rounded_exponent(x):  # round(log2 amax) instead of floor: half the scale for amax >= 1.41 x 2^k
    return _mx(x, floor=False)


class TestChapter13(ChapterChecks):
    lab, sol = "labs/13_recompute_and_precision_lab.ipynb", SOL
    checks = {
        "checkpoint": Check(ch13.check_checkpoint, "Checkpoint"),
        "delayed_scale": Check(ch13.check_delayed_scale, "update_delayed_scale"),
        "mx_quantize": Check(ch13.check_mx_quantize),
    }
    wrong = [
        Wrong("checkpoint", RestoresWithoutFork, "rewinds the global RNG, no fork_rng",
              says="fork_rng"),
        Wrong("checkpoint", NoRngRestore, "a fresh dropout mask in the recompute",
              says="same mask"),
        Wrong("checkpoint", KeepsGraph, "saves the output too", says="only the input"),
        Wrong("checkpoint", ReseedsInitialSeed, "reseeds with torch.initial_seed(), no saved state",
              says="reseed"),
        Wrong("checkpoint", ReseedsSameSeed, "seeds forward and recompute with the same seed",
              says="reseed"),
        Wrong("checkpoint", OneGradient, "backward returns one gradient for two inputs",
              says="raised RuntimeError"),
        Wrong("delayed_scale", _scale_only, "returns only the scale",
              says="return a pair"),
        Wrong("delayed_scale", _per_entry_scale, "a scale per history entry",
              says="should be one number"),
        Wrong("mx_quantize", _float32_values, "values left in float32",
              says="should be a tensor of dtype"),
        Wrong("mx_quantize", lambda x: None, "returns None", says="should return"),
        Wrong("delayed_scale", _current_scaling, "current scaling instead of the history",
              says="scale should be"),
        Wrong("delayed_scale", _no_margin, "forgets the margin", says="margin=1"),
        Wrong("delayed_scale", _no_zero_guard, "an all-zero history divides by zero",
              says="keep the previous scale"),
        Wrong("delayed_scale", _no_roll, "history not rolled", says="history should be"),
        Wrong("mx_quantize", _one_scale, "one scale per tensor", says="per-tensor scaling"),
        Wrong("mx_quantize", _not_power_of_two, "scales not powers of two",
              says="powers of two"),
        Wrong("mx_quantize", _rounded_exponent, "rounds the exponent instead of flooring",
              says="expected"),
        Wrong("mx_quantize", _no_clamp, "no saturation before the cast (torch's cast clamps)",
              says="reached the cast to E4M3 unclamped"),
        Wrong("mx_quantize", _no_clamp_copy, "no saturation, cast by copy_ into FP8",
              says="reached the cast to E4M3 unclamped"),
        Wrong("mx_quantize", _course_mx, "the course's mx_quantize", says="course's own answer"),
        Wrong("mx_quantize", _course_block_quantize, "the course's block_quantize",
              says="course's own answer"),
        Wrong("delayed_scale", _course_delayed, "the course's update_delayed_scale",
              says="course's own answer"),
    ]
    right = [Right("mx_quantize", _where_clamp, "saturation written with torch.where"),
             Right("checkpoint", RngStateSaved, "the RNG state kept with save_for_backward")]
