"""Chapter 17's reshard picture draws the manifest's pieces and what each new rank's
load read (``Loaded.reads``), and those reads are the resharding: each new rank's ranges,
from whichever old files hold them, tile every tensor exactly once."""

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from helpers import launch  # noqa: E402
from helpers.checkpoint.train import resumable_run  # noqa: E402
from helpers.drawing.checkpoint import draw_reshard, file_rank  # noqa: E402


@pytest.mark.parametrize("saved_on,read_on", [(4, 2), (2, 4)])
def test_the_picture_is_the_manifest_and_the_reads(tmp_path, saved_on, read_on):
    kw = dict(optimizer="zero2", dropout=0.0, size="toy")
    d = str(tmp_path / "z")
    launch(resumable_run, saved_on, d, 1, save_every=1, **kw)
    ranks = launch(resumable_run, read_on, d, 2, **kw)
    with open(f"{d}/step00000001/manifest.json") as f:
        manifest = json.load(f)
    fig, data = draw_reshard(manifest, [r["reads"] for r in ranks], "/zero/exp_avg/")
    plt.close(fig)
    keys = [k for k in manifest["shards"] if k.startswith("/zero/exp_avg/")]
    assert data["keys"] == keys and data["saved_by"] == saved_on
    # saved: exactly the manifest's pieces, on the line
    want = sorted((p["file"], data["offsets"][k] + p["offset"],
                   data["offsets"][k] + p["offset"] + p["numel"])
                  for k in keys for p in manifest["shards"][k]["pieces"] if p["numel"])
    assert data["saved"] == want
    assert {file_rank(f) for f, *_ in data["saved"]} == set(range(saved_on))
    # read: exactly what each rank's load copied
    for r, rank in enumerate(ranks):
        got = sorted((f, data["offsets"][k] + lo, data["offsets"][k] + hi)
                     for k in keys for f, lo, hi in rank["reads"].get(k, []) if hi > lo)
        assert data["read"][r] == got
    # Adam's moment is sharded in the new job too: the new ranks' reads tile the tensors
    # once, each from a file that holds it
    spans = sorted((lo, hi) for r in data["read"] for _, lo, hi in r)
    assert spans[0][0] == 0 and spans[-1][1] == data["total"]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for r in data["read"]:
        for f, lo, hi in r:
            assert any(g == f and a <= lo and hi <= b for g, a, b in data["saved"])
    # ZeRO-2's weights are whole on every rank: each new rank reads all of them
    whole = draw_reshard(manifest, [r["reads"] for r in ranks], "/zero/weights/")
    plt.close(whole[0])
    for r in whole[1]["read"]:
        covered = sorted((lo, hi) for _, lo, hi in r)
        assert covered[0][0] == 0 and covered[-1][1] == whole[1]["total"]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
