"""A synthetic language whose best possible loss is known exactly.

Real text makes "is the model learning?" a matter of opinion. Here the data
come from a first-order Markov chain over ``vocab_size`` tokens with a seeded,
peaked transition matrix P (each row drawn from a Dirichlet distribution with
a small concentration, so each token has a few likely successors).

Sequences start in the chain's stationary distribution pi, so every position
has the same statistics. A model that sees the previous token can do no better
than the chain's *entropy rate*

    H = - sum_i pi_i sum_j P_ij log P_ij      (nats per token)

and a GPT with any context length can reach it. So a notebook can print
"loss 1.83, optimum H = 1.79 nats" and mean it.

Devices: the tokens are generated and kept on the CPU (the same values on
every machine); ``MarkovDataset.batch`` hands a rank its batch on the rank's
device.

Sharding: ``ShardedSampler`` cuts each *global* batch into ``world_size``
contiguous slices, rank r taking slice r. The concatenation of the ranks'
batches is the global batch, so a single-process reference that trains on the
global batch sees exactly the same examples. Its position (epoch, step) is
its whole state, so a resumed run continues at the exact next example.
"""

from __future__ import annotations

import dataclasses

import torch

from helpers.launch.info import rank_device

__all__ = ["MarkovSource", "MarkovDataset", "ShardedSampler", "make_dataset"]


@dataclasses.dataclass
class MarkovSource:
    vocab_size: int = 64
    concentration: float = 0.1   # Dirichlet alpha: small -> peaked rows -> low entropy
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.concentration <= 0:
            raise ValueError(f"concentration must be > 0, got {self.concentration}")
        g = torch.Generator().manual_seed(self.seed)
        alpha = torch.full((self.vocab_size,), float(self.concentration), dtype=torch.float64)
        # Dirichlet via normalized Gamma draws, from our own seeded generator.
        gam = torch._standard_gamma(alpha.expand(self.vocab_size, -1).contiguous(), generator=g)
        gam = gam + 1e-12  # a row of exact zeros would be undefined
        self.transition = gam / gam.sum(dim=1, keepdim=True)  # (V, V), rows sum to 1
        self.stationary = _stationary(self.transition)

    def entropy_rate(self) -> float:
        """H in nats per token: the lowest loss any next-token model can reach."""
        P = self.transition
        row_entropy = -(P * torch.where(P > 0, P.log(), torch.zeros_like(P))).sum(dim=1)
        return float((self.stationary * row_entropy).sum())

    def sample(self, num_sequences: int, length: int, seed: int) -> torch.Tensor:
        """``num_sequences`` chains of ``length`` tokens, (N, length) int64."""
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(num_sequences, length, dtype=torch.long)
        out[:, 0] = torch.multinomial(self.stationary.float(), num_sequences, True, generator=g)
        P = self.transition.float()
        for t in range(1, length):  # sequential in t, vectorized over the N chains
            out[:, t] = torch.multinomial(P[out[:, t - 1]], 1, generator=g).squeeze(1)
        return out


def _stationary(P: torch.Tensor) -> torch.Tensor:
    """pi with pi P = pi, by power iteration (P is dense and positive)."""
    pi = torch.full((P.size(0),), 1.0 / P.size(0), dtype=P.dtype)
    for _ in range(10_000):
        nxt = pi @ P
        if torch.allclose(nxt, pi, atol=1e-15, rtol=0):
            break
        pi = nxt
    return nxt / nxt.sum()


class MarkovDataset(torch.utils.data.Dataset):
    """A fixed set of sequences: item i is (x, y) with y = x shifted by one."""

    def __init__(self, source: MarkovSource, num_sequences: int, seq_len: int, seed: int = 1):
        if num_sequences < 1 or seq_len < 1:
            raise ValueError("num_sequences and seq_len must be positive")
        self.source, self.seq_len = source, seq_len
        self.tokens = source.sample(num_sequences, seq_len + 1, seed)  # (N, T+1)

    def __len__(self) -> int:
        return self.tokens.size(0)

    def __getitem__(self, i):
        row = self.tokens[i]
        return row[:-1], row[1:]

    def batch(self, indices, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (len(indices), seq_len), on ``device``: gathers rows in one
        indexing op. ``device=None`` is the calling rank's (``rank_info().device``;
        the CPU outside a launch): the data set lives on the CPU, the batch a rank
        trains on goes where its model is."""
        rows = self.tokens[torch.as_tensor(indices, dtype=torch.long, device="cpu")]
        rows = rows.to(rank_device(device))
        return rows[:, :-1], rows[:, 1:]


def make_dataset(vocab_size: int = 64, seq_len: int = 32, num_sequences: int = 4096,
                 seed: int = 0) -> MarkovDataset:
    """The course's default data: a toy-GPT-sized Markov language."""
    return MarkovDataset(MarkovSource(vocab_size=vocab_size, seed=seed), num_sequences, seq_len,
                         seed=seed + 1)


class ShardedSampler:
    """Yields this rank's indices for each step; resumable at an exact step.

    Step s of epoch e uses global positions [s*G, (s+1)*G) of a permutation
    drawn from ``seed + e`` (G = batch_size * world_size), and rank r takes
    the r-th slice of ``batch_size``. ``drop_last``: a tail shorter than G is
    skipped, so every step has the same global batch.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if batch_size * world_size > num_samples:
            raise ValueError(f"global batch {batch_size} x {world_size} ranks is larger than "
                             f"the dataset ({num_samples} samples)")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.epoch, self.step = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // (self.batch_size * self.world_size)

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples,
                              generator=torch.Generator().manual_seed(self.seed + epoch))

    def global_indices(self, epoch: int, step: int) -> torch.Tensor:
        """The whole global batch of (epoch, step), all ranks' slices in rank order."""
        G = self.batch_size * self.world_size
        return self._order(epoch)[step * G:(step + 1) * G]

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        glob = self.global_indices(self.epoch, self.step)
        self.step += 1
        b = self.batch_size
        return glob[self.rank * b:(self.rank + 1) * b]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
