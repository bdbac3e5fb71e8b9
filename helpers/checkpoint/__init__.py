"""Checkpoint, resume and fault tolerance: what decides whether days of compute survive.

In a long run on many GPUs something always breaks: Llama 3's pre-training
was interrupted 466 times in 54 days (Dubey et al. 2024, sec. 3.3.4). A
failure costs the work since the last checkpoint plus the restart, so the
design questions are: what must be saved for the run to continue *exactly*,
how to save it so that a crash during the save cannot destroy the previous
checkpoint, how to save it without stopping training for long, and how to
load it on a different number of ranks.

The pieces, one module each:

* ``store``: ``save(directory, state, step)`` (a collective: every rank writes
  its own file, checksummed, into a temporary directory; a manifest is
  written last and the directory renamed into place) and
  ``load_latest(directory, like=None)`` (newest checkpoint every rank can use,
  with the reasons it skipped newer ones). ``Shard`` marks a rank's piece of a
  larger tensor; the manifest's shard table lets another world size read the
  ranges it needs (resharding). Loads use ``torch.load(weights_only=True)``.
* ``state``: everything a bitwise resume needs: weights, optimizer (also
  ZeRO's and FSDP's sharded weights and moments, as per-parameter Shards),
  LR scheduler, loss scaler, the sampler's position and every RNG stream.
* ``async_save``: ``AsyncSaver`` stalls training only for a copy into CPU
  memory and writes in a background thread.
* ``failures``: job MTBF from per-GPU failure rates, the Young/Daly optimal
  interval, goodput, and a replay of random failures to check them.
* ``train``: the chapter's resumable training loop (DDP, ZeRO-2, ZeRO-3 or
  ``helpers.fsdp``), which can kill one of its ranks at a chosen step or in
  the middle of a save;
  ``job``: the same loop as a ``torchrun --max-restarts`` job.
* ``dcp``: the production twin, PyTorch's ``torch.distributed.checkpoint``
  on an FSDP2 job, and a bridge from its DTensors to our Shards.

Cost: a checkpoint of a mixed-precision Adam run is about 12-16 bytes per
parameter (fp32 weights and two moments, ``helpers.memory``), written by
every rank in parallel; each rank writes 1/N of the sharded part.

How production differs: ``torch.distributed.checkpoint`` (DCP) is the same
design at scale: one file per rank plus a ``.metadata`` file describing
every chunk, planners that decide who writes replicated tensors once, and
resharding by chunk overlap; it stores DTensors (any placement), writes in
parallel threads, stages to pinned memory for ``async_save``, and talks to
object stores. Production jobs also run a watchdog (heartbeat, NCCL
timeouts) and an elastic agent (``torchrun --max-restarts``) that restarts
the group, which then resumes with ``load_latest``: chapter 17 does exactly
that with a killed rank.
"""

from helpers.checkpoint.async_save import AsyncSaver, snapshot
from helpers.checkpoint.state import (fsdp_request, fsdp_state, load_fsdp_state,
                                      load_scaler_state, load_zero_state, restore_training_state,
                                      resume_request, rng_state, scaler_state, set_rng_state,
                                      training_state, zero_request, zero_state)
from helpers.checkpoint.store import (CheckpointMismatch, Loaded, Shard, checkpoint_dir,
                                      list_checkpoints, load_latest, save)

__all__ = ["save", "load_latest", "Loaded", "Shard", "CheckpointMismatch", "list_checkpoints",
           "checkpoint_dir", "AsyncSaver", "snapshot", "rng_state", "set_rng_state",
           "scaler_state", "load_scaler_state", "zero_state", "zero_request", "load_zero_state",
           "training_state", "resume_request", "restore_training_state", "fsdp_state",
           "fsdp_request", "load_fsdp_state"]
