"""The on-disk format of a checkpoint: its files, its names, and the state tree it holds.

A small version of the design of PyTorch's ``torch.distributed.checkpoint``
(one file per rank plus a ``.metadata`` file describing every chunk), with
``torch.save`` / ``torch.load(weights_only=True)`` for the files. Written by
``helpers.checkpoint.store.write``, read by ``helpers.checkpoint.store.load``.

Layout of one checkpoint (``step00000012/``)::

    rank0.pt  rank1.pt ...   one file per rank: that rank's state tree
    manifest.json            written last: step, world size, torch version,
                             sha256 and size of every file, and where each
                             shard lives (key, global shape, flat offset, numel)

A ``Shard`` is a rank's piece of a larger tensor, elements ``[offset, offset
+ numel)`` of the tensor flattened in row-major order (the way ZeRO and FSDP
cut flat buffers); the manifest lists every piece of every key, which is
what lets a job of another size read back the ranges it owns.

The state tree: tensors, Shards and plain Python values, nothing else.
torch.load(weights_only=True) refuses arbitrary objects (unpickling one can
run any code), so we refuse them at save time, naming the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import re
import threading
from typing import Any

import torch

__all__ = ["FORMAT", "Shard", "checkpoint_dir", "list_checkpoints", "encode", "write_tree",
           "decode", "tree_leaves"]

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


def checkpoint_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step{step:08d}")


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


def decode(obj: Any) -> Any:
    """The tree as saved, its tagged dicts turned back into Shards."""
    if isinstance(obj, dict):
        if obj.get(_SHARD_TAG) is True:
            return Shard(obj["data"], tuple(obj["global_shape"]), int(obj["offset"]))
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(decode(v) for v in obj)
    return obj


def tree_leaves(tree: Any, path: str = ""):
    """(path, leaf) of a tree, Shards and tensors as leaves."""
    if isinstance(tree, dict) and not tree.get(_SHARD_TAG):
        for k, v in tree.items():
            yield from tree_leaves(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from tree_leaves(v, f"{path}/{i}")
    else:
        yield path, tree


def encode(state: dict) -> tuple[Any, dict]:
    """(the tree the rank's file holds, its layout for the manifest). Raises TypeError
    naming the key of anything ``torch.load(weights_only=True)`` would refuse.
    ``torch.save`` of the tree is the file (``write_tree``)."""
    shards: dict[str, Shard] = {}
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, "", shards, tensors)
    layout = {
        "shards": {k: {"global_shape": list(s.global_shape), "offset": s.offset,
                       "numel": s.data.numel(), "dtype": str(s.data.dtype)}
                   for k, s in shards.items()},
        "tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype)}
                    for k, t in tensors.items()},
    }
    return encoded, layout


def write_tree(path: str, encoded: Any) -> tuple[int, str]:
    """Write an ``encode``d tree as the file ``path``, durably (data fsynced); returns
    (its size in bytes, its sha256, hex).

    ``torch.save`` writes into the file itself (through memory, it would first copy the
    whole state into a growing buffer). The checksum is of the bytes in the file: read
    back from the page cache (mmap, no copy), hashed in a thread while ``fsync`` waits
    for the disk; both release the GIL, so the hash costs no wall time where the disk
    is the slower of the two."""
    with open(path, "w+b") as f:  # (+: readable, for the mmap)
        torch.save(encoded, f)
        f.flush()                 # Python's buffer -> the OS
        size = f.tell()
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as view:
            found: dict[str, Any] = {}

            def digest() -> None:
                try:
                    found["sha256"] = hashlib.sha256(view).hexdigest()
                except BaseException as exc:  # noqa: BLE001 - raised below, in the caller
                    found["error"] = exc

            hasher = threading.Thread(target=digest, name="checkpoint-sha256")
            hasher.start()
            try:
                os.fsync(f.fileno())  # the OS's page cache -> the disk
            finally:
                hasher.join()
    if "error" in found:
        raise found["error"]
    return size, found["sha256"]
