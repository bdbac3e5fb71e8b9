"""The atomic save: every rank's file durable first, the manifest last, then one rename.

Follows POSIX: fsync(2) makes a file's data durable, then its directory
entry; rename(2) within one file system is atomic (write, fsync, rename).
The files and the manifest are ``helpers.checkpoint.store.format``'s.

A save is a collective. Every rank checks its state can be saved, rank 0 makes
``step00000012.partial/``, each rank writes its file (``torch.save`` straight into
it), flushes and fsyncs it, hashing it meanwhile, rank 0 gathers the checksums, writes the manifest (fsynced), and only then
renames the directory to ``step00000012``. A rename within one file system is
atomic (POSIX rename(2)), so a reader sees either no checkpoint or a complete
one; a job killed half-way leaves a ``.partial`` directory that the loader
skips, saying why. Saving a step that already exists takes two renames (see
``_replace_dir``).

How production differs: object stores (S3, GCS) have no directory rename, and
some shared file systems do not make one atomic; there the commit is a marker
written after every data file is durable (here that would be the manifest),
and readers trust only checkpoints that have one.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

import torch

from helpers.checkpoint.store.agree import gather_all, raise_if_any, rank_and_world
from helpers.checkpoint.store.format import FORMAT, checkpoint_dir, encode, list_checkpoints, write_tree
from helpers.validate import int_at_least, positive_int

__all__ = ["save", "write_checkpoint"]


def _write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()             # Python's buffer -> the OS
        os.fsync(f.fileno())  # the OS's page cache -> the disk


def _fsync_dir(path: str) -> None:
    """A rename or a new file is durable only once its directory entry is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(new: str, final: str) -> None:
    """Put directory ``new`` in the place of the existing directory ``final``.

    rename(2) cannot replace a non-empty directory, so this is two renames, not
    one: the old copy moves aside (``.replaced``, a name the loader does not
    read), the new one takes its name, and only then is the old one deleted. A
    crash between the two renames leaves no ``final`` (the loader falls back to
    the checkpoint before it) with both copies still on disk; deleting the old
    copy first, then renaming, would lose it."""
    aside = final + ".replaced"
    shutil.rmtree(aside, ignore_errors=True)  # a leftover of an earlier crash
    os.rename(final, aside)
    os.rename(new, final)  # the commit point
    shutil.rmtree(aside, ignore_errors=True)


def write_checkpoint(directory: str, step: int, tree: Any, layout: dict, group=None,
                     on_written: Callable[[str], None] | None = None,
                     keep: int | None = None) -> str:
    """The collective part of a save, given this rank's ``encode``d state and its layout.

    Shared by the blocking ``save`` and the background thread of ``AsyncSaver``.
    """
    rank, world = rank_and_world(group)
    final = checkpoint_dir(directory, step)
    tmp = final + ".partial"
    err = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an earlier crash
            os.makedirs(tmp)
        except OSError as exc:
            err = f"cannot create {tmp}: {exc}"
    raise_if_any(gather_all(err, group), "checkpoint save (making the directory)")

    name = f"rank{rank}.pt"
    path = os.path.join(tmp, name)
    try:
        size, digest = write_tree(path, tree)
        meta = {"file": name, "bytes": size, "sha256": digest, **layout}
    except Exception as exc:  # a full disk (OSError), say: every rank must hear of it, not wait
        detail = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        meta = {"error": f"writing {path}: {detail}"}
    if on_written is not None and "error" not in meta:
        on_written(path)  # the chapter kills a rank here to show a crash mid-save
    metas = gather_all(meta, group)
    raise_if_any([m.get("error") for m in metas], "checkpoint save (writing the files)")

    err = None
    if rank == 0:
        try:
            manifest = _manifest(step, metas)
            _write_durably(os.path.join(tmp, "manifest.json"),
                           json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            if os.path.exists(final):  # saving a step again (after a resume)
                _replace_dir(tmp, final)
            else:
                os.rename(tmp, final)  # the commit point
            _fsync_dir(directory)
            if keep is not None:
                for old_step, old, partial in list_checkpoints(directory)[keep:]:
                    if not partial:
                        shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            err = f"writing the manifest or renaming {tmp}: {exc}"
    raise_if_any(gather_all(err, group), "checkpoint save (commit)")
    return final


def _manifest(step: int, metas: list[dict]) -> dict:
    shards: dict[str, dict] = {}
    for m in metas:
        for key, s in m["shards"].items():
            entry = shards.setdefault(key, {"global_shape": s["global_shape"], "dtype": s["dtype"],
                                            "pieces": []})
            if entry["global_shape"] != s["global_shape"]:
                raise ValueError(f"shard {key}: ranks disagree on its global shape "
                                 f"({entry['global_shape']} vs {s['global_shape']})")
            entry["pieces"].append({"file": m["file"], "offset": s["offset"], "numel": s["numel"]})
    return {
        "format": FORMAT, "step": step, "world_size": len(metas),
        "torch": torch.__version__,
        "files": {m["file"]: {"bytes": m["bytes"], "sha256": m["sha256"],
                              "tensors": m["tensors"]} for m in metas},
        "shards": shards,
    }


def save(directory: str, state: dict, step: int, group=None, keep: int | None = None,
         on_written: Callable[[str], None] | None = None) -> str:
    """Save this rank's ``state`` as part of checkpoint ``step``. Call on every rank.

    ``state``: a dict of tensors, ``Shard``s, numbers, strings and lists/dicts of
    them. ``keep``: how many complete checkpoints to keep (None: all).
    ``on_written(path)`` runs on each rank once its file is durable, before the
    manifest (a place to inject a crash). Returns the checkpoint's directory.
    """
    int_at_least("step", step, 0)
    if keep is not None:
        positive_int("keep (None: keep all)", keep)
    err, tree, layout = None, None, {}
    try:
        tree, layout = encode(state)
    except (TypeError, ValueError) as exc:
        err = str(exc)
    # Agree before any file exists: one rank with a bad state must not leave
    # the others waiting in a collective.
    raise_if_any(gather_all(err, group), "checkpoint save")
    return write_checkpoint(directory, step, tree, layout, group, on_written, keep)

