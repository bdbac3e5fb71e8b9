"""Under ``torchrun``: run in the job's own process group, gather every result.

With RANK and WORLD_SIZE in the environment, ``launch`` starts nothing: it
runs ``fn`` in the current process's group (creating it if needed) and
returns every rank's result, gathered with ``all_gather_object``, so the
same chapter code runs multi-node unchanged. ``nccl_rules`` (or
``COURSE_NCCL_RULES=1``) switches NCCL's rules on for a gloo job as in a local
launch, once per process; the local limit on ranks applies to the ranks torchrun
started on this machine (LOCAL_WORLD_SIZE), not to the whole job.

When a rank fails
-----------------
torchrun's agent looks at its workers every ``--monitor-interval`` (0.1 s by
default). The first worker it finds exited with an error is the job's root cause,
and it stops the others (SIGTERM). So a rank is named quickly and correctly only
if the rank that failed exits at once, and the ranks it leaves waiting do not exit
with errors of their own before the agent has seen it:

* **A rank whose function raised** writes one line about it into the job's store
  (``course/attempt<n>/failed``: rank, node, host, the error) and into torchrun's
  error file (what the root cause prints as its traceback), then re-raises, and
  leaves the group *without* the exit barrier. (With the barrier, it waited there
  while its peers waited for it in their collective: the job ended at the group's
  timeout, 60 s or more, with a healthy rank named as the root cause.)
* **A rank that failed only because a peer went away** (a connection closed, reset
  or broken: a symptom) reads that line. If the rank that failed is on another node,
  whose agent will not stop this one, it raises at once a ``RankError`` that names
  it ("rank 3 (node 1, host gpu7) raised ValueError: ..."): torchrun's root cause on
  this node then says which rank started it. If it is on this node, or nobody wrote a
  line yet (a rank killed, out of memory), it waits for this node's agent to stop it,
  at most ``LINGER`` seconds after the first rank of the job saw a peer go, then
  raises the same way (saying no rank reported an error of its own, if none did).
  If the store is gone (torchrun's agent of node rank 0 holds it, and ends once a
  rank of its own failed), it says so at once: that node's root cause names the rank.
* Any other error (a timeout, a mistake of the rank's own) is the rank's own.

Cost: nothing while the job runs; a store round trip or two when a rank fails.
How production differs: torchrun's own answer is ``@record`` on the script's main
(``torch.distributed.elastic.multiprocessing.errors``), which writes the error file;
frameworks add a heartbeat or NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``)
so that survivors stop on their own. Here the rank function's error is recorded
without the script's help, and on gloo there is no watchdog.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import re
import socket
import sys
import time
from typing import Any, NoReturn

from helpers.launch import info, nccl_rules as nccl_rules_mode
from helpers.launch.arguments import group_backend, local_rank_limit, resolve_backend
from helpers.launch.errors import RankError, is_root_cause
from helpers.launch.rank import seed_everything, to_cpu

# Longest a rank that saw a peer go away waits for its agent to stop it, counted
# from the first such sighting in the job (so ranks that see it later, one after
# another, do not each wait again). torchrun's agent looks every --monitor-interval
# (0.1 s by default) and then stops the node's workers at once.
LINGER = 5.0

# What a backend says when the other side of a connection went away (gloo's pair.cc,
# the OS's errno text, nccl's "remote process exited").
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused",
              "remote process exited")

_STATE = {"failed": False, "rules": False}


def _attempt() -> str:
    """torchrun's restart number: keys of one attempt never meet another's."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _key(name: str) -> str:
    return f"course/attempt{_attempt()}/{name}"


def _node() -> str:
    """Which agent (node) started this rank: torchrun's GROUP_RANK."""
    return os.environ.get("GROUP_RANK", "0")


def _store():
    from torch.distributed.distributed_c10d import _get_default_store
    return _get_default_store()


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an error, without the C++ source location gloo puts first
    ("[/__w/pytorch/pytorch/third_party/gloo/.../pair.cc:553] Connection closed ...")."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", lines[0] if lines else "")
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def _destroy_group_at_exit() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        # No rank tears down while a peer still talks to it; but a rank that failed
        # must not wait there: its peers wait for it elsewhere (in their collective),
        # and both sides would wait for the group's timeout. sys.last_value: an
        # exception reached the top of the script (after launch returned, say).
        if not _STATE["failed"] and getattr(sys, "last_value", None) is None:
            with contextlib.suppress(Exception):
                dist.barrier()
        dist.destroy_process_group()


def launch_under_torchrun(fn, world_size, args, kwargs, backend, timeout, seed, seed_per_rank,
                          nccl_rules=None):
    import torch
    import torch.distributed as dist

    env_world = int(os.environ["WORLD_SIZE"])
    asked = backend
    if world_size != env_world:
        raise ValueError(f"launch(..., world_size={world_size}) under torchrun with "
                         f"WORLD_SIZE={env_world}: pass the job's world size "
                         f"(rank_info().world_size)")
    if not dist.is_initialized():
        # Every process must pick the same backend, so decide on what they all
        # see alike (GPUs per node vs processes per node), never on this
        # process's own LOCAL_RANK: with 1 GPU and 2 processes that would give
        # rank 0 nccl and rank 1 gloo, and the job fails at the first collective.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        backend = resolve_backend(backend, local_world)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(group_backend(backend),
                                timeout=datetime.timedelta(seconds=timeout))
        # We made the group, so we take it down: a group still alive when the
        # interpreter exits can abort the process ("terminate called without an
        # active exception" from a gloo thread), failing a job that succeeded.
        atexit.register(_destroy_group_at_exit)
    # From here on the job's store exists, so a failure can be told to every rank.
    try:
        _check_local_ranks()
        _install_rules(nccl_rules, timeout, asked)
        rank = dist.get_rank()
        seed_everything(seed + rank if seed_per_rank else seed)
        result = to_cpu(fn(*args, **kwargs))
        results: list[Any] = [None] * env_world
        dist.all_gather_object(results, result)
        return results
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, SystemExit too
        _fail(exc)
        raise


def _check_local_ranks() -> None:
    """A launch's limit on ranks per machine, for the ranks torchrun started here."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    limit, cores = local_rank_limit(), os.cpu_count() or 1
    if local > limit:
        raise ValueError(f"torchrun started {local} ranks on this machine "
                         f"(LOCAL_WORLD_SIZE={local}) for its {cores} cores: they would thrash; "
                         f"use at most {limit} per machine (--nproc_per_node), on more machines")


def _install_rules(flag: bool | None, timeout: float, asked: str = "auto") -> None:
    """NCCL's rules on a gloo job, as ``launch(..., nccl_rules=)`` gives a local one.
    Installed once per process (they watch every process group of it), on the job's
    store under this attempt's prefix; not on a job that has nccl ("cpu:gloo,cuda:nccl")."""
    import torch.distributed as dist

    if _STATE["rules"] or not nccl_rules_mode.requested(flag, asked) or \
            "nccl" in dist.get_backend():
        return
    nccl_rules_mode.install(dist.PrefixStore(_key("nccl_rules"), _store()), timeout)
    _STATE["rules"] = True
    info.set_torchrun_nccl_rules(True)


def _record_for_torchrun(exc: BaseException) -> None:
    """torchrun's error file for this worker: what its root cause prints."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        with contextlib.suppress(Exception):
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
            ErrorHandler().record_exception(exc)


def _report(store) -> dict | None:
    """The first failed rank's line in the job's store, if one wrote it."""
    if store.check([_key("failed")]):
        return json.loads(store.get(_key("failed")))
    return None


def _read_report() -> dict | None:
    with contextlib.suppress(Exception):
        return _report(_store())
    return None


def _fail(exc: BaseException) -> None:
    """Called in a rank whose function raised ``exc``. Returns when ``exc`` is this
    rank's own error, after telling the job (the caller re-raises it); raises a
    ``RankError`` naming the rank that started it when ``exc`` is a symptom of
    another rank's failure."""
    import torch.distributed as dist

    _STATE["failed"] = True
    own = is_root_cause("error", (type(exc).__name__, str(exc)))  # not a communication error
    mine = _first_line(exc)
    if not own:
        mine = mine.split(". ")[0]  # (gloo goes on: "This is typically caused by ...")
    if not own and any(w in str(exc).lower() for w in _PEER_GONE):
        _peer_failed(exc, mine, *_wait_for_agent())
    report = _read_report()
    if report is not None and report["rank"] != dist.get_rank() and not own:
        _peer_failed(exc, mine, report)  # a timeout, say, after another rank failed
    line = json.dumps({"rank": dist.get_rank(), "node": _node(), "host": socket.gethostname(),
                       "error": mine})
    with contextlib.suppress(Exception):
        _store().compare_set(_key("failed"), "", line)  # the first rank to fail is named
    _record_for_torchrun(exc)


def _wait_for_agent() -> tuple[dict | None, bool]:
    """A peer went away. Wait (up to LINGER s after the job's first such sighting) for
    this node's agent to stop this rank, unless the report names a rank on another
    node. Returns the report, if any, and whether the store answered: it lives in the
    agent of node rank 0, which ends once a rank of its own failed."""
    store = _store()
    try:
        first = float(store.compare_set(_key("peer_gone_at"), "", repr(time.time())))
        report = _report(store)
        while (report is None or report["node"] == _node()) and time.time() < first + LINGER:
            time.sleep(0.05)
            if report is None:
                report = _report(store)
        return report, True
    except Exception:  # (the store's connection is gone: asking again only fails again)
        return None, False


def _peer_failed(exc: BaseException, mine: str, report: dict | None,
                 store_answered: bool = True) -> NoReturn:
    import torch.distributed as dist

    me = dist.get_rank()
    if not store_answered:
        store = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        err = RankError(f"rank {me} stopped because a peer went away ({mine}), and the job's "
                        f"store at {store} is gone too: it lives in the torchrun agent of node "
                        f"rank 0, which ends once a rank of its own failed. That node's "
                        f"'Root Cause' names the rank.", rank=me, exc_type="died")
    elif report is None:
        err = RankError(f"rank {me} stopped because a peer went away ({mine}), and no rank "
                        f"reported an error of its own within {LINGER:g} s: a rank died (killed, "
                        f"out of memory, a crash) or its node went away. torchrun's 'Root Cause' "
                        f"on the node that lost it names that rank.", rank=me, exc_type="died")
    else:
        where = f"node {report['node']}, host {report['host']}"
        err = RankError(f"rank {report['rank']} ({where}) raised {report['error']}\n"
                        f"(rank {me} stopped because of it: {mine})",
                        rank=report["rank"], exc_type=report["error"].split(":")[0])
    try:
        raise err from exc
    except RankError:  # (recorded while handled: the error file gets its traceback)
        _record_for_torchrun(err)
        raise
