"""Sharded, atomic, checksummed checkpoints on disk: ``save`` and ``load_latest``.

Layout of one checkpoint (``step00000012/``)::

    rank0.pt  rank1.pt ...   one file per rank: that rank's state tree
    manifest.json            written last: step, world size, torch version,
                             sha256 and size of every file, and where each
                             shard lives (key, global shape, flat offset, numel)

A save is a collective. Every rank serializes its state, rank 0 makes
``step00000012.partial/``, each rank writes, flushes and fsyncs its file,
rank 0 gathers the checksums, writes the manifest (fsynced), and only then
renames the directory to ``step00000012``. A rename within one file system is
atomic (POSIX rename(2)), so a reader sees either no checkpoint or a complete
one; a job killed half-way leaves a ``.partial`` directory that the loader
skips, saying why.

``load_latest`` walks the checkpoints newest first. For each it reads the
manifest, verifies the sha256 of the files this rank will read, and asks the
other ranks whether they found their files sound (one ``all_gather_object``):
a checkpoint is used only if every rank can use it, so no rank resumes from
step 12 while another resumes from step 8.

Resharding: a ``Shard`` is a rank's piece of a larger tensor, elements
``[offset, offset + numel)`` of the tensor flattened in row-major order (the
way ZeRO and FSDP cut flat buffers). The manifest lists every piece of every
key, so a rank of a job of another size asks for the range *it* owns (by
passing ``like``, a state tree whose Shards have the wanted offsets and
sizes) and reads exactly those bytes from whichever files hold them
(``torch.load(mmap=True)`` maps a file instead of reading all of it).

One mechanism per module, each opening with what it implements and its source:

* ``format``: the files, their names and the state tree (``Shard``,
  ``serialize``, ``list_checkpoints``);
* ``agree``: every rank takes the same decision (one ``all_gather_object``);
* ``write``: the atomic save protocol (``save``, ``write_checkpoint``);
* ``load``: verify, agree, reshard (``load_latest``, ``CheckpointMismatch``).

Everything is re-exported here: ``from helpers.checkpoint.store import save`` works as before.
"""

from helpers.checkpoint.store.format import (FORMAT, Shard, checkpoint_dir, list_checkpoints,
                                             serialize)
from helpers.checkpoint.store.load import CheckpointMismatch, Loaded, load_latest
from helpers.checkpoint.store.write import save, write_checkpoint

__all__ = ["Shard", "Loaded", "save", "load_latest", "list_checkpoints", "checkpoint_dir",
           "CheckpointMismatch", "serialize", "write_checkpoint"]
