"""A training job for ``torchrun``, and a bounded way to run it from a notebook or test.

    python -m torch.distributed.run --standalone --nproc_per_node=2 --max-restarts=2 \\
        -m helpers.checkpoint.job CHECKPOINT_DIR RESULT_FILE --steps 6 --kill-in-save 4:1

On its first attempt (``TORCHELASTIC_RESTART_COUNT`` = 0) rank 1 SIGKILLs
itself in the middle of the step-4 save. Rank 0 then fails in its next
collective (the peer's socket closed), the torchrun agent sees a failed
worker, stops the group and starts every worker again (attempt 1). The
script itself does nothing special on a restart: ``resumable_run`` resumes
from the newest checkpoint every rank can use, which is step 2 (step 4's
directory is still ``.partial``). Rank 0 writes the result to RESULT_FILE.

``run_torchrun`` sets ``OMP_NUM_THREADS=1`` (what torchrun itself would set for
more than one worker); the result's ``threads`` is the count the worker had.
The run's arithmetic does not depend on it: ``resumable_run`` pins its own
intra-op thread count, so this job and a reference trained with ``launch``
(``cpu_count // world_size`` threads per rank) can be compared bitwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

__all__ = ["run_torchrun", "start_torchrun", "TorchrunJob"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TorchrunJob:
    """A torchrun job started in the background (``start_torchrun``): ``wait()`` returns
    what ``run_torchrun`` returns. Its processes are one session, killed on a timeout."""

    def __init__(self, proc: subprocess.Popen, result: str, timeout: float, t0: float):
        self.proc, self.result, self.timeout, self.t0 = proc, result, timeout, t0

    def wait(self) -> dict:
        """Block until the job ends (at most ``timeout`` seconds after it started)."""
        left = max(1.0, self.timeout - (time.perf_counter() - self.t0))
        try:
            log, _ = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            log, _ = self.proc.communicate()
            raise TimeoutError(f"torchrun did not finish within {self.timeout:g} s; its "
                               f"output:\n{log}")
        code = self.proc.returncode
        out = torch.load(self.result, weights_only=True) if code == 0 else None
        return {"returncode": code, "seconds": time.perf_counter() - self.t0, "log": log,
                "result": out}


def start_torchrun(directory: str, result: str, steps: int = 6,
                   kill_in_save: str | None = "4:1", nproc: int = 2, max_restarts: int = 2,
                   timeout: float = 180.0) -> TorchrunJob:
    """Start the job under torchrun (CPU, gloo, 127.0.0.1) and return at once; the job
    runs while the caller does other work (its processes mostly start up: Python and
    torch, for the agent and, twice, for each worker). ``TorchrunJob.wait()`` for the
    outcome, bounded by ``timeout`` from now."""
    cmd = [sys.executable, "-m", "helpers.checkpoint.job", "--torchrun", "--standalone",
           f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
           "--start-method=fork", "--run-path", os.path.abspath(__file__),
           directory, result, "--steps", str(steps)]
    if kill_in_save:
        cmd += ["--kill-in-save", kill_in_save]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo on CPU, whatever the node
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    t0 = time.perf_counter()
    # start_new_session: on a timeout we kill the agent and its workers as one group
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return TorchrunJob(proc, result, timeout, t0)


def run_torchrun(directory: str, result: str, steps: int = 6, kill_in_save: str | None = "4:1",
                 nproc: int = 2, max_restarts: int = 2, timeout: float = 180.0) -> dict:
    """Run the job under torchrun (CPU, gloo, 127.0.0.1); never longer than ``timeout``.

    Returns {"returncode", "seconds", "log": torchrun's output, "result": rank 0's
    result (None if the job failed)}."""
    return start_torchrun(directory, result, steps, kill_in_save, nproc, max_restarts,
                          timeout).wait()


def main(argv=None) -> None:
    from helpers import launch
    from helpers.checkpoint.train import resumable_run

    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("result")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-in-save", default=None, help="STEP:RANK, first attempt only")
    args = p.parse_args(argv)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    crash = None
    if args.kill_in_save and attempt == 0:
        crash = tuple(int(v) for v in args.kill_in_save.split(":"))
    world = int(os.environ["WORLD_SIZE"])
    threads = torch.get_num_threads()  # the worker's own, before resumable_run pins it
    _init_group(attempt, world)
    res = launch(resumable_run, world, args.directory, args.steps, crash_in_save=crash,
                 timeout=60)
    if int(os.environ["RANK"]) == 0:
        r = res[0]
        print(f"attempt {attempt}: started at step {r['start']}, trained to {args.steps}"
              + "".join(f"; skipped {s}" for s in r["skipped"]), flush=True)
        torch.save({"attempt": attempt, "start": r["start"], "params": r["params"],
                    "losses": r["losses"], "skipped": r["skipped"], "threads": threads},
                   args.result)
    import torch.distributed as dist
    dist.barrier()  # no rank tears down while a peer still talks to it
    dist.destroy_process_group()


def _init_group(attempt: int, world: int) -> None:
    """The gloo group on the agent's store, under a key prefix of its own per attempt.

    Why not ``init_process_group("gloo")`` (``env://``): in torch 2.13 torchrun's
    c10d rendezvous keeps one TCP store for every restart
    (``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``: the store is
    shared unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and ``env://`` puts
    no per-attempt prefix on it (``torch/distributed/rendezvous.py``,
    ``_create_c10d_store``: its comment still assumes a new store per retry). A
    restarted rank could then read the address that the killed attempt's rank 0
    published (seen: "connectFullMesh ... Connection refused", and the restart
    failed again, so the job finished only on its second restart); each
    attempt's ranks now rendezvous only with each other."""
    import datetime

    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"course-attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world,
                            timeout=datetime.timedelta(seconds=90))


def torchrun(argv: list[str]) -> None:
    """torchrun itself (``torch.distributed.run.main``, what the ``torchrun`` command
    runs) with ``argv``, in a process that has already imported what every worker
    imports. With ``--start-method=fork --run-path`` torchrun forks each worker from
    this process and runs the script in it, so a worker, and a restarted one, starts
    with torch and ``torch._dynamo`` imported (every optimizer's constructor imports
    the latter) instead of paying a few seconds of CPU to import them again."""
    import torch._dynamo  # noqa: F401
    import torch.distributed  # noqa: F401
    from torch.distributed.run import main as torchrun_main

    import helpers.checkpoint.train  # noqa: F401
    torchrun_main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--torchrun"]:
        torchrun(sys.argv[2:])
    else:
        main()
