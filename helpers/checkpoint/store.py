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
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["Shard", "Loaded", "save", "load_latest", "list_checkpoints", "checkpoint_dir",
           "CheckpointMismatch"]

FORMAT = 1
_NAME = re.compile(r"^step(\d{8})(\.partial)?$")
_SHARD_TAG = "__shard__"


@dataclasses.dataclass
class Shard:
    """Elements ``[offset, offset + data.numel())`` of a tensor of ``global_shape``,
    flattened row-major. ``data`` is 1-D."""

    data: torch.Tensor
    global_shape: tuple[int, ...]
    offset: int

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(s) for s in self.global_shape)
        total = 1
        for s in self.global_shape:
            total *= s
        if self.data.dim() != 1:
            raise ValueError(f"Shard.data must be 1-D (a flat range), got shape "
                             f"{tuple(self.data.shape)}")
        if not 0 <= self.offset <= self.offset + self.data.numel() <= total:
            raise ValueError(f"Shard [{self.offset}, {self.offset + self.data.numel()}) does not "
                             f"fit in a tensor of {total} elements {self.global_shape}")

    @classmethod
    def empty_like(cls, global_shape, offset: int, numel: int, dtype=torch.float32) -> "Shard":
        """A request: "give me elements [offset, offset + numel) of this tensor"."""
        return cls(torch.empty(numel, dtype=dtype), global_shape, offset)


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit this run (another model config, a missing key)."""


@dataclasses.dataclass
class Loaded:
    """What ``load_latest`` found: this rank's state (None if no usable
    checkpoint), its step, its directory, and why newer ones were skipped."""

    state: dict | None
    step: int | None
    path: str | None
    skipped: list[str]


def checkpoint_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step{step:08d}")


# --------------------------------------------------------------------------
# The state tree: tensors, Shards and plain Python values, nothing else.
# torch.load(weights_only=True) refuses arbitrary objects (unpickling one can
# run any code), so we refuse them at save time, naming the key.
# --------------------------------------------------------------------------

_PLAIN = (int, float, bool, str, type(None))


def _encode(obj: Any, path: str, shards: dict, tensors: dict) -> Any:
    """Copy of the tree with Shards as tagged dicts; records each leaf's layout."""
    if isinstance(obj, Shard):
        shards[path] = obj
        return {_SHARD_TAG: True, "data": obj.data.detach().cpu().contiguous(),
                "global_shape": list(obj.global_shape), "offset": obj.offset}
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return obj.detach().cpu()
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint state {path or '/'}: key {k!r} is a "
                                f"{type(k).__name__}; keys must be str or int")
        return {k: _encode(v, f"{path}/{k}", shards, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_encode(v, f"{path}/{i}", shards, tensors) for i, v in enumerate(obj))
    if isinstance(obj, _PLAIN):
        return obj
    raise TypeError(f"checkpoint state {path}: a {type(obj).__name__} cannot be saved; use "
                    f"tensors, Shards, numbers, strings, None and lists/dicts of them "
                    f"(loads use torch.load(weights_only=True), which refuses other objects)")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.get(_SHARD_TAG) is True:
            return Shard(obj["data"], tuple(obj["global_shape"]), int(obj["offset"]))
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_decode(v) for v in obj)
    return obj


def _leaves(tree: Any, path: str = ""):
    """(path, leaf) of a tree, Shards and tensors as leaves."""
    if isinstance(tree, dict) and not tree.get(_SHARD_TAG):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{path}/{i}")
    else:
        yield path, tree


# --------------------------------------------------------------------------
# Collective helpers that collapse to plain code at world size 1.
# --------------------------------------------------------------------------

def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_gather(obj: Any, group) -> list:
    rank, world = _world(group)
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _raise_if_any(errors: list, what: str) -> None:
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, e = bad[0]
        raise RuntimeError(f"{what} failed on rank {r}: {e}")


# --------------------------------------------------------------------------
# Files: write + flush + fsync; rename; fsync the directory.
# --------------------------------------------------------------------------

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


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def serialize(state: dict) -> tuple[bytes, dict]:
    """(bytes of the rank's file, its layout for the manifest)."""
    shards: dict[str, Shard] = {}
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, "", shards, tensors)
    buf = io.BytesIO()
    torch.save(encoded, buf)
    layout = {
        "shards": {k: {"global_shape": list(s.global_shape), "offset": s.offset,
                       "numel": s.data.numel(), "dtype": str(s.data.dtype)}
                   for k, s in shards.items()},
        "tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype)}
                    for k, t in tensors.items()},
    }
    return buf.getvalue(), layout


def write_checkpoint(directory: str, step: int, data: bytes, layout: dict, group=None,
                     on_written: Callable[[str], None] | None = None,
                     keep: int | None = None) -> str:
    """The collective part of a save, given this rank's serialized bytes.

    Shared by the blocking ``save`` and the background thread of ``AsyncSaver``.
    """
    rank, world = _world(group)
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
    _raise_if_any(_all_gather(err, group), "checkpoint save (making the directory)")

    name = f"rank{rank}.pt"
    path = os.path.join(tmp, name)
    _write_durably(path, data)
    digest = hashlib.sha256(data).hexdigest()
    if on_written is not None:
        on_written(path)  # the chapter kills a rank here to show a crash mid-save
    metas = _all_gather({"file": name, "bytes": len(data), "sha256": digest, **layout}, group)

    err = None
    if rank == 0:
        try:
            manifest = _manifest(step, metas)
            _write_durably(os.path.join(tmp, "manifest.json"),
                           json.dumps(manifest, indent=1).encode())
            _fsync_dir(tmp)
            if os.path.exists(final):  # saving a step again (after a resume): replace it
                shutil.rmtree(final)
            os.rename(tmp, final)  # the commit point
            _fsync_dir(directory)
            if keep is not None:
                for old_step, old, partial in list_checkpoints(directory)[keep:]:
                    if not partial:
                        shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            err = f"writing the manifest or renaming {tmp}: {exc}"
    _raise_if_any(_all_gather(err, group), "checkpoint save (commit)")
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
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None or an int >= 1, got {keep!r}")
    err, data, layout = None, b"", {}
    try:
        data, layout = serialize(state)
    except (TypeError, ValueError) as exc:
        err = str(exc)
    # Agree before any file exists: one rank with a bad state must not leave
    # the others waiting in a collective.
    _raise_if_any(_all_gather(err, group), "checkpoint save")
    return write_checkpoint(directory, step, data, layout, group, on_written, keep)


# --------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------

def list_checkpoints(directory: str) -> list[tuple[int, str, bool]]:
    """(step, path, partial) of every checkpoint directory, newest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(directory, name), bool(m.group(2))))
    # A complete step before a partial one of the same number (a re-save in progress).
    return sorted(out, key=lambda t: (t[0], not t[2]), reverse=True)


def _read_manifest(path: str) -> tuple[dict | None, str | None]:
    mpath = os.path.join(path, "manifest.json")
    if not os.path.exists(mpath):
        return None, "no manifest.json (the save never completed)"
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"manifest.json unreadable ({exc})"
    if manifest.get("format") != FORMAT:
        return None, f"manifest format {manifest.get('format')!r}, this code reads {FORMAT}"
    return manifest, None


def _files_needed(manifest: dict, like: dict | None, rank: int, world: int) -> list[str]:
    saved = manifest["world_size"]
    own = f"rank{rank}.pt" if saved == world else "rank0.pt"
    if like is None:
        return [own]
    files = {own}
    for key, leaf in _leaves(like):
        if isinstance(leaf, Shard):
            lo, hi = leaf.offset, leaf.offset + leaf.data.numel()
            for p in manifest["shards"].get(key, {"pieces": []})["pieces"]:
                if p["offset"] < hi and lo < p["offset"] + p["numel"]:
                    files.add(p["file"])
    return sorted(files)


def _verify(path: str, manifest: dict, files: list[str]) -> str | None:
    for name in files:
        fpath = os.path.join(path, name)
        meta = manifest["files"].get(name)
        if meta is None:
            return f"{name} is not in the manifest"
        if not os.path.exists(fpath):
            return f"{name} is missing"
        size = os.path.getsize(fpath)
        if size != meta["bytes"]:
            return f"{name} has {size} bytes, the manifest says {meta['bytes']} (truncated?)"
        digest = _sha256_file(fpath)
        if digest != meta["sha256"]:
            return (f"{name} fails its checksum (sha256 {digest[:12]}..., manifest "
                    f"{meta['sha256'][:12]}...): the bytes changed after they were written")
    return None


def _check_fits(manifest: dict, like: dict) -> None:
    """Every key of ``like`` exists in the checkpoint with the same (global) shape."""
    own = manifest["files"]["rank0.pt"]["tensors"]
    for key, leaf in _leaves(like):
        if isinstance(leaf, Shard):
            entry = manifest["shards"].get(key)
            if entry is None:
                raise CheckpointMismatch(f"the checkpoint has no sharded tensor {key}")
            if tuple(entry["global_shape"]) != leaf.global_shape:
                raise CheckpointMismatch(
                    f"{key}: the checkpoint has shape {tuple(entry['global_shape'])}, this run "
                    f"expects {leaf.global_shape} (a different model config?)")
        elif isinstance(leaf, torch.Tensor) and key in own:
            if tuple(own[key]["shape"]) != tuple(leaf.shape):
                raise CheckpointMismatch(
                    f"{key}: the checkpoint has shape {tuple(own[key]['shape'])}, this run "
                    f"expects {tuple(leaf.shape)} (a different model config?)")


def _assemble(key: str, want: Shard, manifest: dict, files: dict) -> Shard:
    """Fill [offset, offset + numel) of ``key`` from the saved pieces that overlap it."""
    lo, hi = want.offset, want.offset + want.data.numel()
    out = torch.empty(hi - lo, dtype=getattr(torch, manifest["shards"][key]["dtype"][6:]))
    covered = torch.zeros(hi - lo, dtype=torch.bool)
    for p in manifest["shards"][key]["pieces"]:
        a, b = max(lo, p["offset"]), min(hi, p["offset"] + p["numel"])
        if a >= b:
            continue
        piece = _lookup(files[p["file"]], key)
        # The manifest is not checksummed: its shard table must agree with the
        # (checksummed) piece itself, or the copy would put elements in the wrong place.
        layout = (tuple(manifest["shards"][key]["global_shape"]), p["offset"], p["numel"])
        found = (piece.global_shape, piece.offset, piece.data.numel()) \
            if isinstance(piece, Shard) else None
        if found != layout:
            raise CheckpointMismatch(
                f"{key}: the manifest places {p['file']}'s piece at (shape, offset, numel) "
                f"{layout}, the file holds {found}: the layout table is corrupt")
        out[a - lo:b - lo] = piece.data[a - piece.offset:b - piece.offset]
        covered[a - lo:b - lo] = True
    if not covered.all():
        raise CheckpointMismatch(f"{key}: the saved pieces cover {int(covered.sum())} of the "
                                 f"{hi - lo} elements [{lo}, {hi}) asked for")
    return Shard(out, want.global_shape, lo)


def _lookup(tree: Any, key: str) -> Any:
    for part in key.strip("/").split("/"):
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return _decode(tree) if isinstance(tree, dict) else tree


def _fill(like: Any, own: Any, path: str, manifest: dict, files: dict) -> Any:
    """The saved tree ``own``, with the Shards that ``like`` asks for assembled from
    every file that holds a piece of them (and saved pieces it does not ask for left out)."""
    if isinstance(like, Shard):
        return _assemble(path, like, manifest, files)
    if isinstance(like, dict):
        if not isinstance(own, dict):
            raise CheckpointMismatch(f"{path or '/'}: the checkpoint holds a "
                                     f"{type(own).__name__}, this run expects a dict")
        missing = [k for k in like if k not in own and not _all_shards(like[k])]
        if missing:
            raise CheckpointMismatch(f"{path or '/'}: the checkpoint has no entry "
                                     f"{missing[0]!r} (it has {sorted(map(str, own))[:8]})")
        # The checkpoint's keys, not the template's: a fresh optimizer's state is
        # empty, the saved one is not. The template adds only its Shard requests.
        # A saved piece this rank did not ask for belongs to another rank's range.
        out = {k: _fill(like.get(k), v, f"{path}/{k}", manifest, files) for k, v in own.items()
               if k in like or not _all_shards(_decode(v))}
        for k, v in like.items():
            if k not in own:
                out[k] = _fill(v, None, f"{path}/{k}", manifest, files)
        return out
    if isinstance(like, (list, tuple)) and _all_shards(like):
        return type(like)(_fill(v, None, f"{path}/{i}", manifest, files)
                          for i, v in enumerate(like))
    return _decode(own)


def _all_shards(tree: Any) -> bool:
    leaves = [leaf for _, leaf in _leaves(tree)]
    return bool(leaves) and all(isinstance(leaf, Shard) for leaf in leaves)


def load_latest(directory: str, like: dict | None = None, group=None) -> Loaded:
    """This rank's state from the newest checkpoint every rank can use. Collective.

    ``like``: optional template of the state this run holds. Its Shards say
    which range of each sharded tensor this rank wants (any world size); its
    tensors' shapes are checked against the checkpoint's (a mismatch raises
    ``CheckpointMismatch`` naming the tensor and both shapes). Without it the
    world size must equal the saved one and the rank gets back what it saved.
    Entries that are not Shards come from this rank's own file when the world
    size is unchanged, else from rank 0's (step counters, sampler positions:
    the same on every rank).
    """
    rank, world = _world(group)
    skipped: list[str] = []
    for step, path, partial in list_checkpoints(directory):
        name = os.path.basename(path)
        if partial:
            reason = "partial save (no manifest.json; never renamed into place)"
        else:
            manifest, reason = _read_manifest(path)
        if reason is None:
            if like is None and manifest["world_size"] != world:
                raise CheckpointMismatch(
                    f"{name} was written by {manifest['world_size']} ranks and this job has "
                    f"{world}: pass like= (the shards this rank holds) to reshard")
            if like is not None:
                _check_fits(manifest, like)
            needed = _files_needed(manifest, like, rank, world)
            reason = _verify(path, manifest, needed)
        # Every rank must resume from the same checkpoint: skip it if any rank cannot use it.
        reasons = _all_gather(reason, group)
        bad = [(r, why) for r, why in enumerate(reasons) if why]
        if bad:
            r, why = bad[0]
            where = "" if partial or world == 1 else f" (rank {r})"
            skipped.append(f"{name}: {why}{where}")
            continue
        files = {f: torch.load(os.path.join(path, f), weights_only=True, mmap=True)
                 for f in needed}
        own = files[needed[0]] if like is None else files[
            f"rank{rank}.pt" if manifest["world_size"] == world else "rank0.pt"]
        state = _decode(own) if like is None else _fill(like, own, "", manifest, files)
        return Loaded(state, step, path, skipped)
    return Loaded(None, None, None, skipped)
