"""The example ledger: which examples every rank trained on, counted across all ranks.

Data parallelism is right only if the ranks' batches are disjoint slices of one
global batch, every example of the epoch used once, and a resumed or resized job
continues at the exact next example. None of this shows in the loss: N ranks that
train on one and the same batch produce a smooth loss curve (with the noise of a
batch N times smaller than the one the learning rate was tuned for), and a
resume that replays half an epoch looks like a slightly lucky stretch.

The detector is bookkeeping. Each rank records the ids of the examples it
consumed (``ExampleLedger.record``, one small integer tensor per step); at the
end of an epoch, or at a checkpoint, the ranks all-gather their ledgers
(``gather_ids``: sizes first, since ranks may hold different numbers, then one
padded all-gather) and ``audit`` counts, over the union of every ledger given
(ranks of this job, the job before a resume, a job of another world size):

* duplicates: uses beyond the first (consumed - distinct). A padding repeat of
  ``DistributedSampler`` (it pads the epoch to a multiple of the world size with
  the first indices again unless ``drop_last``), a replayed step, a shard two
  ranks share: each is one extra use;
* gaps: ids of the epoch never used (a skipped step, a tail re-dealt away);
* cross-rank ids: used on more than one rank (shards overlap: every rank seeded
  the same gives every id on all N ranks).

Cost: 8 bytes per example per rank, one all-gather of the ids per audit (an
epoch of 10^6 examples is 8 MB), and one bincount. Cheap enough to leave on.

How production differs: ``torch.utils.data.DistributedSampler`` deals the
indices ``indices[rank::num_replicas]`` of one permutation seeded with
``seed + epoch``, pads with repeats unless ``drop_last``, and keeps no record;
``set_epoch`` only changes the seed. torchdata's ``StatefulDataLoader`` saves how
many batches a loader yielded and fast-forwards by that many on load, and its
``StatefulDistributedSampler`` saves the count of indices this rank yielded; the
state is per rank ("not across ranks", its documentation), so nothing checks
that a job of another world size continues where the old one stopped: it skips
that many of its *new* slice. Megatron-LM's ``MegatronPretrainingSampler`` takes
``consumed_samples``, a count of global samples, and starts each rank from it, a
position that means the same on any data-parallel size (the course's
``ShardedSampler`` counts global batches for the same reason). A count is not a
record: it cannot say which examples were used; the ledger can.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist

from helpers.comm import world_size
from helpers.launch.info import rank_device

__all__ = ["ExampleLedger", "LedgerAudit", "gather_ids", "audit", "audit_on_ranks",
           "same_order"]


class ExampleLedger:
    """The ids of the examples one rank consumed, step by step."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def record(self, ids) -> None:
        self.steps.append(torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu())

    def ids(self) -> torch.Tensor:
        """Every id this rank consumed, in order, (n,) int64."""
        if not self.steps:
            return torch.empty(0, dtype=torch.long)
        return torch.cat(self.steps)

    def __len__(self) -> int:
        return sum(s.numel() for s in self.steps)


def gather_ids(ids, group=None) -> list[torch.Tensor]:
    """Every rank's ids, in rank order, on every rank (CPU tensors). Collective.

    Ranks may have consumed different numbers of examples (uneven shards, a
    padded last step), and an all-gather needs one size: exchange the sizes
    first, pad to the largest, gather, cut each rank's ids back to its size.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if world_size(group) == 1:
        return [ids.cpu()]
    dev = rank_device()
    n = torch.tensor([ids.numel()], dtype=torch.long, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(world_size(group))]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.full((max(longest, 1),), -1, dtype=torch.long, device=dev)
    buf[:ids.numel()] = ids.to(dev)
    out = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(out, buf, group=group)
    return [o[:int(s.item())].cpu() for o, s in zip(out, sizes)]


@dataclasses.dataclass
class LedgerAudit:
    """What the ledgers say about one epoch of ``num_samples`` examples."""

    num_samples: int
    consumed: int            # uses, all ledgers together
    distinct: int            # ids used at least once
    duplicates: int          # consumed - distinct: uses beyond the first
    gaps: int                # ids of the epoch never used
    cross_rank: int          # ids used by more than one ledger
    counts: list[int]        # uses of each id, 0 .. num_samples-1
    owners: list[list[int]]  # the ledgers (ranks) that used each id

    @property
    def clean(self) -> bool:
        return self.duplicates == 0 and self.gaps == 0

    def summary(self) -> str:
        return (f"{self.consumed} uses of {self.num_samples} ids: {self.duplicates} duplicates, "
                f"{self.gaps} gaps, {self.cross_rank} ids on more than one rank")


def audit(ledgers: Sequence, num_samples: int) -> LedgerAudit:
    """Count duplicates, gaps and shared ids over ``ledgers`` (one id tensor per rank,
    or per rank and phase: the job before a resume and the one after)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be positive, got {num_samples}")
    ledgers = [torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu() for ids in ledgers]
    for r, ids in enumerate(ledgers):
        if ids.numel() and (ids.min() < 0 or ids.max() >= num_samples):
            raise ValueError(f"ledger {r} holds id {int(ids.min() if ids.min() < 0 else ids.max())}"
                             f", outside the epoch's ids 0 .. {num_samples - 1}")
    counts = torch.zeros(num_samples, dtype=torch.long)
    owners: list[list[int]] = [[] for _ in range(num_samples)]
    for r, ids in enumerate(ledgers):
        counts += torch.bincount(ids, minlength=num_samples)
        for i in torch.unique(ids).tolist():
            owners[i].append(r)
    consumed, distinct = int(counts.sum()), int((counts > 0).sum())
    return LedgerAudit(num_samples, consumed, distinct, consumed - distinct,
                       num_samples - distinct, sum(len(o) > 1 for o in owners),
                       counts.tolist(), owners)


def audit_on_ranks(ids, num_samples: int, group=None) -> LedgerAudit:
    """``audit`` of every rank's ``ids`` (all-gathered), the same on every rank. Collective."""
    return audit(gather_ids(ids, group), num_samples)


def same_order(first, second) -> float:
    """Share of positions where two epochs' orders hold the same id: 1.0 when the
    sampler replays its order (``set_epoch`` forgotten), about 1/N for two shuffles."""
    a = torch.as_tensor(first).reshape(-1)
    b = torch.as_tensor(second).reshape(-1)
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0.0
    return float((a[:n] == b[:n]).float().mean())
