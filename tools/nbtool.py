"""Notebook pipeline: solutions are the source, labs are generated from them.

    python tools/nbtool.py labs [NAME ...] # regenerate labs/ from solutions/ (all, or these)
    python tools/nbtool.py labs --check    # exit 1 if labs/ is out of date
    python tools/nbtool.py run [NB ...]    # execute notebooks in place (default: course/ + solutions/),
                                           # one at a time, each waiting for a quiet machine
    python tools/nbtool.py new SRC.py OUT.ipynb   # build a notebook from a "# %%" percent script
    python tools/nbtool.py normalize       # file names, metadata and START_HERE.ipynb (see below)

File names: ``course/NN_slug.ipynb``, ``labs/NN_slug_lab.ipynb``,
``solutions/NN_slug_solution.ipynb``, so that a lab and its solution open in
JupyterLab tabs with different names. The older ``labs/NN_slug.ipynb`` and
``solutions/NN_slug.ipynb`` still work as arguments everywhere (``exercise``,
``labs NAME``); ``normalize`` renames such files to the new names.

Metadata: every notebook is written with the kernelspec and language_info that
ipykernel reports, cell ids, and no execution timestamps, so JupyterLab finds
nothing to rewrite when it opens a notebook and the file does not turn
"modified" (which would make the learner's next ``git pull`` conflict).
``run``, ``new``, ``labs`` and ``normalize`` all write it that way.

Marking a solution inside a code cell of ``solutions/NN_slug.ipynb``::

    def bytes_per_param(...):
        # BEGIN SOLUTION: add the bytes of weights, gradients and optimizer state
        return ...
        # END SOLUTION

In the lab, everything from BEGIN to END (inclusive) becomes one line at the
same indentation: ``raise NotImplementedError("Exercise: <hint>")``.
Labs are written without outputs; course and solution notebooks are committed
executed so they read well on the web.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import re
import shutil
import sys
import time

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<hint>.*))?$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
SUFFIX = {"labs": "_lab", "solutions": "_solution", "course": ""}
INDEX = "START_HERE.ipynb"
# What ipykernel reports for the "python3" kernel (its kernel.json and its
# kernel_info_reply); JupyterLab writes exactly these on open.
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py",
                 "mimetype": "text/x-python", "name": "python", "nbconvert_exporter": "python",
                 "pygments_lexer": "ipython3", "version": platform.python_version()}
# Per-cell metadata that records one execution, not the notebook.
TRANSIENT_CELL_KEYS = ("execution", "ExecuteTime", "collapsed", "scrolled")


# ---------------------------------------------------------------- file names

def chapter_of(path: str | pathlib.Path) -> str:
    """'labs/04_ddp_buckets_lab.ipynb', 'solutions/04_ddp_buckets.ipynb', '04_ddp_buckets' -> '04_ddp_buckets'."""
    stem = pathlib.Path(path).name.removesuffix(".ipynb")
    for suffix in ("_lab", "_solution"):
        stem = stem.removesuffix(suffix)
    return stem


def path_of(folder: str, chapter: str) -> pathlib.Path:
    """The notebook of ``chapter`` in ``folder`` ("course", "labs", "solutions"), under ROOT."""
    return ROOT / folder / f"{chapter}{SUFFIX[folder]}.ipynb"


def resolve(nb_path: str | pathlib.Path) -> pathlib.Path:
    """``labs/NN_slug.ipynb`` and ``labs/NN_slug_lab.ipynb`` alike (same for solutions):
    the file that exists, preferring the path as given."""
    given = ROOT / nb_path
    if given.exists():
        return given
    folder = given.parent.name
    if folder in SUFFIX:
        other = path_of(folder, chapter_of(given))
        if other.exists():
            return other
        legacy = given.parent / f"{chapter_of(given)}.ipynb"
        if legacy.exists():
            return legacy
    return given


def chapters() -> list[str]:
    """Every chapter with at least one notebook, in order: ['01_why_distributed', ...]."""
    found = {chapter_of(p) for folder in SUFFIX for p in (ROOT / folder).glob("[0-9]*.ipynb")}
    return sorted(found)


def rename_legacy() -> list[str]:
    """Rename ``labs/NN_slug.ipynb`` -> ``labs/NN_slug_lab.ipynb`` (and solutions likewise).

    If both names exist (a branch added the old name after the rename), the old
    one is the newer content and replaces the new one.
    """
    moved = []
    for folder in ("labs", "solutions"):
        for old in sorted((ROOT / folder).glob("[0-9]*.ipynb")):
            new = path_of(folder, chapter_of(old))
            if old != new and old.stem == chapter_of(old):
                os.replace(old, new)
                moved.append(f"{old.relative_to(ROOT)} -> {new.relative_to(ROOT)}")
    return moved


# ---------------------------------------------------------------- metadata

def _as_javascript_writes(value):
    """JSON numbers as JavaScript writes them: 70.0 -> 70. JupyterLab re-serializes the
    notebook in the browser, so an integral float in the saved widget state (a slider's
    70.0) would otherwise change on every save."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)
    if isinstance(value, dict):
        return type(value)((k, _as_javascript_writes(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_as_javascript_writes(v) for v in value]
    return value


def normalize(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Metadata as JupyterLab would leave it, so opening the notebook changes nothing."""
    nb.nbformat, nb.nbformat_minor = 4, 5
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = dict(LANGUAGE_INFO)
    nb.metadata = nbformat.from_dict(_as_javascript_writes(nb.metadata))
    for i, cell in enumerate(nb.cells):
        cell.metadata = nbformat.from_dict(_as_javascript_writes(cell.metadata))
        for out in cell.get("outputs", []):  # JSON outputs (widget views, application/json)
            for key in ("data", "metadata"):
                if key in out:
                    out[key] = nbformat.from_dict(_as_javascript_writes(out[key]))
        for key in TRANSIENT_CELL_KEYS:
            cell.metadata.pop(key, None)
        if not cell.get("id"):
            cell["id"] = f"cell-{i}"
    ids = [c["id"] for c in nb.cells]
    if len(set(ids)) != len(ids):  # duplicated ids make JupyterLab invent new ones
        for i, cell in enumerate(nb.cells):
            cell["id"] = f"cell-{i}"
    return nb


def write(nb: nbformat.NotebookNode, path: str | pathlib.Path) -> None:
    nbformat.write(normalize(nb), path)


def normalize_files(paths: list[pathlib.Path] | None = None) -> list[str]:
    """Rewrite the notebooks whose file would change; returns those paths."""
    changed = []
    for path in paths or all_notebooks():
        before = path.read_text(encoding="utf-8")
        after = _text(normalize(nbformat.reads(before, as_version=4)))
        if after != before:
            path.write_text(after, encoding="utf-8")
            changed.append(str(path.relative_to(ROOT)))
    return changed


def _text(nb: nbformat.NotebookNode) -> str:
    """The file nbformat.write (and so Jupyter's server on save) writes for ``nb``."""
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def all_notebooks() -> list[pathlib.Path]:
    """Every notebook of the course, the landing page included."""
    found = sorted(p for folder in SUFFIX for p in (ROOT / folder).glob("*.ipynb"))
    return found + [ROOT / INDEX] if (ROOT / INDEX).exists() else found


# ---------------------------------------------------------------- landing page

def _title(chapter: str) -> str:
    """'01 · Why LLM training ...' from the first heading of the course (or solution) notebook."""
    for folder in ("course", "solutions", "labs"):
        path = path_of(folder, chapter)
        if not path.exists():
            path = resolve(f"{folder}/{chapter}.ipynb")
        if path.exists():
            first = nbformat.read(path, as_version=4).cells[0].source.splitlines()[0]
            title = re.sub(r"\s*\((course|solutions|lab[^)]*)\)\s*$", "", first.lstrip("# ").strip())
            return re.sub(r"^\d+\s*·\s*", "", title)
    return chapter


def _chapter_rows(link) -> list[str]:
    """The chapter table's rows; ``link(folder, path)`` is the href of a notebook of the
    repository (path relative to the repository) or None for no link."""
    rows = []
    for ch in chapters():
        links = []
        for folder, label in (("course", "course"), ("labs", "lab"), ("solutions", "solution")):
            path = resolve(f"{folder}/{ch}.ipynb")
            href = link(folder, path.relative_to(ROOT).as_posix()) if path.exists() else None
            links.append(f"[{label}]({href})" if href else "")
        rows.append(f"| {ch[:2]} | {_title(ch)} | " + " | ".join(links) + " |")
    return rows


def make_index() -> nbformat.NotebookNode:
    """START_HERE.ipynb: one markdown cell linking every chapter's course, lab and solution."""
    text = "\n".join([
        "# Distributed LLM Training, hands-on: start here",
        "",
        "Each chapter has three notebooks. Read and run the **course** notebook first; then "
        "fill in the exercises of the **lab** (each exercise is followed by a check cell that "
        "says what is still wrong); the **solution** is the same lab solved. Click a link to open it.",
        "",
        "| # | chapter | | | |",
        "| --- | --- | --- | --- | --- |",
        *_chapter_rows(lambda folder, path: path),
        "",
        "**Keep your work across updates.** The notebooks here are part of the course's "
        "repository: if you edit and save them, `git pull` will refuse to update them. Run "
        "`make my-copy` in a terminal and work in the `work/` folder it creates: open "
        "`work/START_HERE.ipynb`, this same table linking *your* copies (`make lab` opens it "
        "once it exists). Your copies are yours (git ignores `work/`), and running "
        "`make my-copy` again after a `git pull` adds new chapters without touching the ones "
        "you have. `make reset` instead throws away your changes to the repository's notebooks.",
        "",
        "The mechanisms the notebooks run live in `helpers/`, one module per mechanism; "
        "each opens with an explanation worth reading beside its chapter.",
    ])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text, id="start-here")])
    return normalize(nb)


# ---------------------------------------------------------------- a learner's own copies

MY_COPY_FILES = {"course": ["*.ipynb", "timing_noise.md"], "labs": ["*.ipynb"]}


def make_my_index() -> nbformat.NotebookNode:
    """work/START_HERE.ipynb: the chapter table, its course and lab links to the copies
    beside it, the solutions' to the repository's (they are not copied)."""
    text = "\n".join([
        "# Your copies: start here",
        "",
        "These are your own copies of the course and lab notebooks (`make my-copy` made them "
        "in `work/`, which git ignores): edit and save freely, `git pull` never touches them. "
        "Run `make my-copy` again after a `git pull` to add new chapters; it keeps the copies "
        "you have. The solutions link to the repository's notebooks.",
        "",
        "| # | chapter | your course copy | your lab copy | solution |",
        "| --- | --- | --- | --- | --- |",
        *_chapter_rows(lambda folder, path: f"../{path}" if folder == "solutions" else path),
    ])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text, id="my-copies")])
    return normalize(nb)


def my_copy(dest: pathlib.Path) -> list[str]:
    """``make my-copy``: copy course/ and labs/ into ``dest``/course and ``dest``/labs
    (the course's notes too, so that their links work there) and write
    ``dest``/START_HERE.ipynb. Never overwrites a copy; a copy an earlier version
    left directly in ``dest`` is moved into its folder. One line per file."""
    lines = []
    for folder, patterns in MY_COPY_FILES.items():
        (dest / folder).mkdir(parents=True, exist_ok=True)
        for pattern in patterns:
            for src in sorted((ROOT / folder).glob(pattern)):
                target, flat = dest / folder / src.name, dest / src.name
                shown = target.relative_to(dest.parent) if dest.is_absolute() else target
                if target.exists():
                    lines.append(f"kept   {shown}")
                elif flat.exists():
                    flat.rename(target)
                    lines.append(f"moved  {shown} (it was in {dest.name}/)")
                else:
                    shutil.copy2(src, target)
                    lines.append(f"copied {shown}")
    index = dest / INDEX
    text = _text(make_my_index())
    if not index.exists() or index.read_text(encoding="utf-8") != text:
        index.write_text(text, encoding="utf-8")
    return lines


def write_index() -> bool:
    """Write START_HERE.ipynb if it changed; True if it did."""
    text = _text(make_index())
    path = ROOT / INDEX
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.write_text(text, encoding="utf-8")
    return True


def strip_solutions(source: str) -> str:
    """Replace each BEGIN/END SOLUTION block by a NotImplementedError stub."""
    out, inside = [], False
    for line in source.splitlines():
        m = BEGIN.match(line)
        if m and not inside:
            inside = True
            hint = (m.group("hint") or "implement this").strip().replace('"', "'")
            out.append(f'{m.group("indent")}raise NotImplementedError("Exercise: {hint}")')
        elif END.match(line) and inside:
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError("a '# BEGIN SOLUTION' block has no '# END SOLUTION'")
    return "\n".join(out)


def make_lab(solution: nbformat.NotebookNode) -> nbformat.NotebookNode:
    # no widget state: a lab is committed without outputs
    lab = nbformat.v4.new_notebook(metadata={k: v for k, v in solution.metadata.items()
                                             if k != "widgets"})
    for cell in solution.cells:
        # execution timestamps belong to the executed solution, not to the lab
        meta = {k: v for k, v in cell.metadata.items() if k != "execution"}
        if cell.cell_type == "code":
            new = nbformat.v4.new_code_cell(strip_solutions(cell.source), metadata=meta)
        else:
            new = nbformat.v4.new_markdown_cell(cell.source, metadata=meta)
            if cell.get("attachments"):
                new["attachments"] = cell.attachments
        new.pop("id", None)
        lab.cells.append(new)
    lab.cells[0].source = lab.cells[0].source.replace(
        "(solutions)", "(lab: fill in the exercises)", 1)
    return lab


def _normalized(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def labs(check: bool, names: list[str] | None = None) -> int:
    """Regenerate (or, with check, compare) labs; ``names`` limits it to those notebooks."""
    stale = []
    # "03_all_reduce_ring", "03_all_reduce_ring.ipynb" or "solutions/03_..." alike
    wanted = {chapter_of(n) for n in names or []}
    solutions = {chapter_of(p): p for p in sorted((ROOT / "solutions").glob("[0-9]*.ipynb"))}
    unknown = wanted - set(solutions)
    if unknown:
        print(f"no such solution notebook: {', '.join(sorted(unknown))}")
        return 2
    for chapter, sol_path in sorted(solutions.items()):
        if wanted and chapter not in wanted:
            continue
        lab = make_lab(nbformat.read(sol_path, as_version=4))
        lab_path = path_of("labs", chapter)
        if check:
            if not lab_path.exists() or \
                    _normalized(nbformat.read(lab_path, as_version=4)) != _normalized(lab):
                stale.append(lab_path.name)
        else:
            for i, cell in enumerate(lab.cells):
                cell["id"] = f"cell-{i}"
            write(lab, lab_path)
    if not check:
        write_index()
    if stale:
        print(f"labs out of date (run `make labs`): {', '.join(stale)}")
        return 1
    return 0


def wait_for_quiet(max_wait: float = 300.0, poll: float = 10.0, cores: int | None = None,
                   load=os.getloadavg, sleep=time.sleep) -> float:
    """Wait until the 1-minute load average is below the core count; return it.

    A notebook recorded while other work runs teaches noise: its timings are the
    other work's, and its ranks get a fraction of a core each. Refuses (RuntimeError)
    after ``max_wait`` seconds of a busy machine rather than recording anyway."""
    cores = cores or os.cpu_count() or 1
    waited = 0.0
    while (current := load()[0]) >= cores:
        if waited >= max_wait:
            raise RuntimeError(
                f"load average {current:.1f} on {cores} cores after waiting {waited:.0f} s: "
                f"not recording on a busy machine (stop the other work, or pass --busy-ok)")
        print(f"load average {current:.1f} >= {cores} cores: waiting for a quiet machine")
        sleep(poll)
        waited += poll
    return current


def run(paths: list[str], timeout: int = 600, busy_ok: bool = False) -> int:
    from nbclient import NotebookClient

    if not paths:
        paths = [str(p) for d in ("course", "solutions") for p in sorted((ROOT / d).glob("*.ipynb"))]
    failed = 0
    for path in paths:   # one at a time: each notebook alone on the machine
        if not busy_ok:
            wait_for_quiet()
        nb = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                           resources={"metadata": {"path": str(ROOT)}}).execute()
        except Exception as exc:  # keep going; report at the end
            failed += 1
            print(f"FAILED {path}: {str(exc)[-2000:]}")
            continue
        write(nb, path)
        print(f"{time.perf_counter() - start:6.1f} s  {path}")
    return 1 if failed else 0


def from_percent(text: str) -> nbformat.NotebookNode:
    """'# %%' starts a code cell, '# %% [markdown]' a markdown cell (lines '# '-prefixed)."""
    nb = nbformat.v4.new_notebook()
    kind, lines = None, []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in body.splitlines())
            nb.cells.append(nbformat.v4.new_markdown_cell(body))
        elif body:
            nb.cells.append(nbformat.v4.new_code_cell(body))

    for line in text.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        else:
            lines.append(line)
    flush()
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"
    return normalize(nb)


def exercise(nb_path: str | pathlib.Path, name: str, spelling: str | None = None) -> object:
    """Load ``name`` as the learner would have it: exec the notebook's first code
    cell (imports) and the cell that defines ``name``, return the object.

    Tests use this to prove each check fails on the lab's real stub. ``spelling``
    rewrites the cell's ``dist.x`` first, as learners also write it: "imported" (a
    name imported before the code runs, ``from torch.distributed import x as td_x``)
    or "torch.distributed" (``torch.distributed.x``).
    """
    nb = nbformat.read(resolve(nb_path), as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    pattern = re.compile(rf"^(def|class)\s+{re.escape(name)}\b|^{re.escape(name)}\s*=", re.M)
    cells = [src for src in code if pattern.search(src)]
    if not cells:
        raise LookupError(f"{nb_path} defines no {name!r}")
    if "checks.check_" in cells[0]:
        # Otherwise loading the lab's stub would already raise inside the check,
        # and a test of "the check fails on the stub" would pass for the wrong reason.
        raise ValueError(f"{nb_path}: the cell defining {name!r} also calls a check; "
                         "put the check call in the next cell")
    cell = respell(cells[0], spelling) if spelling else cells[0]
    namespace: dict = {"__name__": "__lab__"}
    exec(compile(code[0], f"{nb_path}[setup]", "exec"), namespace)
    exec(compile(cell, f"{nb_path}[{name}]", "exec"), namespace)
    return namespace[name]


def respell(source: str, spelling: str) -> str:
    """``source`` with every ``dist.x`` written another way (see ``exercise``)."""
    names = sorted(set(re.findall(r"(?<![\w.])dist\.([A-Za-z_]\w*)", source)))
    if spelling == "torch.distributed":
        return "import torch\n" + re.sub(r"(?<![\w.])dist\.", "torch.distributed.", source)
    if spelling != "imported":
        raise ValueError(f"spelling must be 'imported' or 'torch.distributed', got {spelling!r}")
    head = "".join(f"from torch.distributed import {n} as td_{n}\n" for n in names)
    return head + re.sub(r"(?<![\w.])dist\.([A-Za-z_]\w*)", r"td_\1", source)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("labs"); p.add_argument("--check", action="store_true")
    p.add_argument("names", nargs="*", help="only these notebooks (e.g. 03_all_reduce_ring.ipynb)")
    p = sub.add_parser("run"); p.add_argument("paths", nargs="*")
    p.add_argument("--busy-ok", action="store_true",
                   help="record even while the load average exceeds the cores")
    p = sub.add_parser("new"); p.add_argument("src"); p.add_argument("out")
    sub.add_parser("normalize", help="rename old lab/solution names, normalize metadata, "
                                     "rewrite START_HERE.ipynb")
    p = sub.add_parser("my-copy", help="copy course/ and labs/ into DEST (make my-copy)")
    p.add_argument("dest", nargs="?", default="work")
    args = parser.parse_args(argv)
    if args.cmd == "my-copy":
        dest = pathlib.Path(args.dest)
        for line in my_copy(dest):
            print(line)
        print(f"your copies are in {dest}/course and {dest}/labs (git ignores {dest}/): open "
              f"{dest}/{INDEX}, which links them (make lab opens it)")
        return 0
    if args.cmd == "normalize":
        for line in rename_legacy():
            print(f"renamed {line}")
        if write_index():
            print(f"wrote {INDEX}")
        for path in normalize_files():
            print(f"normalized {path}")
        return 0
    if args.cmd == "labs":
        return labs(args.check, args.names)
    if args.cmd == "run":
        return run(args.paths, busy_ok=args.busy_ok)
    write(from_percent(pathlib.Path(args.src).read_text()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
