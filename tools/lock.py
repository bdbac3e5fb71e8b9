"""The tested set of packages: write it, install from it, say what is installed.

``constraints.txt`` pins every package the course installs except torch, at
the versions the whole suite last passed with. ``pyproject.toml`` keeps honest
ranges (what the course needs); this file is what was tested. torch is left
out on purpose: the Makefile pins the tested CPU build (``TORCH``), and an
instructor's GPU node brings its own CUDA build, which a pin here would fight.

    python tools/lock.py write constraints.txt   # make lock: freeze this Python's packages
    python tools/lock.py pip-args constraints.txt  # "-c constraints.txt", or nothing
    python tools/lock.py versions                # one line for the test log

A lock resolved on one Python version may not install on another (numpy
2.4 needs Python 3.11, say), so the file's first line names the version it
was made on, and ``pip-args`` uses it only there.
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import pathlib
import platform
import re
import subprocess
import sys

# Not pinned: torch and what comes with a CUDA build of it (see above), the
# course itself, and the installer's own tools.
UNPINNED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|distributed-llm-training-course|pip|"
                      r"setuptools|wheel)$", re.I)
HEADER = re.compile(r"^# python (\d+\.\d+)")


def python_version() -> str:
    return "%d.%d" % sys.version_info[:2]


def write(path: str) -> None:
    frozen = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                            check=True, capture_output=True, text=True).stdout
    pins = sorted((line for line in frozen.splitlines()
                   if "==" in line and not UNPINNED.match(line.split("==")[0])),
                  key=str.lower)
    torch = md.version("torch")
    pathlib.Path(path).write_text(
        f"# python {python_version()}\n"
        f"# The set of packages the whole suite passed with (make test), written by\n"
        f"# `make lock` on {datetime.date.today()} ({platform.system()}, torch {torch}).\n"
        f"# torch is pinned by the Makefile's TORCH instead (see tools/lock.py).\n"
        + "".join(p + "\n" for p in pins))
    print(f"wrote {path}: {len(pins)} packages, made on Python {python_version()}")


def pip_args(path: str) -> str:
    file = pathlib.Path(path)
    if not path or not file.is_file():
        return ""
    made_on = HEADER.match(file.read_text().splitlines()[0] if file.stat().st_size else "")
    if made_on is None or made_on.group(1) != python_version():
        where = made_on.group(1) if made_on else "an unknown Python"
        print(f"[setup] {path} was resolved on Python {where}, this is {python_version()}: "
              f"installing the newest versions pyproject.toml allows instead", file=sys.stderr)
        return ""
    return f"-c {path}"


def versions() -> str:
    import torch

    cuda = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" \
        if torch.cuda.is_available() else "no GPU"
    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__} ({cuda})"]
    for name in ("numpy", "cloudpickle", "matplotlib", "ipykernel", "nbval", "pytest"):
        try:
            parts.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            parts.append(f"{name} missing")
    return "versions: " + ", ".join(parts)


def main(argv: list[str]) -> None:
    if argv[:1] == ["write"] and len(argv) == 2:
        write(argv[1])
    elif argv[:1] == ["pip-args"] and len(argv) <= 2:
        print(pip_args(argv[1] if len(argv) == 2 else ""))
    elif argv == ["versions"]:
        print(versions())
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
