"""Chapter 17's checks pass on the solution, fail on the lab's stubs and on plausible mistakes."""

import math
import random

import numpy as np
import pytest
import torch

from helpers.checks import CheckFailed, ch17
from tools.nbtool import exercise

LAB, SOL = "labs/17_checkpoint_resume_lab.ipynb", "solutions/17_checkpoint_resume_solution.ipynb"


def test_solution_passes_and_stubs_fail(capsys):
    ch17.check_resume_extras(exercise(SOL, "capture_extras"), exercise(SOL, "restore_extras"))
    ch17.check_optimal_interval(exercise(SOL, "optimal_interval"))
    assert capsys.readouterr().out.count("✓") == 2
    with pytest.raises(CheckFailed, match="not implemented"):
        ch17.check_resume_extras(exercise(LAB, "capture_extras"), exercise(LAB, "restore_extras"))
    with pytest.raises(CheckFailed, match="not implemented"):  # a finished capture, stub restore
        ch17.check_resume_extras(exercise(SOL, "capture_extras"), exercise(LAB, "restore_extras"))
    with pytest.raises(CheckFailed, match="not implemented"):
        ch17.check_optimal_interval(exercise(LAB, "optimal_interval"))


def _capture_all(sampler):
    kind, keys, pos, g, c = np.random.get_state()
    return {"sampler": sampler.state_dict(), "torch": torch.get_rng_state(),
            "python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)),
                                                   pos, g, c)}


def _restore_numpy(state):
    kind, keys, pos, g, c = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, g, c))


def test_a_resume_that_forgets_the_torch_rng_fails():
    def restore(state, sampler):
        sampler.load_state_dict(state["sampler"])
        random.setstate(state["python"])
        _restore_numpy(state)

    with pytest.raises(CheckFailed, match="torch .dropout masks. generator"):
        ch17.check_resume_extras(_capture_all, restore)


def test_a_resume_that_restarts_the_sampler_fails():
    def restore(state, sampler):  # every RNG back, but the epoch starts over
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        _restore_numpy(state)

    with pytest.raises(CheckFailed, match="restarted from the beginning"):
        ch17.check_resume_extras(_capture_all, restore)


def test_a_resume_that_forgets_numpy_fails():
    def restore(state, sampler):
        sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])

    with pytest.raises(CheckFailed, match="NumPy"):
        ch17.check_resume_extras(_capture_all, restore)


def test_wrong_intervals_fail():
    with pytest.raises(CheckFailed, match="optimal_interval"):  # the 2 forgotten
        ch17.check_optimal_interval(lambda c, m: math.sqrt(c * m))
    with pytest.raises(CheckFailed, match="optimal_interval"):  # the half interval forgotten
        ch17.check_optimal_interval(lambda c, m: math.sqrt(c * m / 2))
