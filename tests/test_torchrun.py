"""The course under torchrun: a rank that raises is named in seconds, on one machine and
across two agents standing in for two nodes; README's multi-node recipe, run as written
on one machine; a node that never comes; the rules and the per-machine limit.

Each job pays a Python + torch start per process (about 1.5 s of CPU each, on two
cores), which is most of its few seconds. (tests/test_launch.py has the success path
under ``torchrun --standalone``.)
"""

import contextlib
import fcntl
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.launch import arguments, torchrun as course_torchrun
from helpers.launch.__main__ import JOIN_TIMEOUT, with_course_defaults

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")

JOB = textwrap.dedent('''
    import os, sys, time
    import torch, torch.distributed as dist
    from helpers import launch, rank_info

    def listening():
        """Addresses this process accepts TCP connections on (gloo's), from /proc."""
        links = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # (the listing's own descriptor, closed by now)
                pass
        ours = {link[8:-1] for link in links if link.startswith("socket:[")}
        with open("/proc/net/tcp") as f:
            rows = [r.split() for r in f.read().splitlines()[1:]]
        return sorted({".".join(str(int(r[1][i:i + 2], 16)) for i in (6, 4, 2, 0))
                       for r in rows if r[3] == "0A" and r[9] in ours})

    def look():
        info = rank_info()
        try:
            dist.all_reduce(torch.ones(1, dtype=torch.int64), op=dist.ReduceOp.BAND)
            band = "allowed"
        except ValueError:
            band = "refused"
        t = torch.ones(1)
        dist.all_reduce(t)
        return (info.rank, info.nccl_rules, band, t.item(), os.environ["MASTER_ADDR"],
                listening())

    def fail(bad):
        if rank_info().rank == bad:
            sys.stderr.write(f"RAISED_AT {time.time()}\\n")
            sys.stderr.flush()
            raise ValueError(f"rank {bad} fails on purpose")
        t = torch.ones(1)
        dist.all_reduce(t)  # waits for the rank that raised
        return t.item()

    if __name__ == "__main__":
        world = rank_info().world_size
        if sys.argv[1] == "look":
            results = launch(look, world)
            if rank_info().is_main:
                sys.stdout.write(f"LOOK {results!r}\\n")
                sys.stdout.flush()
        launch(fail, world, int(sys.argv[2]))
''')


# Seconds from a rank's raise to the end of every agent: 1-2 s on a quiet two-core
# machine, 5.7 s seen at load average 10 (processes exit slowly: the ranks had stopped
# within the raise's second). With the exit barrier it was the group's timeout, 60 s.
NAMED_WITHIN = 15


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               COURSE_NCCL_RULES="1", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        if name not in extra:
            env.pop(name, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run_together(commands, logs, env, timeout=150.0):
    """Start the commands at once (each its own session, its output in a file); return
    each one's exit status and the time.time() at which it was seen to end."""
    procs = [subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                              cwd=ROOT, start_new_session=True) for cmd, log in zip(commands, logs)]
    ended = [None] * len(procs)
    deadline = time.monotonic() + timeout
    try:
        while None in ended:
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout:g} s: "
                                     + "\n---\n".join(open(log).read()[-3000:] for log in logs))
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 9)
                p.wait()
    return [p.returncode for p in procs], ended, [open(log).read() for log in logs]


def _raised_at(out: str) -> float:
    return float(re.search(r"RAISED_AT ([\d.]+)", out).group(1))


def _root_cause(out: str) -> str:
    """torchrun's "Root Cause" block."""
    assert "Root Cause (first observed failure):" in out, out[-3000:]
    return out.split("Root Cause (first observed failure):")[1].split("=" * 20)[0]


def test_a_rank_that_raises_is_named_at_once(tmp_path):
    """torchrun --standalone, 2 ranks, rank 1 raises while rank 0 waits in an
    all-reduce: the job ends in seconds with rank 1 as torchrun's root cause, its
    traceback in it. (The exit barrier made it the group's timeout, 60 s and more, and
    could name a healthy rank.)"""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    codes, ended, outs = _run_together(
        [[TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), "fail", "1"]],
        [tmp_path / "log"], _env())
    out = outs[0]
    assert codes[0] != 0
    root = _root_cause(out)
    assert re.search(r"rank\s*: 1 ", root) and "ValueError: rank 1 fails on purpose" in root, out
    assert "Timed out" not in out, out
    took = ended[0] - _raised_at(out)
    print(f"standalone: torchrun ended {took:.2f} s after rank 1 raised")
    assert took < NAMED_WITHIN, out


def _interface_address():
    """A non-loopback interface with an IPv4 address, else the loopback."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            return name, socket.inet_ntoa(packed[20:24])  # SIOCGIFADDR
    return "lo", "127.0.0.1"


def _readme_recipe(script, iface, address, port, run_id) -> str:
    """README's multi-node lines, as a node runs them, with this machine's names: node0
    is this machine's host name, one rank per node, this test's job."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Multi-node with torchrun.*?```bash\n(.*?)```", text, re.S).group(1)
    for old, new in (("IFACE=eth0", f"IFACE={iface}"),
                     ("node0:29500", f"{socket.gethostname()}:{port}"),
                     ("--nproc_per_node=8", "--nproc_per_node=1"),
                     ("course-ch04", run_id), ("ch04_job.py", f"{script} look 1"),
                     ("python -m helpers.launch", f"{sys.executable} -m helpers.launch")):
        assert old in block, f"README's multi-node recipe no longer says {old!r}:\n{block}"
        block = block.replace(old, new)
    if shutil.which("ip") is None:  # (iproute2 missing: this machine's address, found here)
        block = re.sub(r"^ADDR=.*$", f"ADDR={address}", block, flags=re.M)
    return block


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc (Linux)")
def test_readme_multinode_recipe_on_one_machine(tmp_path):
    """README's lines, run twice at once on one machine as two nodes of one rank each:
    the rules are on (COURSE_NCCL_RULES=1), gloo listens on $IFACE's address, the ranks
    find the agents' store at $ADDR. Then rank 1 (node 1) raises: node 1's root cause is
    rank 1, node 0's is rank 0 stopping with a RankError that names rank 1, in seconds."""
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        pytest.skip("this machine's host name does not resolve: it cannot stand in for node0")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    iface, address = _interface_address()
    recipe = _readme_recipe(script, iface, address, _free_port(), f"test-{os.getpid()}")
    codes, ended, outs = _run_together([["bash", "-c", recipe]] * 2,
                                       [tmp_path / "node_a", tmp_path / "node_b"], _env())
    both = "\n".join(outs)
    assert codes[0] != 0 and codes[1] != 0, both
    look = re.search(r"LOOK (\[.*\])", both)
    assert look, both
    results = eval(look.group(1))  # (rank, rules, BAND, total, MASTER_ADDR, listening)
    assert [r[:5] for r in results] == [(r, True, "refused", 2.0, address) for r in range(2)]
    assert all(r[5] == [address] for r in results), results
    # which agent became node 1 is the rendezvous' choice: the one whose rank raised
    raiser = next(i for i, out in enumerate(outs) if "RAISED_AT" in out)
    other = 1 - raiser
    root = _root_cause(outs[raiser])
    assert re.search(r"rank\s*: 1 ", root) and "ValueError: rank 1 fails on purpose" in root
    root = _root_cause(outs[other])
    assert re.search(r"rank\s*: 0 ", root), outs[other]
    assert re.search(r"RankError: rank 1 \(node 1, host [^)]*\) raised ValueError: "
                     r"rank 1 fails on purpose", root), root
    assert "Timed out" not in both, both
    took = max(ended) - _raised_at(outs[raiser])
    print(f"two nodes: both agents ended {took:.2f} s after rank 1 raised")
    assert took < NAMED_WITHIN, both


def test_a_missing_node_ends_with_a_sentence(tmp_path):
    """Two nodes asked for, one comes: python -m helpers.launch ends after join_timeout
    (2 s here, 120 s by default, torchrun's own 600 s) with a sentence, no traceback."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = _free_port()
    cmd = [sys.executable, "-m", "helpers.launch", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=alone",
           "--rdzv-conf=join_timeout=2", str(script), "look", "1"]
    start = time.time()
    codes, ended, outs = _run_together([cmd], [tmp_path / "log"], _env())
    out = outs[0]
    assert codes[0] == 1, out
    assert f"waiting up to 2 s for 2 node(s) to join rendezvous 'alone' at 127.0.0.1:{port}" \
        in out
    assert (f"rendezvous 'alone' at 127.0.0.1:{port} did not gather --nnodes=2 nodes within "
            f"join_timeout=2 s") in out, out
    assert "Traceback" not in out, out
    print(f"missing node: ended {ended[0] - start:.2f} s after the agent started")
    # the timeout plus starting Python and torch: 4 s quiet, 9.8 s at load average 10
    assert ended[0] - start < 2 + 30, out


def test_the_course_default_join_timeout():
    from torch.distributed.run import parse_args

    args = with_course_defaults(parse_args(["--nnodes=2", "job.py"]))
    assert args.rdzv_conf == f"join_timeout={JOIN_TIMEOUT}" and JOIN_TIMEOUT < 600
    args = with_course_defaults(parse_args(["--rdzv-conf=is_host=1", "job.py"]))
    assert args.rdzv_conf == f"is_host=1,join_timeout={JOIN_TIMEOUT}"
    args = with_course_defaults(parse_args(["--rdzv_conf=join_timeout=30", "job.py"]))
    assert args.rdzv_conf == "join_timeout=30"  # given: kept


def test_the_per_machine_limit_counts_the_ranks_on_this_machine(monkeypatch):
    """Under torchrun the world spans machines: 128 ranks on 16 nodes of 8 are fine; 8
    times the cores on one machine is refused, as a local launch refuses it."""
    limit = arguments.local_rank_limit()
    arguments.check_args(print, 2 * limit, 60, local=False)
    with pytest.raises(ValueError, match="local ranks"):
        arguments.check_args(print, limit + 1, 60)
    monkeypatch.setenv("WORLD_SIZE", str(2 * limit))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    course_torchrun._check_local_ranks()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(limit + 1))
    with pytest.raises(ValueError, match=r"--nproc_per_node"):
        course_torchrun._check_local_ranks()


def test_an_agent_that_loses_the_rendezvous_goes_on_watching_its_ranks(monkeypatch, capsys):
    """torch 2.13's agent asks the rendezvous, while its ranks run, whether nodes wait to
    join; when the host's agent has ended (its ranks failed) the question raised and
    ended this agent before it reported its own failing ranks (two nodes of two ranks
    on one machine, a rank of the host's node raising: 2 runs of 3 when the other
    node's ranks waited in the same all-reduce, 2 of 2 when they were still computing).
    Under python -m helpers.launch the lost rendezvous means no node waits, said once."""
    import threading

    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import \
        DynamicRendezvousHandler as Handler

    from helpers.launch.__main__ import tolerate_a_lost_rendezvous

    for name in ("num_nodes_waiting", "next_rendezvous"):  # restored after the test
        monkeypatch.setattr(Handler, name, getattr(Handler, name))
    asked = []

    class Gone:
        def sync(self):
            asked.append(1)
            raise RendezvousConnectionError("The connection to the C10d store has failed.")

    agent = type("Agent", (), {"_heartbeat_lock": threading.Lock(), "_state_holder": Gone(),
                               "_record": lambda self, **kw: None})()
    with pytest.raises(RendezvousConnectionError):
        Handler.num_nodes_waiting(agent)  # torch's own
    tolerate_a_lost_rendezvous()
    tolerate_a_lost_rendezvous()  # (twice: wrapped once)
    assert [Handler.num_nodes_waiting(agent) for _ in range(3)] == [0, 0, 0]
    assert len(asked) == 2  # torch's, then the first under the course's; not again
    assert capsys.readouterr().err.count("the rendezvous is gone") == 1
