"""Lab 13 checks: pass on the solution, fail on the lab's stub and on plausible mistakes."""

import pytest
import torch

from helpers.checks import CheckFailed
from helpers.checks import ch13
from tools.nbtool import exercise

SOL = "solutions/13_recompute_and_precision_solution.ipynb"
LAB = "labs/13_recompute_and_precision_lab.ipynb"
CASES = [("Checkpoint", ch13.check_checkpoint),
         ("update_delayed_scale", ch13.check_delayed_scale)]


@pytest.mark.parametrize("name, check", CASES)
def test_solution_passes(name, check, capsys):
    check(exercise(SOL, name))
    assert capsys.readouterr().out.startswith("✓")


@pytest.mark.parametrize("name, check", CASES)
def test_lab_stub_fails(name, check):
    with pytest.raises(CheckFailed, match="not implemented yet"):
        check(exercise(LAB, name))


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


def test_checkpoint_without_fork_rng_fails():
    with pytest.raises(CheckFailed, match="fork_rng"):
        ch13.check_checkpoint(RestoresWithoutFork)


def test_checkpoint_without_rng_restore_fails():
    with pytest.raises(CheckFailed, match="same mask"):
        ch13.check_checkpoint(NoRngRestore)


def test_checkpoint_keeping_too_much_fails():
    with pytest.raises(CheckFailed, match="only the input"):
        ch13.check_checkpoint(KeepsGraph)


def test_current_scaling_instead_of_history_fails():
    def current(hist, new_amax, scale, fp8_max, margin=0):
        hist = torch.roll(hist, 1)
        hist[0] = new_amax
        return hist, torch.tensor(fp8_max / new_amax / 2 ** margin if new_amax else scale)
    with pytest.raises(CheckFailed, match="scale should be"):
        ch13.check_delayed_scale(current)


def test_forgetting_margin_fails():
    good = exercise(SOL, "update_delayed_scale")
    with pytest.raises(CheckFailed, match="margin=1"):
        ch13.check_delayed_scale(lambda h, a, s, m, margin=0: good(h, a, s, m, 0))


def test_history_not_rolled_fails():
    def no_roll(hist, new_amax, scale, fp8_max, margin=0):
        hist = hist.clone()
        hist[0] = new_amax
        return hist, torch.as_tensor(fp8_max / hist.max() / 2 ** margin if hist.max() else scale)
    with pytest.raises(CheckFailed, match="history should be"):
        ch13.check_delayed_scale(no_roll)


def _one_scale(x):  # per-tensor current scaling: one scale for everything
    from helpers.precision import E4M3, fp8_scale, quantize
    s = fp8_scale(x.abs().max(), E4M3)
    return quantize(x, E4M3, s), s.reshape(1)


def _not_power_of_two(x):  # per-block fp8_max/amax: DeepSeek-style, not MX
    from helpers.precision import E4M3, block_quantize
    return block_quantize(x, E4M3, (1, 32), power_of_two=False)


def _rounded_exponent(x):  # round(log2 amax) instead of floor: half the scale for amax >= 1.41 x 2^k
    R, C = x.shape
    b = x.float().reshape(R, C // 32, 32)
    amax = b.abs().amax(-1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    s = torch.where(amax > 0, torch.exp2(8 - torch.round(torch.log2(safe))), torch.ones_like(amax))
    return (b * s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(R, C), s


def test_mx_quantize_check(capsys):
    ch13.check_mx_quantize(exercise(SOL, "mx_quantize"))
    assert "✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="not implemented"):
        ch13.check_mx_quantize(exercise(LAB, "mx_quantize"))
    with pytest.raises(CheckFailed, match="per-tensor scaling"):
        ch13.check_mx_quantize(_one_scale)
    with pytest.raises(CheckFailed, match="powers of two"):
        ch13.check_mx_quantize(_not_power_of_two)
    with pytest.raises(CheckFailed, match="expected"):
        ch13.check_mx_quantize(_rounded_exponent)
