"""Makes `tools` importable from tests (the notebook pipeline lives there), and gives a
run of notebooks one zygote of rank servers (``helpers/launch/zygote.py``)."""
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from tools import zygote  # noqa: E402  (standard library only: imports no helpers)


def _runs_notebooks(config) -> bool:
    return any(config.getoption(name, default=False) for name in ("nbval", "nbval_lax"))


def pytest_configure(config):
    """Before nbval's first kernel: a zygote that imported torch once forks each kernel's
    rank server (about 2 s of imports saved per notebook), started with this process's
    environment, the one the kernels inherit."""
    if not _runs_notebooks(config) or zygote.ENV in os.environ:
        return
    started = zygote.start()
    if started:
        os.environ[zygote.ENV] = started[1]
        config._course_zygote = started


def pytest_unconfigure(config):
    started = getattr(config, "_course_zygote", None)
    if started:
        os.environ.pop(zygote.ENV, None)
        zygote.stop(*started)
