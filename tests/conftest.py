"""Shared fixtures."""

import importlib.util
import os
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


TESTS = pathlib.Path(__file__).resolve().parent


def _ship_test_modules_by_value() -> None:
    """A function of a test module that a test launches on ranks travels by value.

    By reference (cloudpickle's default for an importable module), every rank would
    import the test module, and with it pytest, nbformat and the harness: about a
    second of CPU per rank, four ranks on two cores, for each of several hundred
    launches (it was most of the lab checks' test time). By value, a rank imports only
    what the function itself uses (torch, helpers)."""
    import cloudpickle

    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and pathlib.Path(path).resolve().parent == TESTS and name != "conftest":
            cloudpickle.register_pickle_by_value(module)


def pytest_configure(config):
    """Under pytest-xdist (``make test``: three workers on two cores) a worker's own torch
    work gets its share of the cores. torch's default, one intra-op thread per core in
    every worker, oversubscribes them: OpenMP threads that wait for each other then take
    turns with the other worker's, and a single-process training test that takes 1 s
    alone took 28 s. Ranks that a test launches choose their own count
    (``helpers/launch/rank.py``); tests that need a count set it themselves."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The longest test files (about 30-60 s each on two cores), started first: pytest-xdist
# hands out whole files in collection order, and one of these started last would leave
# the other worker idle until it ends. Alphabetical, the site's came near the end.
LONGEST_FIRST = ("test_site.py", "test_launch.py", "test_checks_ch17.py", "test_check_labs.py",
                 "test_checkpoint.py", "test_zero.py", "test_precision.py")


def _longest_files_first(items) -> None:
    """Reorder in place: the files of LONGEST_FIRST first, in that order; the rest as
    collected (a stable sort, so a file's tests keep their order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped without it (CI, a laptop), and
    what ``make test-gpu`` runs first on a GPU node (``pytest -m gpu``)."""
    import torch

    _ship_test_modules_by_value()
    _longest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu runs these on a GPU node)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture
def load_bench(monkeypatch):
    """``load_bench("bench_ddp")``: benchmarks/bench_ddp.py as a module whose
    ``launch`` (if it has one) fails the test, so argument checks are seen to
    come before any rank starts."""
    def load(name):
        monkeypatch.syspath_prepend(str(BENCHMARKS))  # for its `from _args import ...`
        monkeypatch.delitem(sys.modules, "_args", raising=False)
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)

        def no_launch(*a, **kw):
            raise AssertionError("a rank was started before the arguments were checked")

        monkeypatch.setattr(mod, "launch", no_launch, raising=False)
        return mod
    return load
