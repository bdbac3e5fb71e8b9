"""What the loss curve hides: duplicated or skipped data, contaminated evaluation,
incompatible checkpoints (bonus chapter 22).

Three failures every training team meets, none of which shows in the training
loss, each with the detector a job can leave on:

* ``ledger``: every rank records the example ids it consumed; the ledgers meet in
  one all-gather and ``audit`` counts duplicates (padding repeats, replays,
  shared shards), gaps (skipped steps) and ids on more than one rank, also across
  a resume or a change of world size;
* ``contamination``: n-gram overlap between the evaluation set and the training
  shards, each rank indexing its own shard, the hits meeting in one all-reduce;
  near copies are caught as well as exact ones;
* ``compat``: a checkpoint's signature (names, shapes, dtypes, layout tags, format
  version), read from the course store's manifest or DCP's metadata and compared
  with this job's before a step runs.
"""

from helpers.data_health.compat import (IncompatibleCheckpoint, compare, dcp_signature,
                                        model_layouts, qkv_per_head, qkv_stacked,
                                        require_compatible, signature, store_signature)
from helpers.data_health.contamination import (contaminated_on_ranks, index_shard, ngram_hashes,
                                               ngram_hits, ngram_overlap, token_coverage)
from helpers.data_health.ledger import (ExampleLedger, LedgerAudit, audit, audit_on_ranks,
                                        gather_ids, same_order)

__all__ = ["ExampleLedger", "LedgerAudit", "gather_ids", "audit", "audit_on_ranks", "same_order",
           "ngram_hashes", "index_shard", "ngram_hits", "ngram_overlap", "token_coverage",
           "contaminated_on_ranks", "IncompatibleCheckpoint", "signature", "model_layouts",
           "compare", "require_compatible", "store_signature", "dcp_signature", "qkv_per_head",
           "qkv_stacked"]
