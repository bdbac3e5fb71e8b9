"""make site installs the site group once: on an installed checkout it only builds.

Each case runs ``make -n site`` (print the recipe, run nothing) on a copy of the
Makefile in a scratch folder whose .venv is faked by its stamp files, with their
modification times set as the case needs."""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(tmp_path: pathlib.Path, stamps: dict[str, int]) -> str:
    """The commands make site would run; ``stamps``: path -> mtime (seconds) of
    the files that decide it (pyproject.toml, constraints.txt, the stamps)."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    for name, mtime in stamps.items():
        path = tmp_path / name
        path.touch()
        os.utime(path, (mtime, mtime))
    done = subprocess.run(["make", "-n", "site"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


INPUTS = {"pyproject.toml": 1000, "constraints.txt": 1000, ".venv/.installed": 2000}


def test_installed_checkout_only_builds(tmp_path):
    out = dry_run(tmp_path, {**INPUTS, ".venv/.installed-site": 3000})
    assert "pip" not in out, out
    assert "tools/site/build.py" in out


def test_first_site_installs_the_site_group(tmp_path):
    out = dry_run(tmp_path, INPUTS)
    assert 'pip install -q -e ".[site]"' in out, out
    assert "tools/site/build.py" in out


def test_changed_constraints_reinstall(tmp_path):
    # the tested set moved on: the site group is installed again at the new pins
    out = dry_run(tmp_path, {**INPUTS, ".venv/.installed-site": 3000,
                             "constraints.txt": 4000, ".venv/.installed": 5000})
    assert 'pip install -q -e ".[site]"' in out, out
