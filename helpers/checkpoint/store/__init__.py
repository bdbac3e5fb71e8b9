"""Sharded, atomic, checksummed checkpoints on disk: ``save`` and ``load_latest``.

Layout of one checkpoint (``step00000012/``)::

    rank0.pt  rank1.pt ...   one file per rank: that rank's state tree
    manifest.json            written last: step, world size, torch version,
                             sha256 and size of every file, and where each
                             shard lives (key, global shape, flat offset, numel)

A save is a collective and atomic: every rank's file durable first, the manifest
last, then one rename (``write``). ``load_latest`` uses a checkpoint only if every
rank verified its files, and reshards by overlap of flat ranges (``load``).

One mechanism per module, each opening with what it implements and its source:

* ``format``: the files, their names and the state tree (``Shard``,
  ``encode``, ``list_checkpoints``; ``write_tree`` writes a rank's file);
* ``agree``: every rank takes the same decision (one ``all_gather_object``);
* ``write``: the atomic save protocol (``save``, ``write_checkpoint``);
* ``load``: verify, agree, reshard (``load_latest``, ``CheckpointMismatch``).

Everything is re-exported here: ``from helpers.checkpoint.store import save`` works as before.
"""

from helpers.checkpoint.store.format import (FORMAT, Shard, checkpoint_dir, encode,
                                             list_checkpoints)
from helpers.checkpoint.store.load import CheckpointMismatch, Loaded, load_latest
from helpers.checkpoint.store.write import save, write_checkpoint

__all__ = ["Shard", "Loaded", "save", "load_latest", "list_checkpoints", "checkpoint_dir",
           "CheckpointMismatch", "encode", "write_checkpoint"]
