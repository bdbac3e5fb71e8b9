"""Debugging distributed training: which rank, which collective, which state.

* ``recorder``: ``record_collectives()``, a flight recorder of every
  collective and point-to-point call on a rank (``launch(..., record=True)``
  records a whole rank function; a failed launch ends with the diff).
* ``diff``: lines the ranks' records up and names the first disagreement, or
  the rank that never arrived; the straggler from arrival times.
* ``replica``: checksums of parameters and optimizer state across
  data-parallel ranks, naming the first diverging rank and parameter.
* ``monitor``: a training health monitor (loss, grad norm, tokens/s, MFU,
  stalls, memory) with spike detection, used again in chapter 20.
"""

from helpers.debug.diff import explain, first_disagreement, straggler
from helpers.debug.recorder import CallRecord, record_collectives

__all__ = ["record_collectives", "CallRecord", "explain", "first_disagreement", "straggler"]
