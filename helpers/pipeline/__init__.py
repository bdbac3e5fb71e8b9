"""Pipeline parallelism (chapters 11-12): partition, schedules, simulator, executor.

* ``partition``: cut a stack of layers into contiguous stages (ch. 11).
* ``schedules``: GPipe, 1F1B, interleaved 1F1B and ZB-H1 as pure
  functions returning one list of actions per rank (ch. 12).
* ``simulate``: timelines, bubble fraction and peak stash of any schedule.
* ``p2p``: the messages of a schedule, planned before any rank runs: which
  sends and receives are posted together (nccl), when a sent tensor may be
  freed, and a model of nccl's streams to check it.
* ``stash``: measures the activation bytes a rank really holds for backward.
* ``executor``: runs any F/B schedule on real ranks with send/recv.
* ``plain_1f1b``: 1F1B alone as one short loop (warm-up, steady, cool-down),
  the way Megatron-LM writes it; read it before the executor.
"""

from helpers.pipeline.partition import partition, pipeline_step_time, stage_costs, stash_memory
from helpers.pipeline.schedules import (Action, B, F, W, format_schedule, gpipe, interleaved_1f1b,
                                        one_f_one_b, zb_h1)
from helpers.pipeline.simulate import (ScheduleDeadlock, Simulation, bubble_formula, gantt,
                                       peak_stash, simulate, validate_schedule)

__all__ = ["partition", "stage_costs", "pipeline_step_time", "stash_memory", "Action", "F", "B", "W", "gpipe", "one_f_one_b", "zb_h1",
           "interleaved_1f1b", "format_schedule", "simulate", "Simulation",
           "ScheduleDeadlock", "validate_schedule", "bubble_formula", "peak_stash", "gantt"]
