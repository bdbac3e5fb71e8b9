"""helpers.unit_gather, the gather/free core of ZeRO-3 and FSDP, on its own.

The end-to-end checks (a stage-3 or FSDP run equals AdamW on the global
batch; the weights are freed outside forward and backward; a module that
returns a tuple) are in test_zero.py and test_fsdp.py. Here the pieces they
share: a coalesced all-gather lands each unit's columns in its own buffer,
free waits for a gather in flight, and the hooks fire once per forward and
once per backward, whatever pytree the module returns.
"""

import torch
import torch.nn as nn

from helpers import launch, rank_info
from helpers.unit_gather import UnitBuffer, register_unit_hooks, start_gather


def _gather_two_units():
    """Rank r's chunk of unit A (chunk 2) holds 10 r + [0, 1], of unit B
    (chunk 3) 100 + 10 r + [0, 1, 2]: every element says where it came from."""
    r, n = rank_info().rank, rank_info().world_size
    a, b = UnitBuffer(torch.zeros(2 * n)), UnitBuffer(torch.zeros(3 * n))
    a.free(), b.free()
    out = {"freed": a.full.untyped_storage().nbytes()}
    chunks = [10.0 * r + torch.arange(2.0), 100 + 10.0 * r + torch.arange(3.0)]
    start_gather([a, b], chunks, None, n, name="all-gather A..B")  # one collective
    out["in_flight"] = a.pending is not None and a.pending is b.pending
    b.wait()  # waits for the shared gather and copies both units' columns
    out["landed"] = a.pending is None and b.pending is None
    out["a"], out["b"] = a.full.clone(), b.full.clone()
    start_gather([a], [chunks[0] + 0.5], None, n)
    a.free()  # a gather in flight: free waits for it first, then drops the storage
    out["freed_after_wait"] = a.full.untyped_storage().nbytes() == 0 and a.pending is None
    return out


def test_coalesced_gather_lands_each_unit_and_free_waits():
    for n, res in ((2, launch(_gather_two_units, 2)), (1, [_gather_two_units()])):
        for out in res:
            assert out["freed"] == 0
            assert out["in_flight"] and out["landed"] and out["freed_after_wait"]
            # exact: the gather only moves elements
            assert out["a"].tolist() == [10.0 * r + i for r in range(n) for i in range(2)]
            assert out["b"].tolist() == [100 + 10.0 * r + i for r in range(n) for i in range(3)]


class _Pair(nn.Module):
    """Returns a tuple, as nn.MultiheadAttention does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        return y, {"twice": 2 * y}


def test_hooks_fire_once_per_forward_and_backward_for_a_pytree_output():
    torch.manual_seed(0)
    m, calls = _Pair(), []
    handles = register_unit_hooks(
        m, before_forward=lambda args, kwargs: calls.append("gather (forward)"),
        after_forward=lambda: calls.append("free"),
        before_backward=lambda: calls.append("gather (backward)"))
    y, d = m(torch.randn(2, 3))
    assert calls == ["gather (forward)", "free"]
    (y.sum() + d["twice"].sum()).backward()  # two outputs reached: still one call
    assert calls == ["gather (forward)", "free", "gather (backward)"]
    with torch.no_grad():  # no backward follows: no backward hook
        m(torch.randn(2, 3))
    assert calls[3:] == ["gather (forward)", "free"]
    for h in handles:
        h.remove()
    m(torch.randn(2, 3))[0].sum().backward()
    assert len(calls) == 5  # removed: nothing fires
