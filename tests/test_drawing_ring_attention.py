"""helpers.drawing.ring_attention: the ring picture is what each rank computed, step by step."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing.ring_attention import draw_ring, ring_data  # noqa: E402
from helpers.sp import unmasked_scores  # noqa: E402


def _traced(seq, layout):
    from helpers.sp import ring_forward, shard_sequence
    gen = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, 1, seq, 4, generator=gen), layout=layout)
               for _ in range(3))
    steps = []
    ring_forward(q, k, v, layout=layout, trace=steps)
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("cp, layout", [(3, "contiguous"), (4, "contiguous"), (4, "zigzag")])
def test_each_frame_is_the_recorded_step(cp, layout):
    seq = 8 * cp
    traces = launch(_traced, cp, seq, layout)
    fig, data = draw_ring(traces)
    assert len(data["steps"]) == cp and sum(ax.axison for ax in fig.axes) == cp
    for s, step in enumerate(data["steps"]):
        for r, blk in enumerate(step):
            rec = traces[r][s]
            assert blk["owner"] == rec["owner"] == (r - s) % cp     # the block came round
            assert blk["sent_to"] == ((r + 1) % cp if s < cp - 1 else None)
            # the cells drawn are the mask the rank applied, in global positions
            want = {(q, k) for i, q in enumerate(rec["q_pos"]) for j, k in enumerate(rec["k_pos"])
                    if rec["computed"] and bool(rec["mask"][i][j])}
            assert set(blk["visible"]) == want
            assert all(q >= k for q, k in blk["visible"])               # causal
            assert all(q < k for q, k in blk["masked"])
    # per rank, the scores drawn are the work section 4 counts (unmasked_scores)
    per_rank = [sum(len(b["visible"]) for step in data["steps"] for b in step if b["rank"] == r)
                for r in range(cp)]
    assert per_rank == unmasked_scores(seq, cp, layout)


def test_a_trace_that_is_not_a_whole_causal_ring_is_refused():
    one = [{"step": 0, "rank": 0, "owner": 0, "q_pos": [0, 1], "k_pos": [0, 1],
            "mask": [[True, False], [True, True]], "computed": True,
            "sent_to": None, "received_from": None}]
    assert ring_data([one])["steps"][0][0]["visible"] == [(0, 0), (1, 0), (1, 1)]
    one[0]["mask"] = [[True, False], [False, True]]
    with pytest.raises(ValueError, match="causal attention over 2 positions has 3"):
        ring_data([one])
    twice = [dict(one[0], mask=[[True, False], [True, True]]),
             dict(one[0], step=1, mask=[[True, False], [True, True]])]
    with pytest.raises(ValueError, match="computed twice"):
        ring_data([twice])
