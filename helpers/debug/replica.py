"""Are the data-parallel replicas still the same model? Checksums across ranks.

What
----
Data parallelism rests on one invariant: after every step, every replica holds
bit-for-bit the same parameters and optimizer state. Nothing checks it during
training. When it breaks, the job does not crash: the replicas drift apart,
the loss of rank 0 (the only one logged) looks fine, and the checkpoint that
rank 0 writes is not the model the other ranks trained. Causes seen in
practice:

* a non-deterministic or rank-dependent update: clipping with a *local*
  gradient norm, a random number drawn on each rank without a shared seed,
  an optimizer step skipped on one rank (a NaN check that looked at local
  gradients);
* silent data corruption: a bit flipped in memory or in an arithmetic unit,
  which no error reports. Fleet studies at Meta (Dixit et al. 2021, "Silent
  Data Corruptions at Scale", arXiv:2102.11245) and Google (Hochschild et
  al. 2021, "Cores that don't count", HotOS) find such "mercurial" cores at
  a rate of a few per several thousand machines: a large job meets one.

``check_replicas(model, optimizer)`` computes, on every rank, an exact
fingerprint of every parameter (and every optimizer-state tensor), gathers
them with one ``all_gather`` and compares: the odd rank is named against the
majority (on a tie, against the group holding the lowest rank), and the first
tensor that differs is named in registration order, with how many elements
differ and by how much (one ``broadcast`` of that tensor from a majority rank).

The fingerprint of a tensor is two int64 sums over its bytes, seen as
integers: the plain sum and the sum weighted by position. Any single flipped
bit changes a byte by +-2^k, so it changes the plain sum (exactly: integer
arithmetic, no rounding); the weighted sum also catches two values swapped.
It is a checksum, not a cryptographic hash: two different corruptions could
cancel, which is no concern for a bit flip or a drift.

Cost: one pass over the state (as reading it once) and an all-gather of
2 x (number of tensors) int64 per rank; run it every N steps, not every step.

How production differs
----------------------
Large jobs compare replicas rarely and cheaply in the same spirit: Megatron-LM
can check that the gradients of data-parallel replicas agree
(``--check-weight-hash-across-dp-replicas-interval``) and re-runs a step to
tell a faulty GPU from a real spike (``--rerun-mode``); others compare loss
or gradient-norm reports across ranks every step. Detection then triggers
the removal of the faulty node and a restart from the last checkpoint.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["fingerprint", "named_state", "local_fingerprints", "ReplicaReport", "check_replicas",
           "flip_bit"]


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bytes (plain, position-weighted): shape [2]."""
    b = t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)  # [bytes]
    pos = torch.arange(1, b.numel() + 1, dtype=torch.int64, device=b.device)
    return torch.stack([b.sum(), (b * pos).sum()])  # int64 wraps around: still exact


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                ) -> list[tuple[str, torch.Tensor]]:
    """Parameters in registration order, then each parameter's optimizer state
    (``optimizer[<param name>].exp_avg`` ...), skipping non-tensor entries."""
    out = [(name, p) for name, p in model.named_parameters()]
    if optimizer is not None:
        name_of = {p: name for name, p in model.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in sorted(optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        out.append((f"optimizer[{name_of.get(p, '?')}].{key}", value))
    return out


@dataclasses.dataclass
class ReplicaReport:
    """``ok``; else ``rank`` and ``name`` of the first difference, ``ranks``
    every rank that differs somewhere, and ``text`` says it."""

    ok: bool
    rank: int | None = None
    name: str | None = None
    ranks: list[int] = dataclasses.field(default_factory=list)
    n_different: int = 0
    max_abs_diff: float = 0.0
    text: str = "all replicas identical"


def _majority(rows: list[tuple]) -> tuple:
    """The most common row; on a tie, the one of the lowest rank."""
    counts = {row: rows.count(row) for row in rows}
    best = max(counts.values())
    return next(row for row in rows if counts[row] == best)


def local_fingerprints(state: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """This rank's fingerprints of ``state`` (``named_state``): int64 [tensors, 2],
    on the device of the first tensor (the first parameter: CUDA on a GPU node,
    where nccl moves only CUDA tensors); empty and on the CPU without state.

    Each tensor is fingerprinted where it lives and its two sums move: AdamW
    keeps its ``step`` count on the CPU next to CUDA moments, and stacking
    fingerprints from both devices would fail."""
    if not state:
        return torch.zeros(0, 2, dtype=torch.int64)
    device = state[0][1].device
    return torch.stack([fingerprint(t).to(device) for _, t in state])


def check_replicas(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   group=None) -> ReplicaReport:
    """Compare every rank's parameters (and optimizer state) in ``group``; the
    same report on every rank. Collective: every rank of the group must call it.
    Everything it sends lives on the fingerprints' device (``local_fingerprints``),
    a CPU ``step`` among CUDA parameters included."""
    state = named_state(model, optimizer)
    mine = local_fingerprints(state)                                 # [tensors, 2]
    device = mine.device
    world = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = [tuple(map(tuple, g.tolist())) for g in gathered]        # per rank
    ref = _majority(rows)
    odd = [i for i, row in enumerate(rows) if row != ref]
    if not odd:
        return ReplicaReport(ok=True)
    first = min(odd, key=lambda i: next(k for k in range(len(ref)) if rows[i][k] != ref[k]))
    index = next(k for k in range(len(ref)) if rows[first][k] != ref[k])
    name, tensor = state[index]
    # How far off: the majority's copy, from the first rank that holds it.
    src = ranks[rows.index(ref)]
    ours = tensor.detach().to(device)
    theirs = ours.clone()
    dist.broadcast(theirs, src, group=group)
    diff = torch.zeros(2, dtype=torch.float64, device=device)
    if dist.get_rank() == ranks[first]:
        bad = ours != theirs
        delta = (ours.double() - theirs.double()).abs()
        diff = torch.tensor([bad.sum().item(), delta.max().item() if bad.any() else 0.0],
                            dtype=torch.float64, device=device)
    dist.broadcast(diff, ranks[first], group=group)
    n_bad, max_diff = int(diff[0]), float(diff[1])
    agree = [ranks[i] for i in range(world) if rows[i] == ref]
    text = (f"rank {ranks[first]} diverged first at {name}: {n_bad} of {tensor.numel()} "
            f"element(s) differ from rank(s) {agree}, max |difference| {max_diff:.3g}")
    if len(odd) > 1:
        text += f" (ranks that differ somewhere: {[ranks[i] for i in odd]})"
    return ReplicaReport(False, ranks[first], name, [ranks[i] for i in odd], n_bad, max_diff, text)


def flip_bit(t: torch.Tensor, index: int = 0, bit: int = 22) -> None:
    """Silent data corruption, planted: flip one bit of element ``index`` of
    ``t`` in place (bit 22 of a float32 is the top mantissa bit: the value
    changes by up to 50%, and no error is raised)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    with torch.no_grad():
        flat = t.view(-1).view(ints)
        flat[index] ^= 1 << bit
