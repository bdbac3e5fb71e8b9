"""helpers.memory.model_state_bytes against published figures; helpers.steptime on real ranks."""

import pytest

from helpers import launch
from helpers.memory import GB, model_state_bytes
from helpers.steptime import PARTS, StepProfile, classify_bottleneck, dp_step_profile


def test_70b_needs_1120_gb():
    assert model_state_bytes(70e9).total / GB == pytest.approx(1120)


@pytest.mark.parametrize("stage, want_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, want_gb):
    # Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, N_d = 64, K = 12
    got = model_state_bytes(7.5e9, dp=64, zero_stage=stage).total / GB
    assert round(got, 1) == want_gb


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_params=-1), "n_params"), (dict(n_params=1, dp=0), "dp"),
    (dict(n_params=1, zero_stage=4), "zero_stage"), (dict(n_params=1, grad_bytes=-2), "grad_bytes"),
])
def test_model_state_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        model_state_bytes(**kwargs)


def test_planted_bottlenecks_are_classified_on_real_ranks():
    # Planted effects are large (50 ms sleeps, 64 MB of gradient) so that the shape
    # survives a noisy, shared CI machine.
    cases = {"compute-bound": dict(batch_size=32), "input-bound": dict(data_delay=0.05),
             "straggler-bound": dict(straggler_delay=0.05),
             "all-reduce-bound": dict(extra_grad_mb=64),
             "memory-bound": dict(mem_frac=0.95)}
    for want, knobs in cases.items():
        for attempt in range(2):  # one retry: a timing can be disturbed by another process
            per_rank = launch(dp_step_profile, 2, steps=4, **knobs)
            prof = StepProfile.from_ranks(per_rank)
            assert all(len(prof.part(p)) == 2 for p in PARTS)
            if classify_bottleneck(prof) == want:
                break
        assert classify_bottleneck(prof) == want, (want, per_rank)
