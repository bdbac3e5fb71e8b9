"""Build the course's static site into _build/site (``make site``).

    python tools/site/build.py            # stage, then sphinx-build -W into _build/site
    python tools/site/build.py --stage    # only write the Sphinx source tree (_build/site-src)

The source tree is staged from the committed files, never executed:

* ``index.ipynb``: START_HERE.ipynb (its links to course/, labs/ and
  solutions/ resolve to the pages below), plus the hidden table of contents;
* ``course/``: the chapters, each ending with links to the API pages of the
  helpers modules it imports (read from its ``from helpers... import`` lines);
* ``labs/``: the labs as a learner gets them (stubs, no outputs);
* ``solutions/``: the solved labs with each answer cell folded (myst-nb's
  ``hide-input`` tag: the code opens on a click, the check's ✓ line shows);
* a widget shows the static picture stored with it (helpers.plots.interact);
  one stored without a picture shows a line saying to run the notebook;
* ``api/``: a page per helpers module (Sphinx autodoc over its docstrings),
  each naming the chapters that use it.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONF = pathlib.Path(__file__).resolve().parent
SRC = ROOT / "_build" / "site-src"
OUT = ROOT / "_build" / "site"
# from helpers.x import a, b  /  from helpers.x import (a,\n b)  /  import helpers.x
IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(helpers[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)"
                    r"|import[ \t]+(helpers[\w.]*))", re.M)


def helpers_modules() -> list[str]:
    """Every module of the helpers package, by dotted name."""
    names = []
    for path in sorted((ROOT / "helpers").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return sorted(names)


def chapter_modules(nb: nbformat.NotebookNode, modules: set[str]) -> list[str]:
    """The helpers modules a notebook imports (``from helpers.x import y`` counts
    helpers.x.y when y is itself a module)."""
    found = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for pkg, names, plain in IMPORT.findall(cell.source):
            module = pkg or plain
            found.add(module)
            for name in re.findall(r"\w+", names):
                if f"{module}.{name}" in modules:
                    found.add(f"{module}.{name}")
    found.discard("helpers")  # the package page is only its docstring; name what is used
    return sorted(found & modules)


WIDGET = "application/vnd.jupyter.widget-view+json"
# What a page shows for a widget stored without its static picture (a plain
# ipywidgets.interact rather than helpers.plots.interact): its text repr,
# "interactive(children=(Dropdown(...", says nothing to a reader.
NO_PICTURE = ('<p class="widget-note"><em>An interactive control is here: open the notebook '
              'in JupyterLab and run the cell to use it.</em></p>')


def static_widgets(nb: nbformat.NotebookNode) -> int:
    """Give each widget output what a page can show; return how many had no picture."""
    bare = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET in data and not any(m.startswith("image/") or m == "text/html" for m in data):
                out["data"] = {"text/html": NO_PICTURE}
                bare += 1
    return bare


def chapter_title(nb: nbformat.NotebookNode) -> str:
    first = next(c.source for c in nb.cells if c.cell_type == "markdown")
    return first.splitlines()[0].lstrip("# ").strip()


def stage() -> dict[str, list[str]]:
    """Write the Sphinx source tree; return {module: [chapter docnames]}."""
    if SRC.exists():
        shutil.rmtree(SRC)
    modules = set(helpers_modules())
    used_by: dict[str, list[str]] = collections.defaultdict(list)
    toc = []
    for folder in ("course", "labs", "solutions"):
        (SRC / folder).mkdir(parents=True)
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            nb.metadata.pop("widgets", None)  # no live widgets: no widget JS from a CDN
            static_widgets(nb)
            doc = f"{folder}/{path.stem}"
            toc.append(doc)
            if folder == "course":
                used = chapter_modules(nb, modules)
                for m in used:
                    used_by[m].append(doc)
                if used:
                    links = ", ".join(f"[`{m}`](/api/{m})" for m in used)
                    nb.cells.append(nbformat.v4.new_markdown_cell(
                        f"---\n\n**The helpers this chapter uses**, with their documentation: {links}."))
            if folder == "solutions":
                for cell in nb.cells:
                    if cell.cell_type == "code" and "# BEGIN SOLUTION" in cell.source:
                        tags = cell.metadata.setdefault("tags", [])
                        if "hide-input" not in tags:
                            tags.append("hide-input")
            nbformat.write(nb, SRC / folder / path.name)
        for extra in sorted((ROOT / folder).glob("*.md")):
            shutil.copy(extra, SRC / folder / extra.name)
            toc.append(f"{folder}/{extra.stem}")
    write_api(sorted(modules), used_by)
    index = nbformat.read(ROOT / "START_HERE.ipynb", as_version=4)
    captions = {"course": "Chapters", "labs": "Labs (exercises to fill in)",
                "solutions": "Solutions (answers folded)"}
    tree = "\n\n".join(
        "\n".join(["```{toctree}", ":hidden:", ":maxdepth: 1", f":caption: {caption}", ""]
                  + [d for d in toc if d.startswith(folder + "/")] + ["```"])
        for folder, caption in captions.items())
    tree += "\n\n" + "\n".join(["```{toctree}", ":hidden:", ":caption: Reference", "",
                                 "api/index", "```"])
    index.cells.append(nbformat.v4.new_markdown_cell(
        "The documentation of every `helpers` module, from its docstrings: "
        "[the helpers package](api/index.rst).\n\n" + tree))
    nbformat.write(index, SRC / "index.ipynb")
    shutil.copy(CONF / "conf.py", SRC / "conf.py")
    return used_by


def write_api(modules: list[str], used_by: dict[str, list[str]]) -> None:
    api = SRC / "api"
    api.mkdir()
    lines = ["The helpers package", "===================", "",
             "One page per module, from its docstrings. Each mechanism the chapters",
             "teach is one module; the chapters import them.", "",
             ".. toctree::", "   :maxdepth: 1", ""]
    lines += [f"   {m}" for m in modules]
    (api / "index.rst").write_text("\n".join(lines) + "\n")
    for m in modules:
        title = f"``{m}``"
        body = [title, "=" * len(title), ""]
        if used_by.get(m):
            body += ["Used in: " + ", ".join(f":doc:`/{d}`" for d in used_by[m]) + ".", ""]
        body += [f".. automodule:: {m}", ""]
        (api / f"{m}.rst").write_text("\n".join(body))


def build(jobs: str = "auto") -> int:
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
           "-j", jobs, "-d", str(ROOT / "_build" / "site-doctrees"), str(SRC), str(OUT)]
    return subprocess.call(cmd, cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", action="store_true", help="only write _build/site-src")
    parser.add_argument("-j", default="auto", help="sphinx-build processes (default: auto)")
    args = parser.parse_args()
    missing = [p for p in ("sphinx", "myst_nb") if importlib.util.find_spec(p) is None]
    if missing:
        sys.exit(f"make site needs {', '.join(missing)}: pip install -e '.[site]' "
                 f"(make site installs it into .venv)")
    stage()
    if args.stage:
        return 0
    code = build(args.j)
    if code == 0:
        print(f"site: {OUT / 'index.html'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
