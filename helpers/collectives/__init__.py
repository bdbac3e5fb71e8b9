"""Collectives built from point-to-point messages, and how to read their cost (chapter 03).

An all-reduce leaves the element-wise sum of every rank's tensor on every
rank. This package builds it the way MPI and NCCL do, one mechanism per
module, each opening with what it implements and the source it follows:

* ``ring``: ring reduce-scatter, all-gather and all-reduce over
  isend/irecv, with the exchange hook chapter 07 plugs a slow network into
  (Patarasuk & Yuan 2009; Thakur et al. 2005, sec. 4.5);
* ``halving_doubling``: Rabenseifner's recursive halving then doubling, the
  ring's bytes in 2 log2 p messages (Rabenseifner 2004);
* ``cost``: the alpha-beta times of ring, tree and halving-doubling
  (Thakur et al. 2005, sec. 4; Hockney 1994) and bus bandwidth (nccl-tests,
  doc/PERFORMANCE.md);
* ``measure``: ``sweep`` over message sizes against the backend's own
  all-reduce, and ``fit_alpha_beta`` (benchmarks/bench_collectives.py);
* ``alltoall``: the differentiable all-to-all of rows that Ulysses
  (``helpers.sp``) and expert parallelism (``helpers.moe``) share.

Everything is re-exported here: ``from helpers.collectives import
ring_all_reduce`` and ``collectives.ring_all_reduce`` work as before.
"""

from helpers.collectives.alltoall import AllToAll, all_to_all
from helpers.collectives.cost import (BUSBW_FACTORS, bus_bandwidth,
                                      halving_doubling_all_reduce_time, ring_all_reduce_time,
                                      tree_all_reduce_time)
from helpers.collectives.halving_doubling import halving_doubling_all_reduce
from helpers.collectives.measure import IMPLS, check_sweep_args, fit_alpha_beta, sweep
from helpers.collectives.ring import (SEGMENT_BYTES, check_summable, chunk_bounds, flat_view,
                                      post_pair, ring_all_gather, ring_all_reduce,
                                      ring_neighbours, ring_reduce_scatter)

__all__ = ["chunk_bounds", "flat_view", "check_summable", "post_pair", "SEGMENT_BYTES",
           "ring_neighbours", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "halving_doubling_all_reduce", "halving_doubling_all_reduce_time",
           "ring_all_reduce_time", "tree_all_reduce_time", "bus_bandwidth", "BUSBW_FACTORS",
           "IMPLS", "check_sweep_args", "sweep", "fit_alpha_beta", "AllToAll", "all_to_all"]
