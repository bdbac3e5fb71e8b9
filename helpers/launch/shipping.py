"""What travels from the caller to a launch's ranks, and how.

``fn`` and its arguments travel *by value* with cloudpickle, so a function
defined in a notebook cell (and everything it closes over) reaches the
ranks; ``LaunchSpec`` carries the rest of the caller's state at the time of
the call (environment, working directory, ``sys.path``, seed).
"""

from __future__ import annotations

import dataclasses
import io
import linecache
import marshal
import os
import pickle
import types
from typing import Any

import cloudpickle


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """Everything a rank of one launch needs, sent once to the server (the
    forked ranks inherit it in memory)."""

    generation: int          # this launch's number: names its store and record files
    world_size: int
    backend: str             # "gloo" or "nccl" (already resolved)
    rundir: str              # the caller's private folder: the launch's store lives there
    pg_timeout: float        # seconds, launch timeout + margin
    seed: int
    seed_per_rank: bool
    environ: dict[str, str]  # the caller's os.environ at the call
    cwd: str
    sys_path: list[str]
    payload: bytes           # (fn, args, kwargs), by ship
    sources: dict[str, tuple]  # linecache entries of the shipped code's cells
    nccl_rules: bool = False  # helpers.launch.nccl_rules: behave as nccl would


class _ShipPickler(cloudpickle.Pickler):
    """cloudpickle, except that code objects keep their file name.

    cloudpickle pickles a notebook function by value, code object included,
    but (from cloudpickle 3.1.3 on) renames the code's file to
    ``<dynamic-code>`` to make pickles deterministic. A rank's traceback and
    the collective recorder then cannot say ``Cell In[4], line 10``. So code
    objects travel here as ``marshal`` bytes, the format of a ``.pyc`` file,
    which keeps every field; caller and ranks run the same interpreter, the
    one condition marshal needs. The pickler also notes which files the code
    came from, so that the cells' source can travel too (see ``ship``)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.filenames: set[str] = set()

    def reducer_override(self, obj):
        if isinstance(obj, types.CodeType):
            self.filenames.add(obj.co_filename)
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)


def ship(obj: Any) -> tuple[bytes, dict[str, tuple]]:
    """``obj`` pickled for a rank, and the source of every notebook cell its
    code came from. A cell's source exists only in the kernel (IPython keeps
    it in ``linecache`` under a made-up file name); a rank that has it can
    print the learner's line in its traceback like any file's."""
    buffer = io.BytesIO()
    pickler = _ShipPickler(buffer)
    pickler.dump(obj)
    sources = {name: linecache.cache[name] for name in pickler.filenames
               if name in linecache.cache and not os.path.exists(name)}
    return buffer.getvalue(), sources
