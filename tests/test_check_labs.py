"""make check-labs (tools/check_labs.py): an instructor's table of a room's labs.

In one room: the solutions pass every check, one plausible wrong answer fails exactly
its exercise, the untouched labs read "not attempted". A hanging exercise times out
without stopping the next one, and no process the run started outlives it.

Chapters 01 and 03 by default (01 has no ranks, 03 runs its checks on ranks);
COURSE_CHECK_LABS_ALL=1 runs every chapter (several minutes).
"""

from __future__ import annotations

import csv
import os
import pathlib
import shutil
import time

import nbformat
import pytest

from tools import check_labs
from tools.nbtool import write

ROOT = pathlib.Path(__file__).resolve().parent.parent
ONLY = None if os.environ.get("COURSE_CHECK_LABS_ALL") else r"^0[13]_"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _copy(src: str, dest: pathlib.Path) -> pathlib.Path:
    dest.mkdir(parents=True, exist_ok=True)
    return pathlib.Path(shutil.copy(ROOT / src, dest))


def _replace(path: pathlib.Path, old: str, new: str) -> None:
    """A learner's edit: one cell's source changed (the test fails if old is absent)."""
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code" and old in c.source]
    assert len(cells) == 1, f"{path.name}: {old!r} is in {len(cells)} cells"
    cells[0].source = cells[0].source.replace(old, new)
    write(nb, path)


def _chapters(folder: str) -> list[pathlib.Path]:
    """Chapters 01 and 03 of ``folder`` (every chapter with COURSE_CHECK_LABS_ALL=1)."""
    found = sorted((ROOT / folder).glob("*.ipynb"))
    return found if ONLY is None else [p for p in found if p.name[:2] in ("01", "03")]


# Over 15 s by design: make check-labs runs each notebook in a fresh Python process (it
# imports torch and starts a rank server, as the learner's kernel would), and this room
# holds four notebooks, two of them checking on 3 and 4 ranks.
def test_a_room_solutions_pass_a_slip_fails_exactly_its_exercise_stubs_are_not_attempted(tmp_path):
    """alice: the solutions, with one slip in chapter 01 (every other exercise passes,
    those that run on ranks too); bob: the untouched labs (every exercise "not
    attempted"), and a course notebook (make my-copy copies those too), which has no
    check cell: not a lab."""
    for sol in _chapters("solutions"):
        _copy(str(sol.relative_to(ROOT)), tmp_path / "room" / "alice")
    # alice's slip: mixed precision without Adam's fp32 master copy (2 + 2 + 8, not 16 bytes)
    _replace(tmp_path / "room" / "alice" / "01_why_distributed_solution.ipynb",
             "return 2 + 2 + 4 + state", "return 2 + 2 + state")
    labs = _chapters("labs")
    for lab in labs:
        _copy(str(lab.relative_to(ROOT)), tmp_path / "room" / "bob")
    _copy("course/01_why_distributed.ipynb", tmp_path / "room" / "bob")
    # a scratch cell between alice's exercise and its check: still the same exercise
    nb = tmp_path / "room" / "alice" / "03_all_reduce_ring_solution.ipynb"
    book = nbformat.read(nb, as_version=4)
    at = next(i for i, c in enumerate(book.cells) if "checks.check_reduce_scatter(" in c.source)
    book.cells.insert(at, nbformat.v4.new_code_cell("n = 5  # trying something"))
    nbformat.write(book, nb)
    out = tmp_path / "room.csv"
    # two notebooks at a time (make check-labs JOBS=2): the same verdicts as one by one
    assert check_labs.main([str(tmp_path / "room"), "--csv", str(out), "--jobs", "2"]) == 0
    rows = list(csv.DictReader(out.open()))
    alice = {r["exercise"]: r for r in rows if r["learner"] == "alice"}
    assert {r["chapter"] for r in rows if r["learner"] == "alice"} >= {"01", "03"}
    assert alice["bytes_per_param"]["status"] == "fail"
    assert "bytes_per_param" in alice["bytes_per_param"]["reason"]
    assert "\n" not in alice["bytes_per_param"]["reason"]
    passed = [e for e, r in alice.items() if r["status"] == "pass"]
    assert sorted(passed) == sorted(set(alice) - {"bytes_per_param"}), alice
    assert "n" not in alice and "reduce_scatter" in alice
    bob = [r for r in rows if r["learner"] == "bob"]  # the course notebook is not among them
    assert {r["chapter"] for r in bob} == {lab.name[:2] for lab in labs}
    assert {r["status"] for r in bob} == {"not attempted"}, bob


# Over 15 s by design: the hanging cell must reach check-labs' cell timeout (10 s here),
# then the run goes on in a fresh process that imports torch again.
def test_a_hanging_exercise_with_live_ranks_times_out_and_the_next_one_still_runs(tmp_path):
    """Exercise 1 of chapter 03 hangs while two ranks are alive (its cell launches
    ranks that sleep for an hour). The run kills it after the cell timeout, goes on
    in a fresh process from exercise 2, and leaves no process behind: not the
    notebook's, not the rank server, not a rank."""
    nb = _copy("solutions/03_all_reduce_ring_solution.ipynb", tmp_path / "carol")
    _replace(nb, "        x[c:d] += buf\n    # END SOLUTION",
             "        x[c:d] += buf\n    # END SOLUTION\n\n\ndef _stuck():\n    import time\n"
             "    time.sleep(3600)\n\n\nlaunch(_stuck, 2, timeout=3600)")
    groups = check_labs.Groups()
    start = time.monotonic()
    # 10 s per cell: the hung cell is cut after 10 s; the others (a rank server's start
    # and two checks) take 2-4 s on a quiet 2-core machine
    results = check_labs.check_folder(tmp_path / "carol", exercise_timeout=10, groups=groups)
    took = time.monotonic() - start
    by = {r.exercise: r for r in results}
    assert by["reduce_scatter"].status == "timeout", vars(by["reduce_scatter"])
    assert by["all_gather"].status == "pass", vars(by["all_gather"])
    # ring_average uses the learner's reduce_scatter, which the hung cell never defined
    assert by["ring_average"].status == "fail" and "reduce_scatter" in by["ring_average"].reason
    assert took < 240, f"the run took {took:.0f} s"
    for _ in range(50):  # SIGKILL is asynchronous: give the kernel a moment to reap
        if not groups.marked():
            break
        time.sleep(0.1)
    assert groups.marked() == [], "processes of the run outlived it"


def test_the_table_says_what_each_mark_means():
    results = [check_labs.Result("ana", "01_x_lab.ipynb", "01", "f", "pass"),
               check_labs.Result("ana", "01_x_lab.ipynb", "01", "g", "fail", "g returned 3, expected 4"),
               check_labs.Result("ben", "01_x_lab.ipynb", "01", "f", "not attempted")]
    text = check_labs.table(results).splitlines()
    assert text[0].split() == ["learner", "01:f", "01:g"]
    assert text[1].split() == ["ana", "pass", "FAIL"]
    assert text[2].split() == ["ben", "-"]  # ben has no row for g at all
    assert "  ana 01:g: fail: g returned 3, expected 4" in text
    two = check_labs.table(results + [check_labs.Result("ben", "02_y_lab.ipynb", "02", "h", "pass")])
    blocks = two.split("\n\n")  # a block per chapter: ana has nothing in chapter 02
    assert blocks[1].splitlines() == ["learner 02:h", "ben     pass"]


def test_a_folder_that_is_not_there_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        check_labs.main([str(tmp_path / "nope")])
    assert "is not a folder" in capsys.readouterr().err


def test_a_learners_error_quotes_their_line_without_a_dangling_colon():
    """check-labs runs a lab's cells outside IPython: it registers each cell's source as
    IPython would, so a check's "(at <cell>, line N: `code`)" quotes the learner's line;
    where no line can be found, the location ends without a colon."""
    from helpers.checks import learner_line

    exc = check_labs._exec("state = {}\nstate['adam']\n", "lab.ipynb[cell 2]", {})
    assert isinstance(exc, KeyError)
    assert learner_line(exc) == " (at lab.ipynb[cell 2], line 2: `state['adam']`)"
    try:
        exec(compile("x = 1\n{}['adam']\n", "<nowhere>", "exec"), {})
    except KeyError as err:
        assert learner_line(err) == " (at <nowhere>, line 2)"
