"""Chapter 17's checks pass on the solution, fail on the lab's stubs and on plausible mistakes."""

import math
import random

import numpy as np
import torch

from checks_harness import ChapterChecks, Check, Wrong
from helpers.checks import ch17


def _capture_all(sampler):
    kind, keys, pos, g, c = np.random.get_state()
    return {"sampler": sampler.state_dict(), "torch": torch.get_rng_state(),
            "python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)),
                                                   pos, g, c)}


def _restore_numpy(state):
    kind, keys, pos, g, c = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, g, c))


def _restore_without_torch(state, sampler):
    sampler.load_state_dict(state["sampler"])
    random.setstate(state["python"])
    _restore_numpy(state)


def _restore_without_sampler(state, sampler):  # every RNG back, but the epoch starts over
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    _restore_numpy(state)


def _restore_without_numpy(state, sampler):
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


class TestChapter17(ChapterChecks):
    lab = "labs/17_checkpoint_resume_lab.ipynb"
    sol = "solutions/17_checkpoint_resume_solution.ipynb"
    checks = {
        "resume_extras": Check(ch17.check_resume_extras, "capture_extras", "restore_extras"),
        "optimal_interval": Check(ch17.check_optimal_interval),
    }
    wrong = [
        Wrong("resume_extras", {"capture_extras": _capture_all,
                                "restore_extras": _restore_without_torch},
              "forgets the torch RNG", says="torch .dropout masks. generator"),
        Wrong("resume_extras", {"capture_extras": _capture_all,
                                "restore_extras": _restore_without_sampler},
              "restarts the sampler", says="restarted from the beginning"),
        Wrong("resume_extras", {"capture_extras": _capture_all,
                                "restore_extras": _restore_without_numpy},
              "forgets NumPy's RNG", says="NumPy"),
        Wrong("optimal_interval", lambda c, m: math.sqrt(c * m), "the 2 forgotten",
              says="optimal_interval"),
        Wrong("optimal_interval", lambda c, m: math.sqrt(c * m / 2),
              "the half interval forgotten", says="optimal_interval"),
    ]
