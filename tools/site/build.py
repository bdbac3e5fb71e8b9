"""Build the course's static site into _build/site (``make site``).

    python tools/site/build.py            # stage, then sphinx-build -W into _build/site
    python tools/site/build.py --stage    # only write the Sphinx source tree (_build/site-src)

The source tree is staged from the committed files, never executed, and the
repository's notebooks are never written: every change below is made to the
staged copy only.

* ``index.ipynb``: START_HERE.ipynb (its links to course/, labs/ and
  solutions/ resolve to the pages below), plus the hidden tables of contents
  that give the site its reading order: part by part, each chapter followed by
  its lab and its solution, then the course's notes, then the helpers API;
* ``course/``: the chapters, each opening with links to its lab and solution
  and ending with links to the API pages of the helpers modules it imports
  (read from its ``from helpers... import`` lines; a name a package re-exports
  links the page of the module that defines it as well);
* ``labs/``: the labs as a learner gets them (stubs, no outputs), each opening
  with a link to its chapter and its solution;
* ``solutions/``: the solved labs with each answer cell folded (myst-nb's
  ``hide-input`` tag: the code opens on a click, the check's ✓ line shows);
* in every notebook: the test markers are taken out of the code cells
  (``# NBVAL_CHECK_OUTPUT``, ``# NBVAL_SKIP``, ``# noqa: ...``: they are for
  nbval and the linter, not for a reader), and consecutive prints of a cell
  to the same stream are one output (one box on the page, as JupyterLab shows
  them);
* a widget shows the static picture stored with it (helpers.plots.interact),
  with a line saying it is a picture of live controls; one stored without a
  picture shows a line saying to run the notebook;
* ``api/``: a page per helpers module (Sphinx autodoc over its docstrings),
  each naming the chapters that use it;
* ``_book.json``: the sidebar's groups (parts of chapters, notes, the API),
  read by conf.py into the templates of tools/site/theme.
"""

from __future__ import annotations

import argparse
import ast
import collections
import importlib.util
import io
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tokenize

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONF = pathlib.Path(__file__).resolve().parent
SRC = ROOT / "_build" / "site-src"
OUT = ROOT / "_build" / "site"
# from helpers.x import a, b  /  from helpers.x import (a,\n b)  /  import helpers.x
IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(helpers[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)"
                    r"|import[ \t]+(helpers[\w.]*))", re.M)

# The sidebar's parts: (title, first chapter, last chapter). A chapter whose number
# falls in no range (a new one) joins the last part, so that it is never left out.
PARTS = [
    ("Part I · Many ranks, one model: data parallelism", 1, 5),
    ("Part II · What fills a GPU, what links the GPUs", 6, 7),
    ("Part III · Splitting the model: tensor, sequence, pipeline", 8, 12),
    ("Part IV · Buying back memory, hiding communication", 13, 16),
    ("Part V · Running, debugging and designing a real job", 17, 20),
    ("Beyond the series", 21, 10**6),
]
NOTES = "Notes"
REFERENCE = "Reference"


def helpers_modules() -> list[str]:
    """Every module of the helpers package, by dotted name."""
    names = []
    for path in sorted((ROOT / "helpers").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return sorted(names)


def reexports(package: str) -> dict[str, str]:
    """The names a helpers package's ``__init__`` imports from its own modules, with
    the module each comes from (``{"FSDP": "helpers.fsdp.wrap", ...}``), read
    without importing it. A module that is not a package re-exports nothing."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    if not init.is_file():
        return {}
    out = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 \
                and (node.module or "").startswith(package + "."):
            out.update({a.asname or a.name: node.module for a in node.names})
    return out


def chapter_modules(nb: nbformat.NotebookNode, modules: set[str]) -> list[str]:
    """The helpers modules a notebook imports (``from helpers.x import y`` counts
    helpers.x.y when y is itself a module, and the module of helpers.x that
    defines y when the package helpers.x re-exports it: its page documents y)."""
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
                elif name in (defined := reexports(module)):
                    found.add(defined[name])
    found.discard("helpers")  # the package page is only its docstring; name what is used
    return sorted(found & modules)


# -- what a reader should not see in a code cell ---------------------------------------

# A whole line that is an nbval marker: "# NBVAL_CHECK_OUTPUT", "# NBVAL_SKIP", ...
NBVAL_LINE = re.compile(r"^[ \t]*#[ \t]*NBVAL_[A-Z_]+\b[^\n]*(?:\n|$)", re.M)
# A linter directive at the start of a comment, with its codes and the dash or colon
# that may join it to an explanation ("# noqa: E731 - of the steps after the first").
NOQA = re.compile(r"#[ \t]*noqa\b(?:[ \t]*:[ \t]*[A-Z]+[0-9]*(?:[ \t]*,[ \t]*[A-Z]+[0-9]*)*)?"
                  r"[ \t]*(?:[-–—:;][ \t]*)?", re.I)


def _comments(source: str) -> list[tuple[int, int, str]]:
    """(line index, column, text) of each comment, found by Python's tokenizer so that
    a "#" inside a string is not one. IPython syntax (%magic, !cmd) tokenizes too; a
    cell that does not (an unclosed bracket) falls back to '  #' after code."""
    try:
        return [(t.start[0] - 1, t.start[1], t.string)
                for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        found = []
        for i, line in enumerate(source.split("\n")):
            m = re.search(r"(?:^|[ \t])(#[^\n]*)$", line)
            if m:
                found.append((i, m.start(1), m.group(1)))
        return found


def strip_markers(source: str) -> str:
    """A code cell's source without nbval markers and noqa directives.

    A line that is only a marker goes; ``x = f()  # noqa: E731`` keeps its code;
    ``# noqa: E731 - why`` keeps its explanation as ``# why``."""
    source = NBVAL_LINE.sub("", source)
    if "noqa" not in source.lower():
        return source
    lines = source.split("\n")
    drop = set()
    for i, col, text in _comments(source):
        m = NOQA.match(text)
        if not m:
            continue
        rest = text[m.end():].strip()
        code = lines[i][:col].rstrip()
        if rest:
            lines[i] = f"{lines[i][:col]}# {rest}"
        elif code:
            lines[i] = code
        else:
            drop.add(i)
    return "\n".join(line for i, line in enumerate(lines) if i not in drop)


def strip_notebook_markers(nb: nbformat.NotebookNode) -> int:
    """Strip markers from every code cell; return how many cells changed."""
    changed = 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            new = strip_markers(cell.source)
            if new != cell.source:
                cell.source = new
                changed += 1
    return changed


def merge_streams(nb: nbformat.NotebookNode) -> int:
    """Join consecutive stream outputs of a cell to the same stream (stdout after
    stdout, stderr after stderr) into one, as JupyterLab shows them: one box per
    print run, not one per flush. Returns how many outputs were merged away."""
    merged_away = 0
    for cell in nb.cells:
        outputs = cell.get("outputs")
        if not outputs:
            continue
        kept: list = []
        for out in outputs:
            prev = kept[-1] if kept else None
            if (out.get("output_type") == "stream" and prev is not None
                    and prev.get("output_type") == "stream" and prev.get("name") == out.get("name")):
                prev["text"] = _text(prev.get("text", "")) + _text(out.get("text", ""))
                merged_away += 1
            else:
                kept.append(out)
        cell["outputs"] = kept
    return merged_away


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


# -- widgets ------------------------------------------------------------------------

WIDGET = "application/vnd.jupyter.widget-view+json"
# What a page shows for a widget stored without its static picture (a plain
# ipywidgets.interact rather than helpers.plots.interact): its text repr,
# "interactive(children=(Dropdown(...", says nothing to a reader.
NO_PICTURE = ('<p class="widget-note"><em>An interactive control is here: open the notebook '
              'in JupyterLab and run the cell to use it.</em></p>')
# Under a widget's stored picture: on a page nothing runs, so say what the picture is.
WIDGET_CAPTION = ('<p class="widget-caption">In the notebook this output has live controls; '
                  'here it is shown at their first settings. Open the notebook in JupyterLab '
                  'and run the cell to move them.</p>')
# Under a slider's strip (helpers.drawing.step_frames, marked in the output's metadata
# by helpers.plots.show_widget): the picture is every step, not the first one. The key and
# value are helpers.plots' PICTURE_KEY and EVERY_STEP (the build does not import helpers;
# tests/test_site.py checks they agree).
PICTURE_KEY, EVERY_STEP = "course_picture", "every step"
STRIP_CAPTION = ('<p class="widget-caption">In the notebook this output is a slider over the '
                 'steps; here every step is shown side by side. Open the notebook in JupyterLab '
                 'and run the cell to step through them.</p>')
# helpers.plots._snapshot's line for a notebook not run yet: true in JupyterLab, not on a page.
RUN_TO_GET = re.compile(r"\s*Run the cell to get the controls\.")


def static_widgets(nb: nbformat.NotebookNode) -> int:
    """Give each widget output what a page can show; return how many had no picture."""
    bare = 0
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            outputs.append(out)
            data = out.get("data", {})
            if WIDGET not in data:
                continue
            if not any(m.startswith("image/") or m == "text/html" for m in data):
                out["data"] = {"text/html": NO_PICTURE}
                bare += 1
                continue
            if "text/html" in data:
                data["text/html"] = RUN_TO_GET.sub("", _text(data["text/html"]))
            strip = out.get("metadata", {}).get(PICTURE_KEY) == EVERY_STEP
            caption = STRIP_CAPTION if strip else WIDGET_CAPTION
            outputs.append(nbformat.v4.new_output("display_data", data={"text/html": caption}))
        if "outputs" in cell:
            cell["outputs"] = outputs
    return bare


# -- the book's structure -------------------------------------------------------------

def chapter_title(nb: nbformat.NotebookNode) -> str:
    first = next(c.source for c in nb.cells if c.cell_type == "markdown")
    return first.splitlines()[0].lstrip("# ").strip()


def short_title(title: str) -> str:
    """A notebook's title without its "(course)" / "(solutions)" / "(lab: ...)" tail."""
    return re.sub(r"\s*\((?:course|solutions?|lab\b[^)]*)\)\s*$", "", title)


def part_of(stem: str) -> str:
    """The part a chapter (by file stem, "03_all_reduce_ring") belongs to."""
    m = re.match(r"(\d+)", stem)
    number = int(m.group(1)) if m else 10**6
    for title, first, last in PARTS:
        if first <= number <= last:
            return title
    return PARTS[-1][0]


def book(chapters: list[tuple[str, str]], labs: set[str], solutions: set[str],
         notes: list[tuple[str, str]], modules: list[str]) -> dict:
    """The sidebar's groups and each page's place, from the docnames.

    ``chapters``: (docname "course/NN_slug", title) in reading order; ``labs`` and
    ``solutions``: the docnames that exist; ``notes``: (docname, title) of the
    course's markdown notes; ``modules``: the helpers modules (each an API page).
    Returns {"groups": [{"title", "entries": [{"doc", "title", "companions":
    [{"doc", "label"}]}]}], "pages": {docname: {"group", "chapter", "role", "title"}}}.
    """
    groups: dict[str, list] = {title: [] for title, _, _ in PARTS}
    pages: dict[str, dict] = {}
    for doc, title in chapters:
        stem = doc.split("/", 1)[1]
        part = part_of(stem)
        companions = []
        for folder, suffix, label in (("labs", "_lab", "lab"), ("solutions", "_solution", "solution")):
            other = f"{folder}/{stem}{suffix}"
            if other in (labs if folder == "labs" else solutions):
                companions.append({"doc": other, "label": label})
                pages[other] = {"group": part, "chapter": doc, "role": label, "title": short_title(title)}
        groups[part].append({"doc": doc, "title": short_title(title), "companions": companions})
        pages[doc] = {"group": part, "chapter": doc, "role": "chapter", "title": short_title(title)}
    result = [{"title": t, "entries": e} for t, e in groups.items() if e]
    if notes:
        result.append({"title": NOTES, "entries": [{"doc": d, "title": t, "companions": []}
                                                     for d, t in notes]})
        for d, t in notes:
            pages[d] = {"group": NOTES, "chapter": None, "role": "note", "title": t}
    if modules:
        result.append({"title": REFERENCE, "entries": [{
            "doc": "api/index", "title": "The helpers package",
            "companions": [{"doc": f"api/{m}", "label": m} for m in modules]}]})
        pages["api/index"] = {"group": REFERENCE, "chapter": None, "role": "api", "title": "The helpers package"}
        for m in modules:
            pages[f"api/{m}"] = {"group": REFERENCE, "chapter": None, "role": "api", "title": m}
    return {"groups": result, "pages": pages}


def reading_order(structure: dict) -> list[str]:
    """Every page after the index, in the order of its previous/next links."""
    order = []
    for group in structure["groups"]:
        for entry in group["entries"]:
            order.append(entry["doc"])
            order += [c["doc"] for c in entry["companions"]]
    return order


def link_companions(nb: nbformat.NotebookNode, doc: str, structure: dict) -> None:
    """Put under the notebook's title the links to its chapter, lab and solution."""
    page = structure["pages"].get(doc)
    if not page or not page["chapter"]:
        return
    chapter = page["chapter"]
    entry = next(e for g in structure["groups"] for e in g["entries"] if e["doc"] == chapter)
    link = {c["label"]: f"../{c['doc']}.ipynb" for c in entry["companions"]}
    link["chapter"] = f"../{chapter}.ipynb"
    if page["role"] == "chapter":
        if not entry["companions"]:
            return
        parts = []
        if "lab" in link:
            parts.append(f"[the lab]({link['lab']}) (fill in the exercises; each has a check)")
        if "solution" in link:
            parts.append(f"[the solution]({link['solution']}) (the answers, folded)")
        text = "**Exercises for this chapter:** " + " · ".join(parts) + "."
    elif page["role"] == "lab":
        text = (f"**The lab of chapter [{page['title']}]({link['chapter']})**: read the chapter "
                "first; each exercise is followed by a check cell.")
        if "solution" in link:
            text += f" Answers: [the solution]({link['solution']})."
    else:
        text = f"**The solution of the lab of chapter [{page['title']}]({link['chapter']})**."
        if "lab" in link:
            text += f" [The lab]({link['lab']}) is the same notebook with the exercises to fill in."
    block = "```{container} companions\n" + text + "\n```"
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if first is None:
        nb.cells.insert(0, nbformat.v4.new_markdown_cell(block))
        return
    lines = first.source.split("\n")
    at = next((i for i, line in enumerate(lines) if line.startswith("# ")), -1) + 1
    first.source = "\n".join(lines[:at] + ["", block, ""] + lines[at:]).strip("\n")


def toctree(entries: list[str], caption: str | None = None) -> str:
    lines = ["```{toctree}", ":hidden:", ":maxdepth: 1"]
    if caption:
        lines.append(f":caption: {caption}")
    return "\n".join(lines + [""] + entries + ["```"])


# -- staging ----------------------------------------------------------------------------

def stage() -> dict[str, list[str]]:
    """Write the Sphinx source tree; return {module: [chapter docnames]}."""
    if SRC.exists():
        shutil.rmtree(SRC)
    modules = set(helpers_modules())
    used_by: dict[str, list[str]] = collections.defaultdict(list)
    notebooks: dict[str, nbformat.NotebookNode] = {}
    notes: list[tuple[str, str]] = []
    for folder in ("course", "labs", "solutions"):
        (SRC / folder).mkdir(parents=True)
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            notebooks[f"{folder}/{path.stem}"] = nbformat.read(path, as_version=4)
        for extra in sorted((ROOT / folder).glob("*.md")):
            shutil.copy(extra, SRC / folder / extra.name)
            first = next((line for line in extra.read_text().splitlines() if line.startswith("# ")),
                         f"# {extra.stem}")
            notes.append((f"{folder}/{extra.stem}", first[2:].strip()))
    chapters = [(d, chapter_title(nb)) for d, nb in notebooks.items() if d.startswith("course/")]
    structure = book(chapters, {d for d in notebooks if d.startswith("labs/")},
                     {d for d in notebooks if d.startswith("solutions/")}, notes, sorted(modules))

    for doc, nb in notebooks.items():
        folder = doc.split("/")[0]
        nb.metadata.pop("widgets", None)  # no live widgets: no widget JS from a CDN
        strip_notebook_markers(nb)
        merge_streams(nb)
        static_widgets(nb)
        link_companions(nb, doc, structure)
        if folder == "course":
            used = chapter_modules(nb, modules)
            for m in used:
                used_by[m].append(doc)
            if used:
                links = ", ".join(f"[`{m}`](/api/{m})" for m in used)
                nb.cells.append(nbformat.v4.new_markdown_cell(
                    f"---\n\n**The helpers this chapter uses**, with their documentation: {links}."))
            entry = next(e for g in structure["groups"] for e in g["entries"] if e["doc"] == doc)
            if entry["companions"]:  # the lab and solution come after their chapter
                nb.cells.append(nbformat.v4.new_markdown_cell(
                    toctree(["/" + c["doc"] for c in entry["companions"]])))
        if folder == "solutions":
            for cell in nb.cells:
                if cell.cell_type == "code" and "# BEGIN SOLUTION" in cell.source:
                    tags = cell.metadata.setdefault("tags", [])
                    if "hide-input" not in tags:
                        tags.append("hide-input")
        nbformat.write(nb, SRC / f"{doc}.ipynb")
    write_api(sorted(modules), used_by)

    index = nbformat.read(ROOT / "START_HERE.ipynb", as_version=4)
    trees = []
    for group in structure["groups"]:
        if group["title"] == REFERENCE:
            trees.append(toctree(["api/index"], REFERENCE))
        else:
            trees.append(toctree([e["doc"] for e in group["entries"]], group["title"]))
    index.cells.append(nbformat.v4.new_markdown_cell(
        "The documentation of every `helpers` module, from its docstrings: "
        "[the helpers package](api/index.rst).\n\n" + "\n\n".join(trees)))
    nbformat.write(index, SRC / "index.ipynb")
    (SRC / "_book.json").write_text(json.dumps(structure, indent=1, ensure_ascii=False))
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
