"""Contaminated evaluation: evaluation sequences that are (near) copies of training data.

A validation loss means "how well the model does on data it has not seen" only if
it has not seen it. A copy of an evaluation example in the training data (a
benchmark quoted on a web page, a split made twice with different seeds) lets the
model memorize it, and the validation loss drops below what any model can reach
on unseen data. The course's Markov data make the bound exact: no next-token
model beats the chain's entropy rate H on unseen sequences
(``helpers.data.MarkovSource.entropy_rate``), so a validation loss below H is
proof of leakage, not of a good model.

The detector counts overlapping n-grams, as production teams do:

* GPT-3 (Brown et al. 2020, sec. 4 and appendix C) flags a test example that
  shares any N-gram (N up to 13 words) with the training data;
* Llama 3 (Dubey et al. 2024, sec. 5.1.4, after Singh et al. 2024) counts the
  tokens of an example that lie in an 8-gram found in the pre-training corpus,
  and calls the example contaminated when that share passes a threshold chosen
  per benchmark.

An n-gram test sees near copies too: changing c tokens of a sequence of L breaks
at most c n of its L - n + 1 n-grams, and the others still match. A test of whole
sequences (equal or not) misses every near copy. n must be long enough that two
independent sequences rarely share an n-gram by chance: with entropy rate H an
n-gram has about e^(n H) likely values, so n H must be well above
ln(number of training n-grams). The chapter measures that chance overlap.

Distributed: the training data is sharded over the ranks and stays there. Each
rank hashes the n-grams of its own shard into a sorted index
(``index_shard``), looks every evaluation n-gram up in it (the evaluation set is
small and every rank has it), and one all-reduce (sum) of the hit flags tells
every rank which evaluation n-grams occur in any shard (``ngram_hits``). Cost
per rank: hashing its shard once (O(tokens n)), a binary search per evaluation
n-gram, and one all-reduce of (evaluation n-grams) int32 flags.

Hashing: an n-gram of token ids is packed into one int64 by two polynomial
hashes modulo the prime 2^31 - 1 (each product below 2^62, so no overflow);
a false match needs both to collide, about one in 2^62 per pair.

How production differs: the corpus is trillions of tokens, so the index is a
Bloom filter or a suffix array per shard, the n-grams are of normalized words
(casing and punctuation removed), and the threshold is tuned per benchmark.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.comm import world_size
from helpers.launch.info import rank_device

__all__ = ["ngram_hashes", "index_shard", "ngram_hits", "token_coverage", "ngram_overlap",
           "contaminated_on_ranks"]

_P = (1 << 31) - 1          # a Mersenne prime: residues below 2^31
_BASES = (1_000_003, 7_919)  # two bases: two independent hashes in one int64


def ngram_hashes(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """(N, L) token ids -> (N, L - n + 1) int64: one hash per n-gram of each row.
    An n-gram never spans two rows (two sequences are not one text)."""
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if n < 1 or n > tokens.size(1):
        raise ValueError(f"n = {n} must be between 1 and the sequence length {tokens.size(1)}")
    windows = tokens.long().unfold(1, n, 1)               # (N, L - n + 1, n)
    h1 = torch.zeros(windows.shape[:2], dtype=torch.long, device=tokens.device)
    h2 = torch.zeros_like(h1)
    for j in range(n):                                    # Horner's rule, mod P
        t = windows[..., j] + 1                           # + 1: token 0 still counts
        h1 = (h1 * _BASES[0] + t) % _P
        h2 = (h2 * _BASES[1] + t) % _P
    return (h1 << 31) | h2


def index_shard(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """The sorted, unique n-gram hashes of one rank's training shard (N, L)."""
    if tokens.numel() == 0:
        return torch.empty(0, dtype=torch.long, device=tokens.device)
    return torch.unique(ngram_hashes(tokens, n).reshape(-1))


def ngram_hits(eval_tokens: torch.Tensor, shard_tokens: torch.Tensor, n: int,
               group=None) -> torch.Tensor:
    """(E, L - n + 1) bool: which n-grams of each evaluation row occur in any rank's
    shard. Collective: every rank passes the same ``eval_tokens`` and its own shard."""
    dev = rank_device()
    grams = ngram_hashes(eval_tokens.to(dev), n)          # (E, K)
    index = index_shard(shard_tokens.to(dev), n)          # (S,), sorted
    pos = torch.searchsorted(index, grams).clamp(max=max(index.numel() - 1, 0))
    hits = (index[pos] == grams) if index.numel() else torch.zeros_like(grams, dtype=torch.bool)
    hits = hits.to(torch.int32)
    if world_size(group) > 1:
        dist.all_reduce(hits, op=dist.ReduceOp.SUM, group=group)  # found on any rank
    return (hits > 0).cpu()


def ngram_overlap(hits: torch.Tensor) -> torch.Tensor:
    """(E,) share of each evaluation row's n-grams found in the training data."""
    return hits.float().mean(dim=1)


def token_coverage(hits: torch.Tensor, n: int) -> torch.Tensor:
    """(E,) share of each row's tokens inside at least one matched n-gram (Llama 3's
    measure): n-gram k covers tokens k .. k + n - 1."""
    E, K = hits.shape
    covered = torch.zeros(E, K + n - 1, dtype=torch.bool)
    for j in range(n):
        covered[:, j:j + K] |= hits
    return covered.float().mean(dim=1)


def contaminated_on_ranks(eval_tokens: torch.Tensor, shard_tokens: torch.Tensor, n: int = 8,
                          threshold: float = 0.5, group=None) -> dict:
    """The detector a job runs: per evaluation row, its token coverage and whether it
    passes ``threshold``. Collective; the same answer on every rank."""
    hits = ngram_hits(eval_tokens, shard_tokens, n, group)
    coverage = token_coverage(hits, n)
    return {"coverage": coverage, "overlap": ngram_overlap(hits),
            "flagged": coverage >= threshold, "n": n, "threshold": threshold}
