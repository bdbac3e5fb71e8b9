"""The notebook pipeline: labs generated from solutions, every chapter complete."""

import pathlib

import nbformat
import pytest

from tools import nbtool

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_strip_solutions_keeps_indent_and_hint():
    src = ("def f(x):\n    # BEGIN SOLUTION: double it\n    y = 2 * x\n    return y\n"
           "    # END SOLUTION\n\nprint(f)")
    assert nbtool.strip_solutions(src) == (
        'def f(x):\n    raise NotImplementedError("Exercise: double it")\n\nprint(f)')
    with pytest.raises(ValueError, match="END SOLUTION"):
        nbtool.strip_solutions("# BEGIN SOLUTION\nx = 1")


def test_labs_are_in_sync_with_solutions():
    assert nbtool.labs(check=True) == 0, "run `make labs`"


def test_every_chapter_has_course_lab_and_solution():
    for sol in SOLUTIONS:
        assert (ROOT / "labs" / sol.name).exists()
        assert (ROOT / "course" / sol.name).exists(), f"course/{sol.name} missing"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_notebooks_have_exercises_and_checks(path):
    nb = nbformat.read(path, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "# BEGIN SOLUTION" in code and "checks.check_" in code


@pytest.mark.parametrize("path", sorted((ROOT / "labs").glob("*.ipynb")), ids=lambda p: p.name)
def test_labs_are_committed_without_outputs_and_without_answers(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and "BEGIN SOLUTION" not in cell.source


@pytest.mark.parametrize("path", sorted((ROOT / "course").glob("*.ipynb")), ids=lambda p: p.name)
def test_course_notebooks_have_four_questions_and_quiz(path):
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells
                     if c.cell_type == "markdown")
    assert "four questions" in text.lower() and "<details>" in text
