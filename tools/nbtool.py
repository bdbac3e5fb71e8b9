"""Notebook pipeline: solutions are the source, labs are generated from them.

    python tools/nbtool.py labs [NAME ...] # regenerate labs/ from solutions/ (all, or these)
    python tools/nbtool.py labs --check    # exit 1 if labs/ is out of date
    python tools/nbtool.py run [NB ...]    # execute notebooks in place (default: course/ + solutions/)
    python tools/nbtool.py new SRC.py OUT.ipynb   # build a notebook from a "# %%" percent script

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
import pathlib
import re
import sys
import time

import nbformat

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<hint>.*))?$")
END = re.compile(r"^\s*# END SOLUTION\s*$")


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
    lab = nbformat.v4.new_notebook(metadata=solution.metadata)
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
    wanted = {pathlib.Path(n).stem + ".ipynb" for n in names or []}
    unknown = wanted - {p.name for p in (ROOT / "solutions").glob("*.ipynb")}
    if unknown:
        print(f"no such solution notebook: {', '.join(sorted(unknown))}")
        return 2
    for sol_path in sorted((ROOT / "solutions").glob("*.ipynb")):
        if wanted and sol_path.name not in wanted:
            continue
        lab = make_lab(nbformat.read(sol_path, as_version=4))
        lab_path = ROOT / "labs" / sol_path.name
        if check:
            if not lab_path.exists() or \
                    _normalized(nbformat.read(lab_path, as_version=4)) != _normalized(lab):
                stale.append(lab_path.name)
        else:
            for cell in lab.cells:
                cell["id"] = f"cell-{lab.cells.index(cell)}"
            nbformat.write(lab, lab_path)
    if stale:
        print(f"labs out of date (run `make labs`): {', '.join(stale)}")
        return 1
    return 0


def run(paths: list[str], timeout: int = 600) -> int:
    from nbclient import NotebookClient

    if not paths:
        paths = [str(p) for d in ("course", "solutions") for p in sorted((ROOT / d).glob("*.ipynb"))]
    failed = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                           resources={"metadata": {"path": str(ROOT)}}).execute()
        except Exception as exc:  # keep going; report at the end
            failed += 1
            print(f"FAILED {path}: {str(exc)[-2000:]}")
            continue
        nbformat.write(nb, path)
        print(f"{time.perf_counter() - start:6.1f} s  {path}")
    return 1 if failed else 0


def from_percent(text: str) -> nbformat.NotebookNode:
    """'# %%' starts a code cell, '# %% [markdown]' a markdown cell (lines '# '-prefixed)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    nb.metadata["language_info"] = {"name": "python"}
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
    return nb


def exercise(nb_path: str | pathlib.Path, name: str) -> object:
    """Load ``name`` as the learner would have it: exec the notebook's first code
    cell (imports) and the cell that defines ``name``, return the object.

    Tests use this to prove each check fails on the lab's real stub.
    """
    nb = nbformat.read(ROOT / nb_path, as_version=4)
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
    namespace: dict = {"__name__": "__lab__"}
    exec(compile(code[0], f"{nb_path}[setup]", "exec"), namespace)
    exec(compile(cells[0], f"{nb_path}[{name}]", "exec"), namespace)
    return namespace[name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("labs"); p.add_argument("--check", action="store_true")
    p.add_argument("names", nargs="*", help="only these notebooks (e.g. 03_all_reduce_ring.ipynb)")
    p = sub.add_parser("run"); p.add_argument("paths", nargs="*")
    p = sub.add_parser("new"); p.add_argument("src"); p.add_argument("out")
    args = parser.parse_args(argv)
    if args.cmd == "labs":
        return labs(args.check, args.names)
    if args.cmd == "run":
        return run(args.paths)
    nbformat.write(from_percent(pathlib.Path(args.src).read_text()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
