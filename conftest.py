"""Makes `tools` importable from tests (the notebook pipeline lives there), and gives a
run of notebooks one zygote of rank servers (``helpers/launch/zygote.py``)."""
import contextlib
import os
import pathlib
import shutil
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

# helpers.launch.zygote.ENV. Not imported: importing helpers in this process (nbval has
# ipykernel loaded, so helpers would take it for a kernel) would start a rank server here.
ZYGOTE_ENV = "_COURSE_ZYGOTE"


def _runs_notebooks(config) -> bool:
    return any(config.getoption(name, default=False) for name in ("nbval", "nbval_lax"))


def pytest_configure(config):
    """Before nbval's first kernel: a zygote that imported torch once forks each kernel's
    rank server (about 2 s of imports saved per notebook). It is started from the
    repository root with this process's environment, the one the kernels inherit."""
    if not _runs_notebooks(config) or ZYGOTE_ENV in os.environ:
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", "from helpers.launch.zygote import zygote_entry; zygote_entry()"],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    path = proc.stdout.readline().strip()            # once it listens; "" if it failed
    if path:
        os.environ[ZYGOTE_ENV] = path
        config._course_zygote = (proc, path)


def pytest_unconfigure(config):
    proc, path = getattr(config, "_course_zygote", (None, None))
    if proc is None:
        return
    os.environ.pop(ZYGOTE_ENV, None)
    with contextlib.suppress(Exception):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
