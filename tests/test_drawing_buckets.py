"""helpers.drawing.buckets: chapter 04's picture is BucketedDDP's recorded sequence."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import launch, rank_info  # noqa: E402
from helpers.data import make_dataset  # noqa: E402
from helpers.ddp import BucketedDDP  # noqa: E402
from helpers.drawing.buckets import bucket_events, bucket_record, draw_bucket_launches  # noqa: E402
from helpers.model import build_model  # noqa: E402


class _LateFirst(torch.nn.Module):
    """``late`` is registered last (bucket 0) but used first: its gradient comes last."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.late = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        return self.a(self.b(self.late(x))).pow(2).mean()


def _toy():
    r = rank_info().rank
    x, y = make_dataset(seq_len=16, num_sequences=16).batch(range(4 * r, 4 * r + 4))
    ddp = BucketedDDP(build_model("toy"), bucket_cap_mb=0.01, first_bucket_mb=0.002)
    for _ in range(2):  # the record is the last backward's
        ddp(x, y)[1].backward()
    return bucket_record(ddp)


def _late_first():
    ddp = BucketedDDP(_LateFirst(), bucket_cap_mb=0.0005, first_bucket_mb=0.0005)
    ddp(torch.randn(4, 16)).backward()
    return bucket_record(ddp)


@pytest.mark.slow
def test_the_picture_is_the_recorded_sequence():
    for record in launch(_toy, 2):
        _, data = draw_bucket_launches(record)
        grads = [i for kind, i in record["sequence"] if kind == "grad"]
        assert sorted(grads) == list(range(len(record["params"])))      # every hook once
        assert data["arrivals"] == [(record["params"][i], b) for i in grads
                                    for b, idx in enumerate(record["buckets"]) if i in idx]
        launched = [b for kind, b in record["sequence"] if kind == "launch"]
        assert [b for b, _ in data["launches"]] == launched == list(range(len(record["buckets"])))
        # a bucket goes out right after its last gradient: the toy GPT's arrive in order
        for b, after in data["launches"]:
            mine = [k for k, (_, bucket) in enumerate(data["arrivals"]) if bucket == b]
            assert after == max(mine) + 1
        assert data["waited"] == []


@pytest.mark.slow
def test_a_bucket_complete_early_waits_for_its_turn():
    record = launch(_late_first, 2)[0]
    data = bucket_events(record)
    assert [b for _, b in data["arrivals"]][-1] == 0            # bucket 0's gradient came last
    assert [b for b, _ in data["launches"]] == list(range(len(record["buckets"])))
    assert all(after == len(data["arrivals"]) for _, after in data["launches"])  # all at the end
    assert data["waited"] == list(range(1, len(record["buckets"])))


def test_an_unknown_event_is_refused():
    with pytest.raises(ValueError, match="unknown event"):
        bucket_events({"params": ["w"], "bytes": [4], "buckets": [[0]],
                       "sequence": [("oops", 0)]})


@pytest.mark.slow
def test_the_toy_gpts_buckets_read_in_the_sites_column():
    # shown at natural size (no wider than the column), each name at FRAME_TEXT_PT and
    # no longer than its box is tall (the full names at 6 pt came out at ~5 px)
    import matplotlib.pyplot as plt

    from helpers.drawing import COLUMN_INCHES, FRAME_TEXT_PT
    from helpers.drawing.buckets import short_name

    assert short_name("blocks.1.mlp.c_fc.weight") == "1.mlp.c_fc.w"
    assert short_name("ln_f.bias") == "ln_f.b" and short_name("wte") == "wte"
    fig, data = draw_bucket_launches(launch(_toy, 2)[0])
    assert fig.get_size_inches()[0] <= COLUMN_INCHES + 1e-9
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    box_px = ax.transData.transform((0, 1))[1] - ax.transData.transform((0, 0))[1]
    names = [t for t in ax.texts if t.get_rotation() == 90]
    assert len(names) == len(data["arrivals"])
    for t in names:
        assert t.get_fontsize() >= FRAME_TEXT_PT
        assert t.get_window_extent(renderer).height <= box_px, t.get_text()
    plt.close(fig)
