"""The notebook pipeline: labs generated from solutions, every chapter complete,
file names and metadata that JupyterLab leaves alone, a landing page listing it all."""

import pathlib
import re

import nbformat
import pytest

from tools import nbtool

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
ALL_NOTEBOOKS = nbtool.all_notebooks()


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
        chapter = nbtool.chapter_of(sol)
        for folder in ("course", "labs", "solutions"):
            assert nbtool.path_of(folder, chapter).exists(), \
                f"{nbtool.path_of(folder, chapter).relative_to(ROOT)} missing (`make normalize`?)"


def test_lab_and_solution_file_names_differ():
    """Two JupyterLab tabs show only file names: a lab must not read like its solution."""
    for folder, suffix in (("labs", "_lab.ipynb"), ("solutions", "_solution.ipynb")):
        for path in (ROOT / folder).glob("*.ipynb"):
            assert path.name.endswith(suffix), f"{folder}/{path.name}: run `make normalize`"
    for path in (ROOT / "course").glob("*.ipynb"):
        assert not path.stem.endswith(("_lab", "_solution")), path.name


def test_old_lab_names_still_resolve():
    """Tests written before the rename load `labs/NN_slug.ipynb`; both names work."""
    old = nbtool.exercise("labs/01_why_distributed.ipynb", "bytes_per_param")
    new = nbtool.exercise("labs/01_why_distributed_lab.ipynb", "bytes_per_param")
    assert old.__code__.co_code == new.__code__.co_code
    assert nbtool.resolve("solutions/04_ddp_buckets.ipynb") == \
        ROOT / "solutions" / "04_ddp_buckets_solution.ipynb"
    assert nbtool.chapter_of("labs/04_ddp_buckets_lab.ipynb") == "04_ddp_buckets"


def test_normalize_renames_a_chapter_added_under_the_old_names(tmp_path, monkeypatch):
    """A chapter written on another branch arrives as labs/NN_slug.ipynb: `make normalize`
    renames it and lists it on the landing page."""
    monkeypatch.setattr(nbtool, "ROOT", tmp_path)
    src = nbtool.from_percent("# %% [markdown]\n# # 07 · A new chapter (solutions)\n# %%\nx = 1\n")
    for folder in ("course", "labs", "solutions"):
        (tmp_path / folder).mkdir()
        nbformat.write(src, tmp_path / folder / "07_new.ipynb")
    moved = nbtool.rename_legacy()
    assert moved == ["labs/07_new.ipynb -> labs/07_new_lab.ipynb",
                     "solutions/07_new.ipynb -> solutions/07_new_solution.ipynb"]
    nbtool.write_index()
    index = nbformat.read(tmp_path / nbtool.INDEX, as_version=4).cells[0].source
    assert ("| 07 | A new chapter | [course](course/07_new.ipynb) | [lab](labs/07_new_lab.ipynb) "
            "| [solution](solutions/07_new_solution.ipynb) |") in index


def _installed_python3_display_name() -> str:
    from jupyter_client.kernelspec import KernelSpecManager
    return KernelSpecManager().get_kernel_spec("python3").display_name


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebook_is_committed_as_jupyterlab_would_save_it(path):
    """Opening a notebook in JupyterLab must not mark it modified: the kernelspec is the
    installed kernel's, no cell carries execution timestamps, every cell has a unique id,
    and the file is byte-for-byte what nbformat (Jupyter's server) writes on save."""
    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    assert nb.metadata.kernelspec.display_name == _installed_python3_display_name()
    assert nb.metadata.kernelspec.name == "python3"
    assert nb.metadata.language_info.get("pygments_lexer") == "ipython3"
    for cell in nb.cells:
        assert "execution" not in cell.metadata, f"cell {cell.get('id')}: execution timestamps"
    ids = [c.get("id") for c in nb.cells]
    assert all(ids) and len(set(ids)) == len(ids)
    assert nbtool._text(nbformat.reads(text, as_version=4)) == text, "not nbformat's own layout"
    assert nbtool._text(nbtool.normalize(nb)) == text, "run `make normalize`"


def test_normalize_fixes_what_jupyterlab_rewrites():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.cells[0].metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    nb.cells[0].metadata["tags"] = ["keep-me"]
    del nb.cells[0]["id"]
    nb.metadata["widgets"] = {"state": {"slider": {"value": 70.0, "step": 0.5}}}
    nbtool.normalize(nb)
    assert nb.metadata.kernelspec.display_name == "Python 3 (ipykernel)"
    # JupyterLab's save (JavaScript's JSON) writes 70.0 as 70
    assert '"value": 70\n' in nbformat.writes(nb) and '"step": 0.5' in nbformat.writes(nb)
    assert nb.cells[0].metadata == {"tags": ["keep-me"]} and nb.cells[0].id == "cell-0"


def test_start_here_lists_every_chapter_with_working_links():
    text = nbformat.read(ROOT / nbtool.INDEX, as_version=4).cells[0].source
    assert nbtool._text(nbtool.make_index()) == (ROOT / nbtool.INDEX).read_text(encoding="utf-8"), \
        "START_HERE.ipynb is out of date: run `make normalize`"
    links = re.findall(r"\]\(([^)]+\.ipynb)\)", text)
    for link in links:
        assert (ROOT / link).exists(), f"START_HERE.ipynb links to a missing {link}"
    every = {str(p.relative_to(ROOT)) for folder in ("course", "labs", "solutions")
             for p in (ROOT / folder).glob("*.ipynb")}
    assert every <= set(links), f"not on the landing page: {sorted(every - set(links))}"


def test_make_lab_roots_the_server_at_the_repository_and_opens_start_here():
    """The repository's landing page, or the learner's (work/START_HERE.ipynb) once
    make my-copy made it."""
    makefile = (ROOT / "Makefile").read_text()
    lab_args = re.search(r"^LAB_ARGS\s*:=\s*((?:.*\\\n)*.*)$", makefile, re.M).group(1)
    assert "--ServerApp.root_dir=$(CURDIR)" in lab_args
    assert f"$(if $(wildcard work/{nbtool.INDEX}),work/{nbtool.INDEX},{nbtool.INDEX})" in lab_args
    assert re.search(r"^lab:.*\n\t\$\(BIN\)/jupyter lab \$\(LAB_ARGS\)$", makefile, re.M)
    assert "/work/" in (ROOT / ".gitignore").read_text().split(), "make my-copy's folder not ignored"


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


def _relative_links(path: pathlib.Path) -> list[str]:
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells
                     if c.cell_type == "markdown")
    return [m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"[a-z]+:", m) and not m.startswith("#")]


def test_make_my_copy_makes_findable_copies_and_keeps_the_learners(tmp_path):
    """`make my-copy`: course and lab copies in two folders (names that JupyterLab's file
    browser shortens alike never sit side by side), the course's notes with them so
    every link inside a copy works, a landing page linking the copies; after a
    `git pull` it adds new chapters, never overwrites an edited copy, and moves a copy
    an older version left in work/ into its folder."""
    assert re.search(r"^my-copy: setup\n\t\$\(BIN\)/python tools/nbtool.py my-copy work$",
                     (ROOT / "Makefile").read_text(), re.M)
    work = tmp_path / "work"
    nbtool.my_copy(work)
    for folder in ("course", "labs"):
        assert sorted(p.name for p in (work / folder).glob("*.ipynb")) == \
            sorted(p.name for p in (ROOT / folder).glob("*.ipynb"))
    assert (work / "course" / "timing_noise.md").exists()
    dead = [f"{p.relative_to(work)}: {link}" for p in work.glob("*/*.ipynb")
            for link in _relative_links(p) if not (p.parent / link).resolve().exists()]
    assert dead == []
    index_links = _relative_links(work / nbtool.INDEX)
    # the landing page's links, from where make my-copy puts it (work/ in the repository)
    assert [link for link in index_links if not (work / link).exists()
            and not (ROOT / "work" / link).resolve().exists()] == []
    assert "course/03_all_reduce_ring.ipynb" in index_links
    assert "labs/03_all_reduce_ring_lab.ipynb" in index_links
    assert "../solutions/03_all_reduce_ring_solution.ipynb" in index_links

    lab = work / "labs" / "01_why_distributed_lab.ipynb"
    lab.write_text("my answers")
    (work / "labs" / "02_sync_sgd_data_parallel_lab.ipynb").unlink()   # a "new chapter"
    old = work / "03_all_reduce_ring_lab.ipynb"                         # an older layout's copy
    (work / "labs" / old.name).rename(old)
    old.write_text("answers in the old place")
    lines = nbtool.my_copy(work)
    assert lab.read_text() == "my answers"
    assert (work / "labs" / "02_sync_sgd_data_parallel_lab.ipynb").exists()
    assert (work / "labs" / old.name).read_text() == "answers in the old place"
    assert not old.exists()
    assert any(ln.startswith("moved  work/labs/03_all_reduce_ring_lab.ipynb") for ln in lines)
    assert any(ln.startswith("kept   work/labs/01_why_distributed_lab.ipynb") for ln in lines)


def test_check_labs_finds_a_learners_copies_in_work_labs(tmp_path):
    from tools import check_labs

    nbtool.my_copy(tmp_path / "work")
    found = check_labs.learners(tmp_path / "work")
    assert list(found) == ["work"] and len(found["work"]) == len(list((ROOT / "labs").glob("*.ipynb")))


CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def test_no_notebook_source_has_control_characters():
    """A formula typed into a non-raw Python string loses its backslashes: ``\\frac``
    becomes a form feed plus "rac", ``\\alpha`` a bell plus "lpha", and the page
    shows garbage. Tabs and newlines are the only control characters a cell needs."""
    bad = [f"{p.relative_to(ROOT)} cell {i}" for p in ALL_NOTEBOOKS
           for i, c in enumerate(nbformat.read(p, as_version=4).cells) if CONTROL.search(c.source)]
    assert bad == []


def test_no_notebook_repeats_a_cell():
    """A script that inserts cells and then runs a second time leaves the same
    explanation and code twice in a row, and the page reads it twice. Short cells
    (a plt.show(), a one-line print) may repeat; a paragraph or a block of code may not."""
    repeats = []
    for p in ALL_NOTEBOOKS:
        seen = {}
        for i, c in enumerate(nbformat.read(p, as_version=4).cells):
            if len(c.source) > 80 and c.source in seen:
                repeats.append(f"{p.relative_to(ROOT)}: cell {i} repeats cell {seen[c.source]}")
            seen.setdefault(c.source, i)
    assert repeats == []


def test_recording_waits_for_a_quiet_machine_and_refuses_a_busy_one():
    from tools.nbtool import wait_for_quiet

    loads = iter([5.0, 3.0, 1.5])           # busy, busy, quiet on 2 cores
    slept = []
    assert wait_for_quiet(cores=2, load=lambda: (next(loads),), sleep=slept.append, poll=10) == 1.5
    assert slept == [10, 10]
    with pytest.raises(RuntimeError, match="load average 4.0 on 2 cores after waiting 30 s"):
        wait_for_quiet(max_wait=30, cores=2, load=lambda: (4.0,), sleep=lambda s: None, poll=10)
