"""Checks for chapter 17's lab: the atomic save (checked with a rank killed in the middle);
save and restore the data position and the RNG streams; the optimal checkpoint interval."""

from __future__ import annotations

import math
import os
import random
import tempfile
import time

import torch
import torch.distributed as dist

from helpers.checks import CheckFailed, attempt, expect_close, on_ranks, passed
from helpers.checks.course_answers import refusing
from helpers.checks.race_schedule import PARKED, RaceSchedule

__all__ = ["check_atomic_save", "check_resume_extras", "check_optimal_interval"]


# the course's own answers to the exercises, switched off while the learner's code runs
_RNG_HELPERS = {"helpers.checkpoint.state.rng_state": "it is the course's answer to this "
                "exercise: save each generator's state yourself",
                "helpers.checkpoint.state.set_rng_state": "it is the course's answer to this "
                "exercise: restore each generator yourself"}
_INTERVALS = {"helpers.checkpoint.failures.young_interval": "it is the course's answer to "
              "this exercise: derive it", "helpers.checkpoint.failures.daly_interval": ""}


def _advance(sampler, n: int) -> None:
    for _ in range(n):
        next(sampler)


def _draws() -> tuple:
    import numpy as np
    return torch.rand(4), random.random(), float(np.random.rand()), float(np.random.randn())


# The in-process cases: (batches drawn before the capture, NumPy Gaussians drawn before it).
# The sampler (128 samples, 4 a rank, 2 ranks) has 16 steps an epoch: 3 stays in epoch 0,
# 19 is step 3 of epoch 1, where the same step of epoch 0 is another batch. NumPy's legacy
# randn makes Gaussians in pairs and keeps the second (get_state()'s has_gauss and
# cached_gaussian): after an odd number of draws the next one comes from that cache.
_EXTRAS_CASES = ((3, 0), (19, 1))


def _in_process(capture, restore) -> None:
    """The two functions on one process: each stream and the position, one at a time."""
    for batches, gaussians in _EXTRAS_CASES:
        _in_process_case(capture, restore, batches, gaussians)


def _in_process_case(capture, restore, batches: int, gaussians: int) -> None:
    import numpy as np

    from helpers.data import ShardedSampler
    sampler = ShardedSampler(128, 4, rank=0, world_size=2, seed=1)
    _advance(sampler, batches)
    torch.manual_seed(11); random.seed(11); np.random.seed(11)  # noqa: E702
    np.random.randn(gaussians)
    with refusing(exercise="capture/restore", paths=_RNG_HELPERS):
        state = attempt(capture, sampler, what="capture_extras")
    if not isinstance(state, dict):
        raise CheckFailed(f"capture_extras must return a dict, got {type(state).__name__}")
    want_draws, want_batch = _draws(), next(sampler)

    fresh = ShardedSampler(128, 4, rank=0, world_size=2, seed=1)  # a new process: step 0
    torch.manual_seed(99); random.seed(99); np.random.seed(99)  # noqa: E702
    with refusing(exercise="capture/restore", paths=_RNG_HELPERS):
        attempt(restore, state, fresh, what="restore_extras")
    got_draws, got_batch = _draws(), next(fresh)
    where = (f" (captured after {batches} batches and {gaussians} np.random.randn "
             f"draw{'s' * (gaussians != 1)})")
    names = ("torch (dropout masks)", "Python's random", "NumPy's", "NumPy's Gaussian")
    for name, want, got in zip(names, want_draws, got_draws):
        same = torch.equal(want, got) if isinstance(want, torch.Tensor) else want == got
        if same:
            continue
        if name == "NumPy's Gaussian":  # the uniform draw before it matched
            raise CheckFailed(
                f"after restore_extras NumPy's uniform draws match but its Gaussian does "
                f"not{where}: randn makes Gaussians in pairs and keeps the second for the "
                f"next call, in the last two parts of np.random.get_state() (has_gauss, "
                f"cached_gaussian). Save all five parts and set them all back")
        raise CheckFailed(f"after restore_extras, the {name} generator gave other numbers "
                          f"than at capture time{where}: save its state and set it back")
    if not torch.equal(want_batch, got_batch):
        if torch.equal(got_batch, next(iter(ShardedSampler(128, 4, 0, 2, seed=1)))):
            hint = (" The restored sampler gave the first batch of the epoch: it restarted "
                    "from the beginning instead of the saved step.")
        elif fresh.epoch != sampler.epoch:
            hint = (f" The restored sampler drew from epoch {fresh.epoch}, the saved one was "
                    f"in epoch {sampler.epoch} (each epoch has its own order): save and "
                    f"restore the epoch with the step (sampler.state_dict() holds both).")
        else:
            hint = ""
        raise CheckFailed(f"after restore_extras the sampler's next batch is "
                          f"{got_batch.tolist()}, it should be {want_batch.tolist()}"
                          f"{where}.{hint}")


def _bitwise(directory: str, capture, restore) -> dict:
    """Rank function: 6 steps in one go against 3 + a resume through the learner's
    functions (dropout on, so the RNG matters)."""
    import os

    import torch as t

    from helpers.checkpoint.train import resumable_run

    def seed(s):
        import numpy as np
        t.manual_seed(s); random.seed(s); np.random.seed(s)  # noqa: E702

    seed(0)
    full = resumable_run(os.path.join(directory, "full"), 6, save_every=100)
    cut = os.path.join(directory, "cut")
    seed(0)  # the interrupted run starts like the uninterrupted one
    resumable_run(cut, 3, save_every=3, extras=(capture, restore))
    seed(1234)  # the resumed "process" starts from another seed
    resumed = resumable_run(cut, 6, save_every=100, extras=(capture, restore))
    same = all(t.equal(full["params"][k], resumed["params"][k]) for k in full["params"])
    return {"same": same, "start": resumed["start"],
            "losses": (full["losses"], resumed["losses"]),
            "samples": (full["samples"], resumed["samples"])}


def check_resume_extras(capture, restore) -> None:
    """``capture(sampler) -> dict`` and ``restore(state, sampler)``: a resumed run on 2
    ranks must end with exactly the weights of an uninterrupted one.

    First in this process, one stream at a time (each named on failure), twice: after 3
    batches, and in epoch 1 with one NumPy Gaussian drawn (``_EXTRAS_CASES``); then bitwise
    on 2 ranks with dropout on. Catches: torch's generator not saved or not restored
    (dropout masks), Python's or NumPy's generator forgotten, NumPy's state without its
    cached Gaussian (the epoch-1 case, named), the sampler restarted at the beginning of
    the epoch, the sampler's step restored but not its epoch (the epoch-1 case, named), a
    state that ``torch.load(weights_only=True)`` refuses (a
    NumPy array, with advice), a non-dict from capture, and any exception from the
    learner's code (as a CheckFailed naming the function); the course's ``rng_state`` /
    ``set_rng_state`` called instead of written: switched off while they run."""
    _in_process(capture, restore)
    with tempfile.TemporaryDirectory() as d:
        res = on_ranks(_bitwise, 2, d, capture, restore, what="the resume with your functions",
                       hints={"cannot be saved": "store the state as tensors, numbers, "
                              "strings, lists and dicts (e.g. a NumPy array as "
                              "torch.from_numpy(a))"})
    r = res[0]
    if r["start"] != 3:
        raise CheckFailed(f"the resumed run started at step {r['start']}, expected 3")
    full_l, res_l = r["losses"]
    full_s, res_s = r["samples"]
    for s in (4, 5, 6):
        if full_s[s] != res_s[s]:
            raise CheckFailed(f"step {s} of the resumed run used samples {res_s[s]}, the "
                              f"uninterrupted run used {full_s[s]}")
        if full_l[s] != res_l[s]:
            raise CheckFailed(f"step {s}: loss {res_l[s]!r} after the resume, {full_l[s]!r} "
                              f"without interruption: the dropout masks differ")
    if not r["same"]:
        raise CheckFailed("the final weights differ from the uninterrupted run's")
    passed("each generator (NumPy's cached Gaussian too) and the sampler's epoch and step come "
           "back in this process; a run stopped at step 3 and resumed with your functions "
           "ends bitwise equal to one that never stopped (2 ranks, dropout 0.1)")


def check_optimal_interval(optimal_interval) -> None:
    """``optimal_interval(cost, mtbf)``: Young's sqrt(2 C M), any consistent unit.

    Catches: the factor 2 forgotten (sqrt(C M)) or put on the wrong side (sqrt(C M / 2)),
    C / M or M / C under the root, a result rounded to whole seconds or minutes (the
    cases are not perfect squares), a unit converted inside (minutes or hours returned
    for seconds given: the cases use two scales), a non-number returned, and the course's
    ``failures.young_interval`` called instead of derived (switched off while it runs)."""
    cases = [(60.0, 3 * 3600.0), (1.0, 1000.0), (300.0, 11_137.0), (0.5, 7.0)]
    for cost, mtbf in cases:
        with refusing(exercise="optimal_interval", paths=_INTERVALS):
            got = attempt(optimal_interval, cost, mtbf, what="optimal_interval")
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise CheckFailed(f"optimal_interval({cost:g}, {mtbf:g}) returned {got!r}; "
                              f"expected a number of seconds (a float)")
        want = math.sqrt(2 * cost * mtbf)
        # same formula, a few float roundings apart: 1e-12 relative
        expect_close(got, want, f"optimal_interval({cost:g}, {mtbf:g})", rel=1e-12)
    passed("optimal_interval is Young's sqrt(2 x cost x MTBF): a 1-minute save every "
           f"{math.sqrt(2 * 60 * 3 * 3600) / 60:.0f} minutes when a job fails every 3 hours")


# -- the atomic save ---------------------------------------------------------------------

_SAVE_WORLD = 3  # run 1; run 2 (the kill) uses one more rank, so no world size is baked in
_KILL_WORLD = 4


def _payload(rank: int, step: int) -> bytes:
    """Rank ``rank``'s serialized state at ``step``: distinct bytes per rank and step."""
    return bytes((rank * 31 + step * 7 + i) % 256 for i in range(4096 + 512 * rank))


def _fd_path(fd: int) -> str:
    """The file an fd refers to (Linux's /proc; elsewhere its number)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"




def _traced_save(directory: str, step: int, save_fn, kill_rank: int | None,
                 status_dir: str) -> dict:
    """Rank function: the learner's save with os.fsync, os.rename/os.replace and os.mkdir
    traced, and the ranks' order decided by ``RaceSchedule``.

    ``kill_rank``: that rank stops at its first fsync of a regular file (its data file is
    written, not yet durable, the checkpoint not committed), waits until the others have
    gone as far as they can without it, and SIGKILLs itself."""
    import signal
    import stat

    rank, world = dist.get_rank(), dist.get_world_size()
    sched = RaceSchedule(status_dir, rank, world)
    events: list[tuple] = []
    real_fsync, real_rename, real_replace, real_mkdir = os.fsync, os.rename, os.replace, os.mkdir

    def fsync(fd):
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        if regular and rank == kill_rank:
            # as a GPU falling off the bus: its file written, its fsync never returns
            sched.publish("frozen")
            sched.wait_for_others(("done", "raised", "frozen"), {"frozen"})
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)
        st = os.fstat(fd)   # a directory by its inode: /proc's path is Linux-only
        events.append(("fsync", _fd_path(fd) if regular else "<directory>", time.time(),
                       (st.st_dev, st.st_ino)))

    def renamer(real):
        def rename(src, dst, *args, **kwargs):
            sched.publish("renaming")
            sched.wait_for_others(PARKED, set(PARKED) - {"done", "raised"})
            if not os.path.exists(src) and os.path.exists(dst):
                raise RuntimeError(f"more than one rank renamed {os.path.basename(src)} to "
                                   f"{os.path.basename(dst)}: exactly one rank commits")
            real(src, dst, *args, **kwargs)
            events.append(("rename", os.fspath(src), os.fspath(dst), time.time()))
            sched.publish("running")
        return rename

    def mkdir(path, *args, **kwargs):
        if not os.path.isdir(path):
            sched.publish("mkdir")
            sched.wait_for_others(PARKED, set(PARKED) - {"done", "raised"})
        try:
            return real_mkdir(path, *args, **kwargs)
        finally:
            sched.publish("running")

    from helpers.launch import wire

    saved = [(os, "fsync", real_fsync), (os, "rename", real_rename),
             (os, "replace", real_replace), (os, "mkdir", real_mkdir)]
    os.fsync, os.rename, os.replace, os.mkdir = (fsync, renamer(real_rename),
                                                 renamer(real_replace), mkdir)
    sched.publish("running")
    outcome = "raised"
    try:
        # every blocking collective, however spelled, marks this rank blocked in it
        with wire.observing(sched):
            save_fn(directory, step, _payload(rank, step))
        outcome = "done"
    finally:
        for module, name, real in reversed(saved):
            setattr(module, name, real)
        final = os.path.join(directory, f"step{step:08d}")
        committed = os.path.isfile(os.path.join(final, "manifest.json"))
        sched.publish(outcome)
    return {"events": events, "committed_on_return": committed}


def _read_checkpoint(final: str, step: int, world: int) -> str | None:
    """What is wrong with the committed checkpoint ``final``, or None."""
    import hashlib
    import json
    if not os.path.isdir(final):
        return f"{final} does not exist after every rank returned"
    names = sorted(os.listdir(final))
    want_files = [f"rank{r}.bin" for r in range(world)]
    if "manifest.json" not in names:
        return f"{final} has no manifest.json (it holds {names})"
    try:
        with open(os.path.join(final, "manifest.json")) as f:
            manifest = json.load(f)
    except ValueError as exc:
        return f"manifest.json is not valid JSON ({exc})"
    if not isinstance(manifest, dict) or manifest.get("step") != step:
        return f"manifest.json should hold {{'step': {step}, 'files': ...}}, it holds {manifest!r}"
    files = manifest.get("files")
    if not isinstance(files, dict) or sorted(files) != want_files:
        return (f"the manifest lists {sorted(files) if isinstance(files, dict) else files!r}; "
                f"it must list every rank's file, {want_files}: gather every rank's checksum "
                f"before rank 0 writes it")
    for r, name in enumerate(want_files):
        path = os.path.join(final, name)
        if not os.path.isfile(path):
            return f"{name} is listed in the manifest but missing from {final}"
        with open(path, "rb") as f:
            data = f.read()
        if data != _payload(r, step):
            return f"{name} does not hold rank {r}'s bytes ({len(data)} bytes found)"
        if files[name] != hashlib.sha256(data).hexdigest():
            return (f"the manifest's checksum of {name} is {files[name]!r}, not the sha256 "
                    f"hex digest of its bytes")
    return None


def _check_order(results: list[dict], directory: str, step: int) -> None:
    """Every rank fsynced its file; one rename, .partial -> final, after the manifest
    was fsynced; no rank returned before the commit."""
    final = os.path.join(directory, f"step{step:08d}")
    renames = [(r, e) for r, res in enumerate(results) for e in res["events"] if e[0] == "rename"]
    for rank, res in enumerate(results):
        synced = [e[1] for e in res["events"] if e[0] == "fsync"]
        if not any(os.path.basename(p) == f"rank{rank}.bin" for p in synced):
            raise CheckFailed(f"rank {rank} never fsynced rank{rank}.bin: after write() the "
                              f"bytes may still sit in the OS's page cache, and a crash of the "
                              f"node loses them though the manifest says they were written")
    if len(renames) != 1:
        raise CheckFailed(f"{len(renames)} renames happened ({[e[1:3] for _, e in renames]}); "
                          f"a save commits with exactly one: step{step:08d}.partial renamed to "
                          f"step{step:08d}, by one rank, once every file and the manifest are "
                          f"durable")
    rank, (_, src, dst, t_rename) = renames[0]
    if os.path.normpath(dst) != os.path.normpath(final) or \
            os.path.normpath(src) != os.path.normpath(final + ".partial"):
        raise CheckFailed(f"the rename was {src} -> {dst}; the save should write into "
                          f"{final}.partial and rename that directory to {final}")
    manifest_syncs = [e[2] for e in results[rank]["events"]
                      if e[0] == "fsync" and os.path.basename(e[1]) == "manifest.json"]
    if not manifest_syncs or min(manifest_syncs) > t_rename:
        raise CheckFailed(f"rank {rank} renamed the directory before it fsynced manifest.json: "
                          f"a crash right after the rename can leave a committed checkpoint "
                          f"whose manifest is empty or missing")
    early = [r for r, res in enumerate(results) if not res["committed_on_return"]]
    if early:
        raise CheckFailed(f"rank(s) {early} returned before the checkpoint was committed: a rank "
                          f"that goes on training (or is told the save is done) must not return "
                          f"until the rename has happened on rank 0")


def _commit_unsynced(results: list[dict], directory: str) -> str | None:
    """Why the commit is not durable, or None: the renaming rank must fsync ``directory``
    (the rename's parent) after the rename, since the rename is an entry in it."""
    rank, t_rename = next((r, e[3]) for r, res in enumerate(results)
                          for e in res["events"] if e[0] == "rename")
    st = os.stat(directory)
    if any(e[0] == "fsync" and e[1] == "<directory>" and tuple(e[3]) == (st.st_dev, st.st_ino)
           and e[2] >= t_rename for e in results[rank]["events"]):
        return None
    return (f"rank {rank} renamed the checkpoint into place but never fsynced the directory "
            f"that holds it afterwards: the rename is an entry of that directory, and until "
            f"the directory is fsynced a power loss can undo the commit though the save "
            f"returned. Open it (os.open(directory, os.O_RDONLY)), os.fsync the descriptor, "
            f"close it")


def _killed_save_problem(d: str) -> str | None:
    """What the killed step-2 save left wrong, with its cause, or None."""
    import json
    final = os.path.join(d, "step00000002")
    if os.path.exists(final):
        files = sorted(os.listdir(final))
        listed = []
        try:
            with open(os.path.join(final, "manifest.json")) as f:
                listed = sorted(json.load(f).get("files", {}))
        except (OSError, ValueError, AttributeError):
            pass
        if "rank1.bin" in listed:
            return (f"rank 1 was killed at its step-2 fsync (its file written, never made "
                    f"durable), yet step00000002 was committed with a manifest that lists "
                    f"rank1.bin: the checksums were collected before every rank's file was "
                    f"durable. Gather them after each rank's fsync has returned, and commit "
                    f"only then")
        return (f"rank 1 was killed at its step-2 fsync, before any manifest could list its "
                f"file, and step00000002 exists anyway (holding {files}): a reader would take "
                f"an incomplete checkpoint for the newest one. Write into "
                f"step00000002.partial and rename it only when the manifest is durable")
    if os.path.exists(os.path.join(final + ".partial", "manifest.json")):
        return ("rank 1 was killed at its step-2 fsync (its file never durable), and "
                "step00000002.partial already holds a manifest: the manifest must come after "
                "every rank's file is durable (it is the commit marker where there is no "
                "atomic rename)")
    return None


def check_atomic_save(atomic_save) -> None:
    """``atomic_save(directory, step, data)`` on every rank: all files durable, the manifest
    last, one rename; a rank killed in the middle leaves the previous checkpoint usable.

    The ranks' races are scheduled, not left to chance (``RaceSchedule``): before a rank
    creates a directory or renames, and before the killed rank dies, every other rank
    goes as far as it can without it. The verdict is the same on every run.

    Run 1 (3 ranks) catches: nothing written, no rename or a rename by every rank, writing
    straight into the final directory, a rank that skips fsync, a manifest that lists only
    rank 0's file or a checksum other than sha256 of the bytes, a rename before the
    manifest is fsynced, ranks that return before the commit, ranks that write into a
    directory another rank has not created yet (FileNotFoundError, named), and (named
    last, after run 2) a commit whose directory is not fsynced after the rename.
    Run 2 (4 ranks: step 1 saved, then rank 1 stopped at the fsync of its step-2 file and
    killed) catches: a world size written into the code (3 in run 1, 4 here), a
    ``step00000002`` that exists though rank 1 never finished, checksums gathered before the
    files were durable (a manifest naming rank 1's file), and a manifest written early.
    """
    import tempfile

    from helpers.launch import RankError, launch

    hints = {"FileNotFoundError: [Errno 2] No such file or directory": "a rank wrote into a "
             "directory that did not exist yet: another rank was to create it. Create it on "
             "every rank (os.makedirs(..., exist_ok=True)), or have the others wait for it "
             "with a collective"}
    with tempfile.TemporaryDirectory() as status, tempfile.TemporaryDirectory() as d:
        try:  # a stub fails here, before any rank starts; other errors are expected
            attempt(atomic_save, os.path.join(d, "probe"), 0, b"", what="atomic_save")
        except CheckFailed as exc:  # (no process group in this process)
            if "not implemented" in str(exc):
                raise
        results = on_ranks(_traced_save, _SAVE_WORLD, d, 1, atomic_save, None, status,
                           what=f"atomic_save on {_SAVE_WORLD} ranks", timeout=30, hints=hints)
        problem = _read_checkpoint(os.path.join(d, "step00000001"), 1, _SAVE_WORLD)
        if problem:
            raise CheckFailed(f"after atomic_save(directory, 1, data) on {_SAVE_WORLD} ranks: "
                              f"{problem}")
        _check_order(results, d, 1)
        unsynced = _commit_unsynced(results, d)  # said last: the other mistakes come first
    with tempfile.TemporaryDirectory() as status, tempfile.TemporaryDirectory() as d:
        on_ranks(_traced_save, _KILL_WORLD, d, 1, atomic_save, None,
                 tempfile.mkdtemp(dir=status), what=f"atomic_save on {_KILL_WORLD} ranks",
                 timeout=30, hints=hints)
        problem = _read_checkpoint(os.path.join(d, "step00000001"), 1, _KILL_WORLD)
        if problem:
            raise CheckFailed(f"after atomic_save(directory, 1, data) on {_KILL_WORLD} ranks: "
                              f"{problem}")
        try:
            launch(_traced_save, _KILL_WORLD, d, 2, atomic_save, 1, tempfile.mkdtemp(dir=status),
                   timeout=30)
        except RankError:
            pass  # rank 1 was killed: the launch fails, as the job would
        else:
            raise CheckFailed("rank 1 was SIGKILLed in the middle of the step-2 save, yet every "
                              "rank returned: the others must wait for every rank's checksum")
        problem = _killed_save_problem(d)
        if problem:
            raise CheckFailed(problem)
        problem = _read_checkpoint(os.path.join(d, "step00000001"), 1, _KILL_WORLD)
        if problem:
            raise CheckFailed(f"after the killed step-2 save, step 1 is damaged: {problem}")
    if unsynced:
        raise CheckFailed(unsynced)
    passed(f"atomic_save on {_SAVE_WORLD} and {_KILL_WORLD} ranks: every file fsynced, the "
           f"manifest fsynced, then one rename and its directory fsynced; with rank 1 killed "
           f"mid-save, step 2 never appeared and step 1 stayed intact")
