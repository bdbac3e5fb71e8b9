"""The tested set (constraints.txt) and the tool that writes and reads it."""

import pathlib
import sys

from tools import lock

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_lock_names_its_python_and_leaves_torch_to_the_makefile():
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    assert lock.HEADER.match(lines[0]), "the first line must name the Python it was made on"
    pins = [line.split("==")[0].lower() for line in lines if line and not line.startswith("#")]
    assert pins and all("==" in line for line in lines if line and not line.startswith("#"))
    # torch is the Makefile's (TORCH): a pin here would fight an instructor's CUDA build
    assert not [p for p in pins if lock.UNPINNED.match(p)]
    # what the course imports at run time is pinned
    assert {"numpy", "cloudpickle", "matplotlib", "ipywidgets", "nbval", "pytest"} <= set(pins)


def test_the_lock_is_used_only_on_the_python_it_was_made_on(tmp_path, capsys):
    here = lock.python_version()
    made_here = tmp_path / "here.txt"
    made_here.write_text(f"# python {here}\nnumpy==1.0\n")
    assert lock.pip_args(str(made_here)) == f"-c {made_here}"
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("# python 2.7\nnumpy==1.0\n")
    assert lock.pip_args(str(elsewhere)) == ""
    assert "resolved on Python 2.7" in capsys.readouterr().err
    assert lock.pip_args("") == "" and lock.pip_args(str(tmp_path / "none.txt")) == ""


def test_the_versions_line_names_python_and_torch():
    line = lock.versions()
    assert line.startswith(f"versions: Python {sys.version.split()[0]}, torch ")
    assert "cloudpickle" in line
