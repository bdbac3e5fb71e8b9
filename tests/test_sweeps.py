"""helpers.costs.sweeps: each family's step does the FLOPs and sends the bytes its
threshold formula counts, so that a sweep's crossover tests the formula.

The timing of a sweep is not asserted here (it moves with the machine's load; the
notebooks print the measured crossover against the prediction). What is asserted is
exact: the FLOPs of each family's compute, counted by torch's own FlopCounterMode, and
the bytes its communication hands to the process group, seen on the wire
(``helpers.launch.wire``), are those that put compute and communication level at the
knob ``predict`` returns. A family that left out the backward's all-reduce, sent K
without V, or priced a point-to-point exchange as an all-reduce fails by a factor of 2.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers.costs import sweeps
from helpers.launch import launch

# Bytes each rank puts on the wire per call, by what moves (a ring's traffic: the share
# of the tensor nccl-tests' bus bandwidth counts); ``nbytes`` is what the rank hands in.
SENT = {
    "all_reduce": lambda nbytes, n: 2 * (n - 1) / n * nbytes,
    "all_gather_into_tensor": lambda nbytes, n: (n - 1) * nbytes,       # hands in its shard
    "reduce_scatter_tensor": lambda nbytes, n: (n - 1) / n * nbytes,   # hands in the whole
    "all_to_all_single": lambda nbytes, n: (n - 1) / n * nbytes,
    "send": lambda nbytes, n: nbytes,
    "recv": lambda nbytes, n: 0,
}


def _counted_flops(family: str, x: int, n: int) -> float:
    compute, _ = sweeps.FAMILIES[family].step(x, n, torch.device("cpu"))
    with FlopCounterMode(display=False) as counter:
        compute()
    return counter.get_total_flops()


@pytest.mark.parametrize("family", sorted(sweeps.FAMILIES))
@pytest.mark.parametrize("n", [2, 3, 4])
def test_compute_does_the_flops_the_family_counts(family, n):
    for x in (7, 64, 300):
        assert _counted_flops(family, x, n) == sweeps.FAMILIES[family].flops(x, n), (family, x)


class _Bytes:
    def __init__(self):
        self.sent = 0.0
        self.kinds = []

    def before(self, call):
        self.kinds.append(call.op)
        self.sent += SENT[call.op](call.nbytes, len(call.ranks))


def _sent_per_rank(family: str, x: int) -> tuple[float, list]:
    from helpers.launch import rank_info, wire

    info = rank_info()
    _, communicate = sweeps.FAMILIES[family].step(x, info.world_size, torch.device(info.device))
    with wire.observing(_Bytes()) as seen:
        communicate()
    return seen.sent, seen.kinds


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request):
    return request.param


def test_at_the_predicted_knob_compute_and_communication_take_the_same_time(ranks):
    """With any ceilings C and W, the prediction x* puts the family's counted FLOPs at C
    and its wire bytes at W level. C / W is chosen to land x* near 1000 so that rounding
    the knob to a whole number moves the FLOPs (up to x^2) by at most 0.1 %: 0.5 % bound."""
    n = ranks
    cases = {}
    for family, fam in sweeps.FAMILIES.items():
        unit = fam.predict(1.0, 1.0, n)               # the knob at ridge 1: x* is linear in C/W
        C, W = 1000 / unit, 1.0
        cases[family] = (round(fam.predict(C, W, n)), C, W)
    wrong = []
    for family, (x, C, W) in cases.items():
        results = launch(_sent_per_rank, n, family, x)
        sent = max(s for s, _ in results)             # every rank sends alike (even routing)
        t_compute = sweeps.FAMILIES[family].flops(x, n) / C
        if t_compute != pytest.approx(sent / W, rel=5e-3):
            wrong.append(f"{family}: compute / communication = {t_compute / (sent / W):.3f} "
                         f"at the predicted {x} (calls: {results[0][1]})")
    assert wrong == []


def test_each_family_waits_on_the_wire_it_names(ranks):
    """The reference transfer that measures W is the kind the family's step uses."""
    kinds = {"all_reduce": {"all_reduce"}, "gather_scatter": {"all_gather_into_tensor",
                                                          "reduce_scatter_tensor"},
             "p2p": {"send", "recv"}, "all_to_all": {"all_to_all_single"}}
    for family, fam in sweeps.FAMILIES.items():
        _, ops = launch(_sent_per_rank, ranks, family, 16)[0]
        assert set(ops) <= kinds[fam.wire] and ops, (family, ops)


def test_a_sweep_on_ranks_is_centred_on_its_prediction_and_reports_it():
    """Two families end to end on 2 ranks (one collective, one point-to-point): five
    points around the prediction, the ceilings it used, and a report whose every line
    comes from the result. The crossover itself is timing: printed, not asserted."""
    for family in ("fsdp", "cp"):
        result = sweeps.slowest(launch(sweeps.threshold_sweep, 2, family, spread=1, repeats=2))
        values = [v for v, _, _ in result["sweep"]]
        assert len(values) == 3 and values == sorted(values)
        assert values[1] == result["centre"]
        assert result["flops"] > 0 and result["link_bw"] > 0
        text = sweeps.report(result)
        assert f"{result['predicted']:,.0f}" in text and sweeps.FAMILIES[family].formula in text


def test_smoothing_reads_the_communication_as_one_number():
    # one point's transfer slowed by a burst of other work moves nothing
    sweep = [(10, 1.0, 2.0), (20, 2.0, 2.0), (40, 4.0, 9.0), (80, 8.0, 2.0)]
    assert [tm for _, _, tm in sweeps.smoothed(sweep, 0)] == [2.0] * 4
    # 0.5 ms of latency plus 0.1 ms per unit, one point slowed
    grows = [(10, 1.0, 1.5), (20, 4.0, 2.5), (40, 16.0, 50.0), (80, 64.0, 8.5)]
    assert [tm for _, _, tm in sweeps.smoothed(grows, 1)] == pytest.approx([1.5, 2.5, 4.5, 8.5])
    powers = {name: fam.message_power(2) for name, fam in sweeps.FAMILIES.items()}
    assert powers == {"dp": 0, "fsdp": 0, "tp": 0, "ep": 0, "cp": 1, "pp": 1}


def test_crossover_interpolates_where_the_ratio_crosses_one():
    # compute ~ x^2, communication ~ x: equal at x = 100
    sweep = [(x, (x / 100) ** 2, x / 100) for x in (25, 50, 200, 400)]
    assert sweeps.crossover(sweep) == pytest.approx(100)
    assert sweeps.crossover([(1, 1.0, 2.0), (2, 1.0, 2.0)]) is None
