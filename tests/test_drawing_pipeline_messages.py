"""helpers.drawing.pipeline_messages: the picture is the executed actions and the sent messages."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing.pipeline_messages import (draw_pipeline_messages,  # noqa: E402
                                               pipeline_messages)
from helpers.pipeline import B, F, gpipe, one_f_one_b  # noqa: E402


def _step_with_messages(kind, m):
    from helpers import rank_info
    from helpers.checks.spy import communication_spy
    from helpers.model import build_model
    from helpers.pipeline.executor import pipeline_step, split_model

    torch.set_num_threads(1)
    info = rank_info()
    chunks = split_model(build_model("toy", n_layer=4), info.world_size)[info.rank]
    x = torch.randint(0, 64, (2 * m, 16), generator=torch.Generator().manual_seed(0))
    sched = (gpipe if kind == "gpipe" else one_f_one_b)(info.world_size, m)
    with communication_spy(keep_values=False) as spy:
        res = pipeline_step(chunks, sched, x, x)
    return res.timeline, [(dst, nbytes) for dst, nbytes, _ in spy.sends]


@pytest.mark.slow
@pytest.mark.parametrize("p, kind, m", [(3, "gpipe", 1), (4, "1f1b", 3)])
def test_every_message_drawn_is_a_recorded_send_paired_with_its_actions(p, kind, m):
    runs = launch(_step_with_messages, p, kind, m)
    timelines, sends = [t for t, _ in runs], [s for _, s in runs]
    fig, data = draw_pipeline_messages(timelines, sends)
    assert fig.axes
    assert data["actions"] == [[(s, e, repr(a)) for s, e, a in row] for row in timelines]
    # the messages drawn are the spy's records, rank by rank, in posting order
    assert [(src, dst, n) for src, dst, n, _, _ in data["messages"]] == \
        [(src, dst, n) for src, row in enumerate(sends) for dst, n in row]
    act = 2 * 16 * 32 * 4   # a (2, 16, 32) float32 activation of the toy GPT
    for src, dst, nbytes, made_by, feeds in data["messages"]:
        if made_by == "after":       # the tied embedding's gradient, first and last stage
            assert {src, dst} == {0, p - 1}
            continue
        assert nbytes == act and made_by == feeds
        assert made_by[0] == ("F" if dst == src + 1 else "B")
    # every stage but the last passes each micro-batch's activation on, every stage but
    # the first its input gradient back
    for r in range(p):
        fwd = sorted(mb for src, dst, _, mb, _ in data["messages"] if src == r and dst == r + 1)
        bwd = sorted(mb for src, dst, _, mb, _ in data["messages"]
                     if src == r and dst == r - 1 and mb != "after")
        assert fwd == (sorted(repr(F(j)) for j in range(m)) if r < p - 1 else [])
        assert len(bwd) == (m if r > 0 else 0)


def test_a_send_outside_the_pipeline_is_refused():
    timeline = [[(0.0, 1.0, F(0))], [(1.0, 2.0, F(0))]]
    with pytest.raises(ValueError, match="outside a pipeline of 2"):
        pipeline_messages(timeline, [[(5, 8)], []])


def test_no_message_arrives_before_it_was_sent():
    # 2 stages, 1 micro-batch, then the tied gradient both ways: rank 0 finishes its
    # backward at 4, rank 1 at 3; the exchange is drawn at 4 on both arrows, and the two
    # labels of the tied gradient sit apart
    timeline = [[(0.0, 1.0, F(0)), (3.0, 4.0, B(0))], [(1.0, 2.0, F(0)), (2.0, 3.0, B(0))]]
    sends = [[(1, 100), (1, 8)], [(0, 100), (0, 8)]]
    fig, data = draw_pipeline_messages(timeline, sends, unit=1.0)
    assert [m[3] for m in data["messages"]] == ["F0", "after", "B0", "after"]
    assert all(x1 >= x0 for x0, x1 in data["arrows"])
    assert data["arrows"][1] == data["arrows"][3] == (4.0, 4.0)
    labels = [(t.get_position(), t.get_text()) for t in fig.axes[0].texts
              if t.get_text() == " 8 B"]
    assert len(labels) == 2 and labels[0][0] != labels[1][0]
