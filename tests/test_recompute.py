"""helpers.recompute: same gradients as no recompute (dropout on), fewer saved bytes."""

import pytest
import torch
import torch.utils.checkpoint as tuc

from helpers.memory import SavedTensorCounter, explain_saved_bytes
from helpers.model import Block, GPTConfig, build_model
from helpers.recompute import (Checkpoint, apply_recompute, checkpoint, remove_recompute,
                               segment_bounds, sqrt_segments)

B, T = 2, 16


def _run(mode, **kw):
    model = build_model("tiny", dropout=0.1)          # 4 blocks: segments differ from full
    apply_recompute(model, mode, **kw)
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)
    torch.manual_seed(123)                             # dropout's stream
    with SavedTensorCounter(model) as counter:
        _, loss = model(idx, tgt)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return model, loss.detach(), grads, counter


@pytest.fixture(scope="module")
def reference():
    return _run("none")


@pytest.mark.parametrize("mode, kw", [("selective", {}), ("full", {}), ("segments", {}),
                                      ("segments", {"segments": 3})])
def test_gradients_bitwise_equal_with_dropout(reference, mode, kw):
    _, loss, grads, _ = _run(mode, **kw)
    assert torch.equal(loss, reference[1])
    for name, g in reference[2].items():
        assert torch.equal(grads[name], g), name     # same ops, same masks: exact


def test_saved_bytes_drop_as_predicted(reference):
    model, _, _, none = reference
    cfg, e = model.config, 4                           # fp32
    s, b, h, a, L = T, B, cfg.n_embd, cfg.n_head, cfg.n_layer
    explained = explain_saved_bytes(cfg, B, T, torch.float32)
    assert none.total_bytes == sum(t.nbytes for t in explained)
    # selective: attention's score-sized tensors go (softmax out, dropout mask,
    # dropped probs: Korthikanti's 5as^2b, here 3 x a s^2 b x 4 bytes) and the
    # s x s causal mask; q, k, v copies (3 sbh) are replaced by the c_attn output (3 sbh).
    sel = _run("selective")[3]
    assert none.total_bytes - sel.total_bytes == L * (3 * a * s * s * b * e + s * s)
    # full: each block keeps its input only (Korthikanti's 2sbh per layer)
    full = _run("full")[3]
    outside = sum(t.nbytes for t in explained if not t.module.startswith("blocks."))
    assert full.total_bytes == outside + L * s * b * h * e
    # segments of 2: two checkpointed inputs instead of four
    seg = _run("segments", segments=2)[3]
    assert seg.total_bytes == outside + 2 * s * b * h * e
    # the recompute itself re-saves one block's (one segment's) internals in backward
    assert full.peak_bytes > full.total_bytes and seg.peak_bytes > full.peak_bytes


def test_matches_torch_utils_checkpoint():
    cfg = GPTConfig(dropout=0.2)
    block = Block(cfg).train()
    x = torch.randn(B, T, cfg.n_embd, requires_grad=True)
    outs = []
    for fn in (lambda: checkpoint(block, x),
               lambda: tuc.checkpoint(block, x, use_reentrant=False)):
        torch.manual_seed(7)
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = fn()
        # .backward(), not autograd.grad: a reentrant checkpoint hands parameter
        # gradients to .grad from its inner backward (torch's reentrant mode too)
        y.square().sum().backward()
        outs.append((y, x.grad, [p.grad for p in block.parameters()]))
    (y1, gx1, gp1), (y2, gx2, gp2) = outs
    assert torch.equal(y1, y2) and torch.equal(gx1, gx2)
    assert all(torch.equal(a, b) for a, b in zip(gp1, gp2))


def test_without_rng_restore_dropout_differs():
    cfg = GPTConfig(dropout=0.5)
    block = Block(cfg).train()
    x = torch.randn(B, T, cfg.n_embd, requires_grad=True)
    torch.manual_seed(0)
    ref = torch.autograd.grad(block(x).sum(), x)[0]
    torch.manual_seed(0)
    good = torch.autograd.grad(checkpoint(block, x).sum(), x)[0]
    torch.manual_seed(0)
    bad = torch.autograd.grad(checkpoint(block, x, preserve_rng_state=False).sum(), x)[0]
    assert torch.equal(good, ref) and not torch.allclose(bad, ref)


def test_checkpoint_saves_only_inputs_and_caller_rng_untouched():
    cfg = GPTConfig(dropout=0.1)
    block = Block(cfg).train()
    x = torch.randn(B, T, cfg.n_embd, requires_grad=True)
    with SavedTensorCounter(block) as c:
        y = Checkpoint.apply(block, True, x)
    assert c.total_bytes == x.nbytes
    torch.manual_seed(3)
    y.sum().backward()
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(1))          # recompute ran in a forked RNG


def test_remove_recompute_restores_model():
    model = build_model("toy")
    keys = list(model.state_dict())
    apply_recompute(model, "full")
    assert "forward" in model.blocks[0].__dict__ and list(model.state_dict()) == keys
    remove_recompute(model)
    assert "forward" not in model.blocks[0].__dict__


def test_segments_pure_functions_and_errors():
    assert segment_bounds(5, 2) == [(0, 3), (3, 5)]
    assert segment_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [sqrt_segments(n) for n in (1, 4, 10, 16, 24)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"segments must be an int in \[1, 4\]"):
        segment_bounds(4, 5)
    with pytest.raises(ValueError, match="unknown recompute mode"):
        apply_recompute(build_model("toy"), "half")
    with pytest.raises(ValueError, match="needs attention='manual'"):
        apply_recompute(build_model("toy", attention="sdpa"), "selective")
