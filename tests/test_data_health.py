"""helpers.data_health against single-process references and PyTorch's own tools."""

import json
import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler

from helpers import launch
from helpers.data_health import (IncompatibleCheckpoint, audit, audit_on_ranks, compare,
                                 dcp_signature, ngram_hashes, ngram_hits, qkv_per_head,
                                 qkv_stacked, require_compatible, same_order, signature,
                                 store_signature, token_coverage)
from helpers.model import build_model

UNEVEN = [[0, 1, 2, 3, 4], [5, 6, 7, 6, 7], [2, 8, 9]]


def _ledger_rank(ids):
    from helpers import rank_info
    return audit_on_ranks(torch.tensor(ids[rank_info().rank]), 12)


@pytest.mark.slow
def test_audit_on_ranks_equals_one_process_audit_with_uneven_ledgers():
    got = launch(_ledger_rank, 3, UNEVEN)
    want = audit([torch.tensor(i) for i in UNEVEN], 12)
    assert all(a == want for a in got)  # the same answer on every rank
    # 13 uses of 10 distinct ids (6, 7 replayed on rank 1, 2 on ranks 0 and 2)
    assert (want.duplicates, want.gaps, want.cross_rank) == (3, 2, 1)


@pytest.mark.parametrize("n, world", [(10, 3), (50, 4), (7, 4), (12, 4), (3, 5)])
def test_audit_counts_distributed_samplers_padding(n, world):
    """DistributedSampler pads to ceil(n / world) * world with repeats: that many duplicates
    (more than n: the whole permutation repeats), no gaps."""
    ids = [list(DistributedSampler(range(n), world, r, seed=0)) for r in range(world)]
    a = audit([torch.tensor(i) for i in ids], n)
    assert a.duplicates == -(-n // world) * world - n and a.gaps == 0
    dropped = [list(DistributedSampler(range(n), world, r, seed=0, drop_last=True))
               for r in range(world)]
    assert audit([torch.tensor(i) for i in dropped], n).duplicates == 0


def test_audit_refuses_ids_outside_the_epoch():
    with pytest.raises(ValueError, match="outside the epoch"):
        audit([torch.tensor([0, 12])], 12)


def test_same_order_sees_a_forgotten_set_epoch():
    s = DistributedSampler(range(40), 2, 0, seed=0)
    first = list(s)
    assert same_order(first, list(s)) == 1.0
    s.set_epoch(1)
    assert same_order(first, list(s)) < 0.5


def test_ngram_hashes_are_one_per_distinct_ngram():
    """Every 3-gram over 6 tokens (216 of them) gets its own hash; equal n-grams equal ones."""
    grams = torch.cartesian_prod(*[torch.arange(6)] * 3)            # (216, 3)
    h = ngram_hashes(grams, 3).flatten()
    assert torch.unique(h).numel() == 216
    assert torch.equal(ngram_hashes(torch.cat([grams, grams]), 3).flatten()[216:], h)


def test_ngrams_do_not_cross_rows():
    rows = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert ngram_hashes(rows, 2).shape == (2, 2)
    hits = ngram_hits(torch.tensor([[2, 3, 4, 5]]), rows, 2)         # (3, 4) spans the seam
    assert hits.tolist() == [[True, False, True]]


def _overlap_rank(evals, shards):
    from helpers import rank_info
    return ngram_hits(evals, shards[rank_info().rank], 4)


@pytest.mark.slow
def test_ngram_hits_on_ranks_equals_one_index_of_every_shard():
    g = torch.Generator().manual_seed(0)
    shards = [torch.randint(0, 8, (k, 12), generator=g) for k in (3, 1, 2)]
    evals = torch.cat([shards[1], torch.randint(0, 8, (3, 12), generator=g)])
    got = launch(_overlap_rank, 3, evals, shards)
    want = ngram_hits(evals, torch.cat(shards), 4)
    assert all(torch.equal(h, want) for h in got)


def test_token_coverage_of_a_near_copy():
    """c changed tokens leave at least the tokens outside [p - n + 1, p + n - 1] of each
    change covered; with one change in the middle of 32 tokens and n = 8, 32 - 15 = 17."""
    row = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    near = row.clone()
    near[0, 16] = (near[0, 16] + 1) % 64
    cov = token_coverage(ngram_hits(near, row, 8), 8)
    assert cov.item() >= 17 / 32


def test_compare_names_each_kind_of_mismatch():
    base = signature(build_model("toy", device="cpu"))
    assert compare(base, signature(build_model("toy", seed=3, device="cpu"))) == []
    heads = signature(build_model("toy", n_head=4, device="cpu"))
    problems = compare(heads, base)
    assert len(problems) == 4 and all("c_attn" in p and "layout" in p for p in problems)
    half = signature(build_model("toy", device="cpu").to(torch.bfloat16))
    assert all("dtype" in p for p in compare(half, base))
    assert any("format" in p for p in compare({**base, "format": 2}, base))
    with pytest.raises(IncompatibleCheckpoint, match="wte.weight: shape"):
        require_compatible(signature(build_model("toy", n_embd=48, device="cpu")), base)


def test_qkv_layouts_round_trip_and_differ():
    w = torch.randn(96, 32)
    per_head = qkv_per_head(w, 2)
    assert per_head.shape == w.shape and not torch.equal(per_head, w)
    assert torch.equal(qkv_stacked(per_head, 2), w)
    assert torch.equal(per_head[16:32], w[32:48])   # head 0's k follows head 0's q


def test_signatures_read_back_from_the_store_and_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    from helpers.checkpoint import save

    model = build_model("toy", device="cpu")
    sig = signature(model)
    path = save(str(tmp_path / "store"), {"model": model.state_dict(), "signature": sig}, 1)
    assert compare(store_signature(path), sig) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # DCP warns that no process group is up
        dcp.save({"model": model.state_dict(), "signature": json.dumps(sig)},
                 checkpoint_id=str(tmp_path / "dcp"))
        assert compare(dcp_signature(str(tmp_path / "dcp")), sig) == []
    manifest = json.loads((tmp_path / "store" / "step00000001" / "manifest.json").read_text())
    (tmp_path / "store" / "step00000001" / "manifest.json").write_text(
        json.dumps({**manifest, "format": 2}))
    assert any("store format 2" in p for p in compare(store_signature(path), sig))


def test_draw_ledgers_draws_the_audits_counts():
    from helpers.drawing.data_health import draw_ledgers
    audits = [audit([torch.tensor(i) for i in UNEVEN], 12), audit([torch.arange(12)], 12)]
    fig, data = draw_ledgers(audits, ["planted", "right"])
    assert data["counts"] == [a.counts for a in audits]
    assert data["duplicates"] == [3, 0] and data["gaps"] == [2, 0]
    import matplotlib.pyplot as plt
    plt.close(fig)
