"""Chapter 21's routing picture draws the router's recorded choices and the split sizes
the dispatch sent, and the two agree: each rank sends exactly its kept choices of the
experts other ranks hold (and keeps the rest)."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.drawing.moe import draw_routing, routing_record  # noqa: E402


def _forward(top_k, cf, experts):
    import torch.distributed as dist

    from helpers import rank_info
    from helpers.moe import MoELayer
    r = rank_info()
    x = torch.randn(r.world_size * 24, 16, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    layer = MoELayer(16, 32, experts, top_k=top_k, capacity_factor=cf, ep_group=dist.group.WORLD)
    _, st = layer(x.chunk(r.world_size)[r.rank])
    return st


@pytest.mark.parametrize("world,experts,top_k,cf", [(2, 8, 2, None), (3, 6, 1, 1.0),
                                                    (4, 8, 2, 1.25)])
def test_the_picture_is_the_routers_record(world, experts, top_k, cf):
    stats = launch(_forward, world, top_k, cf, experts)
    fig, data = draw_routing(stats, experts)
    plt.close(fig)
    assert data == routing_record(stats, experts)
    for r, st in enumerate(stats):
        assert data["experts"][r] == st.experts.tolist() and data["kept"][r] == st.kept.tolist()
        assert data["sends"][r] == list(st.send_splits)
        assert len(data["experts"][r][0]) == top_k
    # the split sizes are the choices, counted by owner: the recorded all-to-all is the routing
    assert data["counted"] == data["sends"]
    # what a rank receives from each rank is what that rank sent it
    for r, st in enumerate(stats):
        assert list(st.recv_splits) == [data["sends"][q][r] for q in range(world)]
