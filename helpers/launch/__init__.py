"""Run one Python function on N ranks, from a notebook cell, and never hang.

The launcher is a package, one part per module, in the order a launch uses them:

* ``launcher``: ``launch()`` itself, the caller's side of one launch;
* ``arguments``: the backend and the arguments, checked before any rank starts;
* ``shipping``: what travels to the ranks (``fn`` by value, ``LaunchSpec``);
* ``pool`` and ``server``: the rank server that forks fresh ranks, and the
  caller's handle on it;
* ``rank``: what a rank does, from its fork to its exit;
* ``errors``: ``RankError``, ``RankTimeout`` and how the root cause is named;
* ``info``: ``rank_info()``; ``torchrun``: the same code under torchrun, where a
  rank that raises is named in seconds on every node; ``python -m helpers.launch``
  (``__main__``): torchrun with a bound on waiting for the nodes;
* ``hooks``: the extension points other parts of the course plug into (the
  collective recorder of ``helpers.debug`` does);
* ``wire``: every call that reaches a process group, seen in one place (the lab
  checks' spy and NCCL's rules watch there, whatever the spelling of the call);
* ``nccl_rules``: gloo behaving as nccl would where the outcome differs
  (``launch(..., nccl_rules=True)`` or ``COURSE_NCCL_RULES=1``), so that a hang or
  error a GPU node would show appears on a laptop and in CI; ``nccl_hangs``: the
  caller's side, saying who waited for whom when such a launch hangs.

Every chapter of the course ends up calling::

    from helpers import launch, rank_info

    def step():
        info = rank_info()
        t = torch.ones(1) * info.rank
        dist.all_reduce(t)
        return t.item()

    launch(step, 4)          # -> [6.0, 6.0, 6.0, 6.0], one value per rank

How it works
------------
* ``launch`` ships ``fn`` *by value* with cloudpickle, so a function defined in
  a notebook cell (and everything it closes over) reaches the ranks.
* **Fresh ranks for every launch, from a rank server.** Starting a Python
  process that imports torch costs about 2 s on a laptop core. So the first
  launch starts one helper process, the *rank server*, that imports torch once
  and then waits. Every launch asks it to ``fork()`` ``world_size`` new ranks:
  a fork copies the server's memory lazily (copy-on-write), so a rank with
  torch already imported exists in a few milliseconds. Each rank runs ``fn``
  once, inside a new process group, and exits. This is what Python's
  ``forkserver`` start method does, and what Android's "zygote" does for apps.
  To keep forking off a launch's path, the server forks the next launch's
  ranks ahead of time ("spares", which run nothing until their launch).
  ``ps`` shows them as course-server, course-spare and course-rank.
* What a launch carries over from the caller (the notebook), read at the time
  of the call: the environment variables (``os.environ``; so
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` set in a cell takes effect at the next
  launch), the working directory and ``sys.path``. What it does *not* carry
  over: anything an earlier launch did in its ranks (default dtype, grad
  mode, imported or reloaded modules, global hooks, threads, random state),
  because those ranks are gone; and anything the notebook did to its own
  torch (``torch.set_default_dtype`` in the notebook does not reach the
  ranks: set it inside ``fn``). Modules that ``fn`` uses by reference
  (``from mymodule import f``) are imported afresh by each rank, so an edited
  file runs its new code. The server itself has imported torch and
  ``helpers.launch``; if one of the course's files it imported changes on
  disk, or an environment variable that is read only when torch is imported
  (``OMP_*``, ``MKL_*``, ``TORCH_LOGS``, ``PYTHON*``, ...) changes, the next
  launch restarts the server and says so.
* Cost: the first launch pays the server's start (importing torch, once);
  every later launch, of any world size, costs forking the ranks (or taking
  the spares), one rendezvous and one round trip, and a fresh process runs
  its first collective slower than a warm one: about a tenth of a second
  for 4 ranks on a quiet 2-core laptop, several times more on a busy one,
  against tens of milliseconds when ranks were reused and seconds for
  ``torch.multiprocessing.spawn`` (``benchmarks/bench_launch.py`` measures
  all three).
* Rendezvous: each launch's ranks meet through a ``FileStore``, a file of the
  launch's own in a folder only this user can enter (mode 0700, in /dev/shm where
  there is one). torchrun's ``TCPStore`` listens on a port that any user of the
  machine can connect to and write into; on a shared workshop node that would let
  another user join or disturb a learner's launch. No port is chosen, so two
  launches at once cannot collide either.
* The caller waits on every rank's socket at once, with a deadline (a rank
  that dies closes its socket, so a death is seen at once). Three ways a
  launch can fail, and what you get:

  - a rank raises: ``RankError`` naming the rank, the exception type, message
    and the rank's own traceback. In a notebook it shows only the rank, the
    exception and the frames of your code (``err.rank_traceback`` has all).
  - a rank dies (``os._exit``, SIGKILL, a segfault): ``RankError`` naming the
    rank and how it died (exit code or signal).
  - a deadlock: ``RankTimeout`` after ``timeout`` seconds naming the ranks that
    did not finish. The process group's own timeout is set a little longer, so
    the launcher, not gloo, reports it.

  In every case, and on Ctrl-C (Jupyter's "interrupt"), all of the launch's
  ranks are gone when the exception reaches you, and the kernel is untouched.
  The server stays: it never runs your code, so nothing can go wrong in it.
* Lifetime: the server and its ranks run in their own process group, so the
  SIGINT that Jupyter sends to the kernel's group for an unrelated cell does
  not touch them; they watch the socket to the caller instead, and die when
  the caller's process ends (whichever thread started them). A server that
  did die is replaced by the next launch, silently.
* ``print`` inside a rank reaches the caller line by line as ``[rank 1] ...``, up
  to 1,000 lines per rank and launch (a browser tab freezes on a few hundred
  thousand); the rest is kept in a file, and the launch ends with a note naming it.
* In a notebook, ``import helpers`` starts the rank server in the background, so
  its seconds of importing torch overlap the notebook's first cells.
* Under ``torchrun`` (RANK and WORLD_SIZE set in the environment) ``launch``
  does not spawn anything: it runs ``fn`` in the current process's group and
  returns every rank's result (gathered with ``all_gather_object``), so the same
  chapter code runs multi-node unchanged. A rank whose function raises exits at
  once and is torchrun's root cause; ranks on other nodes stop with a ``RankError``
  naming it (``helpers.launch.torchrun``).

Seeding: before ``fn`` runs, every rank calls ``torch.manual_seed(seed)``
(and seeds ``random`` and numpy) with the *same* ``seed`` (default 0), so a
rank's random numbers equal a single-process reference's. Pass
``seed_per_rank=True`` to seed rank r with ``seed + r`` instead.

How the production tools differ: ``torchrun``/``torch.multiprocessing.spawn``
start fresh interpreters for every job (each imports torch) and rely on the
job being a script; an elastic agent restarts failed workers. A notebook
needs cheap repeated launches of small functions and a clean error instead of
a restart. Forking needs a POSIX system (Linux, macOS) and a server that has
not initialized CUDA: ours only imports (as a DataLoader's forked workers,
it relies on OpenBLAS, which numpy loads, being safe to fork).
"""


from helpers.launch.errors import RankError, RankTimeout
from helpers.launch.hooks import register_failure_report, register_option, rank_channel
from helpers.launch.info import RankInfo, rank_info
from helpers.launch.launcher import launch
from helpers.launch.pool import shutdown

__all__ = ["launch", "rank_info", "RankInfo", "RankError", "RankTimeout", "shutdown",
           "rank_channel", "register_option", "register_failure_report"]
