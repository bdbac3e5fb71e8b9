"""Frameworks as bundles of choices (chapter 19): read a config, estimate what it costs.

A Megatron-LM command line, a DeepSpeed JSON file and a torchtitan TOML file
all describe the same few decisions: how the GPUs are split (dp, tp, pp, cp,
ep), who keeps which training state (ZeRO stage / distributed optimizer,
offload), the number format, what backward recomputes, the batch identity,
what overlaps, how checkpoints are written. This package writes those
decisions down once, as a ``Plan``, and reuses the course's models to say
what a plan costs.

* ``plan``: ``Plan`` (validated: ``Plan.validate(world_size, model)`` names the
  rule a plan breaks), ``ModelSpec`` (a transformer's shape), ``GPU`` (memory
  and peak FLOP/s), ``Cluster`` (a chapter-07 ``Topology`` of one ``GPU`` type).
  Chapter 20's planner uses the same ``ModelSpec`` and ``GPU``, and its
  ``Layout.to_plan`` turns a layout it ranks into a ``Plan``.
* ``readers``: ``from_deepspeed``, ``from_megatron``, ``from_torchtitan``;
  every knob maps to a ``Plan`` field and the chapter that teaches it
  (``KNOBS``), or is kept in ``Plan.unmapped`` with the reason.
* ``estimate``: ``estimate(plan, model, cluster) -> Estimate``: per-GPU memory,
  bytes per step per axis, step time; each term labelled with its chapter,
  each computed by the per-term cost library ``helpers.costs``, which chapter
  20's planner calls with the same arguments.
* ``crosscheck``: DeepSpeed's memory estimators and Megatron's documented
  bytes per parameter next to the ZeRO paper's formula, the differences named.
* ``configs/``: three configurations modelled on published runs.

What this does not do: run anything. Chapter 20 searches the space of plans
with ``estimate``; the mechanisms themselves ran in chapters 02-21.
"""

import os

from helpers.frameworks.estimate import Estimate, Term, estimate
from helpers.frameworks.plan import A100_80GB, GPU, H100_80GB, Cluster, ModelSpec, Plan
from helpers.frameworks.readers import (CHAPTERS, KNOBS, from_deepspeed, from_megatron,
                                        from_torchtitan, knob_table, megatron_model)

__all__ = ["Plan", "ModelSpec", "GPU", "H100_80GB", "A100_80GB", "Cluster", "Estimate", "Term",
           "estimate", "from_deepspeed", "from_megatron", "from_torchtitan", "megatron_model", "KNOBS", "CHAPTERS",
           "knob_table", "CONFIG_DIR", "config_path"]

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


def config_path(name: str) -> str:
    """Path of one of the shipped configs (``configs/<name>``)."""
    path = os.path.join(CONFIG_DIR, name)
    if not os.path.exists(path):
        raise ValueError(f"no config {name!r}; choose from {sorted(os.listdir(CONFIG_DIR))}")
    return path
