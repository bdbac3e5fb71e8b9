"""Notebook code cells as Python syntax trees, for the tests that scan the notebooks'
rank functions (test_rank_device.py, test_notebook_clock.py)."""

from __future__ import annotations

import ast
import pathlib

import nbformat


def _code(source: str) -> str:
    """A cell's source with IPython magics and shell escapes blanked (line numbers kept)."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def code_cells(path: pathlib.Path) -> list[tuple[int, ast.Module]]:
    """(cell index, parsed source) of every code cell of the notebook at ``path``."""
    nb = nbformat.read(path, 4)
    return [(i, ast.parse(_code(c.source), filename=f"{path.name}[cell {i}]"))
            for i, c in enumerate(nb.cells) if c.cell_type == "code"]


def called_name(call: ast.Call) -> str | None:
    """``f`` for ``f(...)`` and ``m.f(...)``; None for anything else."""
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
