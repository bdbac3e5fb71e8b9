"""Loading the newest checkpoint every rank can use, resharded to this run's ranks.

Follows the checksum-then-agree rule (a checkpoint is used only if every rank
verified its files) and resharding by overlap of flat ranges, as PyTorch's
``torch.distributed.checkpoint`` reshards by chunk overlap. The files and the
manifest are ``helpers.checkpoint.store.format``'s.

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
import json
import os
from typing import Any

import torch

from helpers.checkpoint.store.agree import gather_all, rank_and_world
from helpers.checkpoint.store.format import FORMAT, Shard, decode, list_checkpoints, tree_leaves

__all__ = ["Loaded", "CheckpointMismatch", "load_latest"]


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
    # what a resharding load read: {sharded key: [(file, lo, hi)]}, the ranges of the
    # saved pieces this rank copied out (chapter 17's picture of a reshard draws them)
    reads: dict = dataclasses.field(default_factory=dict)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    for key, leaf in tree_leaves(like):
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
    for key, leaf in tree_leaves(like):
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


def _assemble(key: str, want: Shard, manifest: dict, files: dict, reads: dict) -> Shard:
    """Fill [offset, offset + numel) of ``key`` from the saved pieces that overlap it,
    noting in ``reads[key]`` each (file, lo, hi) copied."""
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
        reads.setdefault(key, []).append((p["file"], a, b))
    if not covered.all():
        raise CheckpointMismatch(f"{key}: the saved pieces cover {int(covered.sum())} of the "
                                 f"{hi - lo} elements [{lo}, {hi}) asked for")
    return Shard(out, want.global_shape, lo)


def _lookup(tree: Any, key: str) -> Any:
    for part in key.strip("/").split("/"):
        tree = tree[int(part)] if isinstance(tree, (list, tuple)) else tree[part]
    return decode(tree) if isinstance(tree, dict) else tree


def _fill(like: Any, own: Any, path: str, manifest: dict, files: dict, reads: dict) -> Any:
    """The saved tree ``own``, with the Shards that ``like`` asks for assembled from
    every file that holds a piece of them (and saved pieces it does not ask for left out)."""
    if isinstance(like, Shard):
        return _assemble(path, like, manifest, files, reads)
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
        out = {k: _fill(like.get(k), v, f"{path}/{k}", manifest, files, reads)
               for k, v in own.items() if k in like or not _all_shards(decode(v))}
        for k, v in like.items():
            if k not in own:
                out[k] = _fill(v, None, f"{path}/{k}", manifest, files, reads)
        return out
    if isinstance(like, (list, tuple)) and _all_shards(like):
        return type(like)(_fill(v, None, f"{path}/{i}", manifest, files, reads)
                          for i, v in enumerate(like))
    return decode(own)


def _all_shards(tree: Any) -> bool:
    leaves = [leaf for _, leaf in tree_leaves(tree)]
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
    rank, world = rank_and_world(group)
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
        reasons = gather_all(reason, group)
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
        reads: dict = {}
        state = decode(own) if like is None else _fill(like, own, "", manifest, files, reads)
        return Loaded(state, step, path, skipped, reads)
    return Loaded(None, None, None, skipped)
