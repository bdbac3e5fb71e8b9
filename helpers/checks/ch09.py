"""Checks for chapter 09: parallelize one transformer block; the vocab-parallel loss.

The learner writes ``parallelize_block(block, group)``, returning a copy of a
course ``Block`` whose attention and MLP are split over ``group`` with
``helpers.tp``'s layers (QKV column-parallel by heads, attention output and
MLP down projection row-parallel, MLP up projection column-parallel) and the
LayerNorms left whole.

The check runs it on 4 ranks split into two tensor-parallel groups of 2, ranks [0, 2]
and [1, 3] (so a rank's index in its group is not its rank in the job), each group with
its own input, in float64 against the dense block in the same process: output, input
gradient, every parameter gradient (gathered with ``helpers.tp.gather_dense``), the
bytes of parameters each rank holds, and every collective the block calls, seen by the
checks' spy: 2 all-reduces forward and 2 backward (Shoeybi et al. 2019, sec. 3), and
nothing else. Numbers alone would pass an MLP that all-gathers its 4h activation and
splits it again (``gather_output=True`` then ``input_is_parallel=False``): right values,
two extra collectives of the largest activation per step. Float64 on both sides differs
only by summation order (~1e-16 relative); the check allows 1e-9, every named mistake is
off by O(1).
"""

from __future__ import annotations

import contextlib

import torch

from helpers.checks import CheckFailed, on_ranks, passed
from helpers.checks.course_answers import CourseAnswerUsed

REL = 1e-9  # float64, only the summation order differs
BLOCK_WORLD, BLOCK_LAYOUT = 4, [[0, 2], [1, 3]]   # two TP groups of 2, strided
# the chapter's one-line answers to exercise 1 (helpers/checks/course_answers.py)
COURSE_BLOCK = ["helpers.tp.transformer.tensor_parallel_block",
                "helpers.tp.transformer.torch_tp_block",
                "helpers.tp.transformer.tensor_parallel_gpt"]


@contextlib.contextmanager
def _attention_layers_required():
    """While the learner's block is built, ``ParallelSelfAttention`` without ``c_attn=``
    or ``c_proj=`` raises: its defaults split QKV by heads and the output projection by
    input, which is the exercise's second question answered for the learner. (The class's
    ``__init__`` is swapped, so a name imported before the check is caught as well.)"""
    from helpers.tp import ParallelSelfAttention

    original = ParallelSelfAttention.__init__

    def init(self, dense, group=None, c_attn=None, c_proj=None):
        missing = [name for name, layer in (("c_attn", c_attn), ("c_proj", c_proj))
                   if layer is None]
        if missing:
            raise CourseAnswerUsed(
                f"parallelize_block built ParallelSelfAttention without "
                f"{' and '.join(f'{m}=' for m in missing)}: its defaults split the "
                f"projections for you, switched off in this check. Build them yourself: "
                f"which split keeps each head's q, k and v on one rank (QKV), and which "
                f"takes the heads' outputs split (the output projection)?")
        original(self, dense, group, c_attn=c_attn, c_proj=c_proj)

    ParallelSelfAttention.__init__ = init
    try:
        yield
    finally:
        ParallelSelfAttention.__init__ = original


def _close(a, b) -> bool:
    return a is not None and a.shape == b.shape and \
        (a - b).abs().max().item() <= REL * max(b.abs().max().item(), 1.0)


def _run_block(parallelize_block):
    import copy

    from helpers.checks.course_answers import refusing
    from helpers.checks.spy import communication_spy
    from helpers.checks.groups import split_world
    from helpers.model import GPTConfig, build_model
    from helpers.tp import count_collectives, gather_dense

    group, index, members = split_world(BLOCK_LAYOUT)
    t = len(members)
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=4, n_embd=16)
    block = build_model(cfg, seed=0).blocks[0].double()
    with torch.no_grad():  # non-zero biases and LayerNorm affines
        gen = torch.Generator().manual_seed(1)
        for p in block.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    dense = copy.deepcopy(block)
    # each group its own input: a collective that ignores group= mixes the other's in
    gen = torch.Generator().manual_seed(10 + index)
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=gen)
    dy = torch.randn(2, 8, 16, dtype=torch.float64, generator=gen)
    try:
        with refusing(COURSE_BLOCK, "parallelize_block",
                      "build the block from the split layers yourself"), \
                _attention_layers_required():
            tp = parallelize_block(block, group)
    except CourseAnswerUsed as exc:
        return {"refused": str(exc)}
    xi = x.clone().requires_grad_()
    with communication_spy(keep_values=False) as spy, count_collectives() as counter:
        y = tp(xi)
        y.backward(dy)
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    yd.backward(dy)
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.parameters())
    split = sum(p.numel() * p.element_size() for n, p in dense.named_parameters()
                if n.endswith(("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias"))
                or n.endswith("c_proj.weight"))
    return dict(y=y.detach(), dx=xi.grad, grads=gather_dense(tp, grads=True),
                want=dict(y=yd.detach(), dx=xd.grad,
                          grads={n: p.grad for n, p in dense.named_parameters()}),
                bytes=sum(p.numel() * p.element_size() for p in tp.parameters()),
                want_bytes=dense_bytes - split + split // t, t=t, members=members,
                counts=(counter.count("all_reduce", "forward"),
                        counter.count("all_reduce", "backward")),
                collectives=list(spy.collectives),
                counted=[(c.op, c.layer, c.direction, c.nbytes) for c in counter.log],
                untouched=all(torch.equal(a, b) for a, b in
                              zip(block.parameters(), dense.parameters())))


_SHAPES = ("the shards' shapes do not chain: in Megatron's pairs the first layer is "
           "column-parallel (its output features split over ranks: QKV, MLP up) and the "
           "second row-parallel (its input features split: attention out, MLP down). "
           "Swapped, each rank's output does not fit the next layer's input")


def check_parallelize_block(parallelize_block) -> None:
    """4 ranks in two tensor-parallel groups of 2 ([0, 2] and [1, 3], each with its own
    input): a block with 4 heads, hidden 16, MLP 64, float64, vs the dense block.
    Mistakes it catches: q, k, v cut contiguously instead of by heads; a layer left
    dense (more parameter bytes than the split); the group ignored (split over all 4
    ranks: fewer bytes, and the groups' inputs mixed: named); the dense block modified;
    extra or missing all-reduces; any other collective, such as an MLP that all-gathers
    its 4h activation and splits it again (right numbers, counted and named); column-
    and row-parallel swapped in a pair (the shapes do not chain: named); the chapter's
    ``tensor_parallel_block`` in place of the exercise (refused by name);
    ``ParallelSelfAttention`` left to split its own projections (its defaults: refused)."""
    from helpers.model import Block, GPTConfig
    res = on_ranks(_run_block, BLOCK_WORLD, parallelize_block, what="parallelize_block",
                   probe=lambda: parallelize_block(Block(GPTConfig()), None),
                   hints={"cannot be multiplied": _SHAPES})
    if "refused" in res[0]:
        raise CheckFailed(res[0]["refused"])
    for rank, out in enumerate(res):
        w = out["want"]
        where = f"rank {rank} (group {out['members']})"
        if not out["untouched"]:
            raise CheckFailed(f"{where}: the dense block's weights changed; build the split "
                              f"layers from copies (from_dense copies) and leave `block` as it was")
        if out["bytes"] > out["want_bytes"]:
            raise CheckFailed(f"{where}: the block holds {out['bytes']:,} bytes of parameters; "
                              f"split over its group of {out['t']}, it should hold "
                              f"{out['want_bytes']:,} (1/{out['t']} of QKV, of both MLP matrices "
                              f"and of the output projection's weight). Is a layer still dense?")
        if out["bytes"] < out["want_bytes"]:
            raise CheckFailed(f"{where}: the block holds {out['bytes']:,} bytes of parameters, "
                              f"less than its share over its group of {out['t']} "
                              f"({out['want_bytes']:,}): the layers were split over more ranks "
                              f"than the group. Pass `group` to every split layer (without it "
                              f"they use the whole job)")
        if not _close(out["y"], w["y"]):
            raise CheckFailed(f"{where}: the block's output differs from the dense block's. "
                              f"QKV must be split by heads: each of q, k, v in t slices "
                              f"(ColumnParallelLinear.from_dense(..., parts=3)), and attention "
                              f"must run on this rank's n_head / t heads")
        if not _close(out["dx"], w["dx"]):
            raise CheckFailed(f"{where}: the input gradient differs from the dense block's")
        for name, g in w["grads"].items():
            if not _close(out["grads"].get(name), g):
                raise CheckFailed(f"{where}: the gradient of {name} (gathered) differs from "
                                  f"the dense block's")
        others = [c for c in out["collectives"] if c != "all_reduce"]
        if others:
            gathered = [f"{op} ({direction}, {layer}, {nbytes:,} bytes)"
                        for op, layer, direction, nbytes in out["counted"] if op != "all_reduce"]
            raise CheckFailed(
                f"{where}: the block called {', '.join(others)} besides its all-reduces"
                + (f": {'; '.join(gathered)}" if gathered else "")
                + ". The numbers are right, but a split layer whose output is gathered and "
                  "split again by the next one (gather_output=True, input_is_parallel=False) "
                  "moves the whole activation twice more per step. A column-parallel output "
                  "is exactly the input a row-parallel layer takes: pass it on split")
        if out["counts"] != (2, 2) or len(out["collectives"]) != 4:
            raise CheckFailed(f"{where}: {out['counts'][0]} all-reduces in forward and "
                              f"{out['counts'][1]} in backward ({len(out['collectives'])} "
                              f"collectives in all); a TP block has 2 and 2 (one g and one f "
                              f"each for attention and MLP)")
    passed("the split block equals the dense block in two groups of 2 ranks (output, input "
           "and weight gradients, float64), holds its share of the weights, and calls 2 + 2 "
           "all-reduces and nothing else")


# ---- exercise 2: the vocab-parallel cross-entropy ------------------------------------------

LOSS_WORLD = 4
LOSS_LAYOUT = [[0], [1, 2, 3]]  # a lone rank (t = 1) and a group of 3 that is not ranks 0..2
LOSS_CASES = ("groups", "world")  # LOSS_LAYOUT's groups, then the 4 ranks as one (t = 4)
LOSS_REL = 1e-9          # float64; the shifted log-sum-exp differs from torch's by rounding
TOKENS, VOCAB = 8, 12    # 12 vocabulary entries: 12, 4 or 3 per rank
# Megatron reduces three numbers per token (max, sum of exp, target logit); a little
# headroom for a learner who also reduces a count or the mean. The whole logits are
# TOKENS x VOCAB = 96 values: an all-reduce of them rebuilds the vocabulary.
REDUCED_LIMIT = 4 * TOKENS
_REDUCES = ("all_reduce", "reduce")   # every other operation moves logits (or is not needed)
COURSE_LOSS = ["helpers.tp.loss.vocab_parallel_cross_entropy"]


def _loss_case(vocab_parallel_loss, group, index):
    """This rank's slice of its group's logits, the learner's loss (collectives recorded
    and passed through), the reference on the whole logits."""
    import torch.distributed as dist
    import torch.nn.functional as F

    t, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(7 + index)   # each group its own logits
    logits = torch.randn(TOKENS, VOCAB, dtype=torch.float64, generator=gen)
    logits[1] += 1000.0          # exp overflows float64 (above ~709) unless shifted
    logits[2, 11] = 900.0        # the largest logit on the last rank's slice only
    logits[5] -= 1000.0          # underflows to 0 unless shifted
    targets = torch.tensor([3, 11, 0, -100, 7, 11, -100, 5])
    want = F.cross_entropy(logits, targets, ignore_index=-100)
    n = VOCAB // t
    shard = logits[:, r * n:(r + 1) * n].clone()
    from helpers.checks.spy import communication_spy

    with communication_spy(keep_values=False) as spy:   # every spelling, every collective
        got = vocab_parallel_loss(shard, targets.clone(), group)
    calls = [(c.op, c.nbytes // 8) for c in spy.calls]   # float64 / int64: 8 bytes a value
    return dict(got=got, want=want, calls=calls, t=t)


def _run_loss(vocab_parallel_loss):
    """Both cases on this rank, the course's own loss refused while the learner's runs."""
    import torch.distributed as dist

    from helpers.checks.course_answers import refusing
    from helpers.checks.groups import split_world
    split = split_world(LOSS_LAYOUT)
    out = {}
    try:
        with refusing(COURSE_LOSS, "vocab_parallel_loss", "reduce the three per-token "
                      "numbers yourself"):
            for case, (group, index, members) in zip(
                    LOSS_CASES, (split, (dist.group.WORLD, 0, list(range(LOSS_WORLD))))):
                out[case] = _loss_case(vocab_parallel_loss, group, index)
                out[case]["members"] = members
    except CourseAnswerUsed as exc:
        return {"refused": str(exc)}
    return out


def check_vocab_parallel_loss(vocab_parallel_loss) -> None:
    """4 ranks, in two tensor-parallel groups ([0] and [1, 2, 3], each with its own
    logits) and then as one group: 8 tokens over a 12-entry vocabulary in float64,
    against ``F.cross_entropy(whole logits, targets, ignore_index=-100)``. Mistakes it
    catches:

    * no max subtracted (a row of logits near 1000 overflows exp: inf or nan);
    * each rank subtracting its own max (the shifts disagree: wrong sum);
    * the target's logit looked up with the global id instead of the id minus this
      rank's first vocabulary entry (or on every rank instead of its owner's);
    * ignored tokens (-100) counted in the mean, or their logit looked up;
    * gathering the whole logits (all-gather), or rebuilding them with an all-reduce of
      a zero-padded (tokens, V) tensor, and computing the dense loss: refused, since the
      exercise is to never build the whole vocabulary on one rank (the all-reduced
      values are counted: three per token is what the loss needs);
    * collectives without ``group=`` (they sum over all 4 ranks: the loss is wrong in the
      groups, named), or the rank in the job taken for the rank in the group;
    * the course's own ``vocab_parallel_cross_entropy`` called: refused by name;
    * a result that is not a scalar tensor, or differs between ranks.
    """
    probe_logits = torch.zeros(2, 4, dtype=torch.float64)
    probe_targets = torch.zeros(2, dtype=torch.long)
    res = on_ranks(_run_loss, LOSS_WORLD, vocab_parallel_loss,
                   what=f"vocab_parallel_loss on {LOSS_WORLD} ranks",
                   probe=lambda: vocab_parallel_loss(probe_logits, probe_targets, None))
    if "refused" in res[0]:
        raise CheckFailed(res[0]["refused"])
    for case in LOSS_CASES:
        for rank, out in enumerate(r[case] for r in res):
            got, want, calls = out["got"], out["want"], out["calls"]
            where = (f"{LOSS_WORLD} ranks in one group, rank {rank}" if case == "world" else
                     f"the group {out['members']} of {LOSS_LAYOUT}, rank {rank}")
            gathers = sorted({name for name, _ in calls if name not in _REDUCES})
            if gathers:
                raise CheckFailed(f"{where}: vocab_parallel_loss called {gathers}: that "
                                  f"moves logits between ranks (a gather rebuilds the whole "
                                  f"vocabulary on a rank). Reduce the three per-token numbers "
                                  f"instead (max, sum of exp, the target's logit) with "
                                  f"all_reduce")
            reduced = sum(n for name, n in calls if name in _REDUCES)
            if reduced > REDUCED_LIMIT:
                raise CheckFailed(f"{where}: vocab_parallel_loss all-reduced {reduced} values "
                                  f"per rank for {TOKENS} tokens; the loss needs three numbers "
                                  f"per token ({3 * TOKENS}). An all-reduce of a (tokens, V) "
                                  f"tensor ({TOKENS * VOCAB} values) rebuilds the whole logits "
                                  f"on every rank, which is what the vocab-parallel loss avoids")
            if not isinstance(got, torch.Tensor) or got.numel() != 1:
                raise CheckFailed(f"{where}: return the mean loss as a one-element tensor, got "
                                  f"{got!r}")
            if not torch.isfinite(got).all():
                raise CheckFailed(f"{where}: the loss is {got.item()}: a row of logits near "
                                  f"1000 overflows exp. Subtract the max over the *whole* "
                                  f"vocabulary (all-reduce with MAX) before exp")
            if abs(got.item() - want.item()) > LOSS_REL * max(abs(want.item()), 1.0):
                group_hint = ("" if case == "world" else
                              " In a group: pass group=group to every all_reduce (without it "
                              "the sums run over every rank of the job, other groups' logits "
                              "included), and take this rank's slice start from "
                              "tp_rank(group), its index in the group.")
                raise CheckFailed(
                    f"{where}: loss {got.item():.12g}, expected {want.item():.12g}. Check: the "
                    f"max is the global one (the same shift on every rank); the target's "
                    f"logit comes from the rank whose slice holds it, at id minus that "
                    f"slice's start, and is summed over ranks; tokens with target -100 are "
                    f"left out of the mean.{group_hint}")
    passed("vocab-parallel cross-entropy equals F.cross_entropy in groups of 1 and 3 ranks "
           f"and of {LOSS_WORLD}, with logits near ±1000 and ignored tokens, reducing three "
           "numbers per token and never gathering the logits")
