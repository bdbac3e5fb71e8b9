"""Asynchronous checkpointing: stall training only for a copy into memory.

A blocking ``save`` stops every rank for serialization, the write, the fsync
and the manifest. ``AsyncSaver.save`` does only the first part on the
training thread: it copies the state into fresh CPU tensors (a *snapshot*, so
the next optimizer step cannot change what is being written) and hands the
rest to a background thread. The training stall is the copy, a memory
bandwidth cost; the disk time hides behind the next steps.

The background thread still runs collectives (gathering checksums, agreeing on
the commit), so it gets a process group of its own, made once by the
constructor on every rank: collectives on the training group and on this one
may then run at the same time from two threads without mixing.

Costs: a second copy of the state in CPU memory (kept between saves and
reused: the first save pays for allocating it, later ones only copy), and
at most one save in flight (``save`` first waits for the previous one). A
checkpoint counts only once ``wait()`` (or the next ``save``) returned: a job
killed before that resumes from the previous checkpoint.

How production differs: ``torch.distributed.checkpoint.async_save`` does the
same staging (into pinned memory for a fast GPU-to-CPU copy) and also
offers a separate process for the writes, so the Python GIL never slows the
training thread; Megatron-LM and Nemo checkpoint this way.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from helpers.checkpoint.store import Shard, encode, write_checkpoint
from helpers.comm import world_size

__all__ = ["AsyncSaver", "snapshot"]


def snapshot(tree: Any, into: Any = None) -> Any:
    """A copy of ``tree`` whose tensors live in CPU memory of their own.

    ``into``: an earlier snapshot of a tree of the same structure; its tensors
    are reused where shape and dtype match (a copy into memory that is already
    mapped costs no page faults; DCP's ``async_save`` keeps its pinned staging
    buffers the same way).

    The copies run on one intra-op thread. A copy is bound by memory
    bandwidth, not by cores, and a model's state is hundreds of tensors: split
    over OpenMP threads, each tensor pays a fork/join, and on a loaded machine
    every join waits for a descheduled thread (seen on a shared 2-core
    machine: 2 s instead of 0.1 s for 123 MiB in 450 tensors)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _copy(tree, into)
    finally:
        torch.set_num_threads(threads)


def _copy(tree: Any, into: Any) -> Any:
    if isinstance(tree, Shard):
        return Shard(_copy(tree.data, getattr(into, "data", None)), tree.global_shape,
                     tree.offset)
    if isinstance(tree, torch.Tensor):
        src = tree.detach()
        if isinstance(into, torch.Tensor) and into.shape == src.shape \
                and into.dtype == src.dtype:
            return into.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(tree, dict):
        into = into if isinstance(into, dict) else {}
        return {k: _copy(v, into.get(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(tree) \
            else [None] * len(tree)
        return type(tree)(_copy(v, b) for v, b in zip(tree, into))
    return tree


class AsyncSaver:
    """``saver.save(directory, state, step)`` returns after the snapshot; the write
    finishes in the background. ``saver.wait()`` blocks until it is committed
    (and raises what the background thread raised). Construct on every rank."""

    def __init__(self, keep: int | None = None):
        self.keep = keep
        on = world_size() > 1
        # Gloo, whatever the training backend: the writes are CPU work anyway.
        self.group = dist.new_group(backend="gloo") if on else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: Any = None  # the last snapshot, reused by the next save
        self.last_stall_s = 0.0   # training-thread time of the last save()
        self.last_write_s = 0.0   # background time of the last completed save

    def save(self, directory: str, state: dict, step: int) -> float:
        """Snapshot ``state`` and write it in the background; returns the stall in seconds."""
        self.wait()
        t0 = time.perf_counter()
        copy = self._staging = snapshot(state, into=self._staging)
        self.last_stall_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write, args=(directory, copy, step),
                                        name=f"checkpoint-step{step}", daemon=True)
        self._thread.start()
        return self.last_stall_s

    def _write(self, directory: str, state: dict, step: int) -> None:
        t0 = time.perf_counter()
        try:
            tree, layout = encode(state)
            write_checkpoint(directory, step, tree, layout, self.group, keep=self.keep)
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc
        self.last_write_s = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint save failed: {err}") from err
