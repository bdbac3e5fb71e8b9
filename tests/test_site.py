"""make site (tools/site/build.py): the course as a static site, from the committed outputs.

The site is built once per session, by the same script as `make site`
(``sphinx-build -W`` with ``nitpicky``: any warning, a cross-reference that
resolves nowhere included, fails the build; tools/site/conf.py lists the two
kinds of target exempted and why). Then every page is read back: each internal link
and image points at a file (and an anchor) that exists, no page shows a
traceback or a reST error, every chapter page holds as many pictures as its
notebook's outputs, the solutions' answers are folded, each chapter links the
helpers modules it imports. The browser test opens the index and a chapter in
headless Chromium (see tests/test_browser.py for what it needs), and every
chapter page and a sample of lab and solution pages are measured there: no
output wider than the text column, previous/next links to the right
neighbours, the sidebar grouped by part, no test marker in a code cell.

It reads like a book: the staging (tools/site/build.py) strips the test
markers from code cells, merges a cell's consecutive prints into one output,
links each chapter with its lab and solution, and groups the sidebar. Those
transformations are tested first, on small synthetic notebooks, without Sphinx.

The tests of the built site need the site group (``pip install -e '.[site]'``;
`make site` and CI install it); without it they are skipped.
"""

from __future__ import annotations

import html.parser
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import urllib.parse

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SITE = ROOT / "_build" / "site"
CHAPTERS = sorted((ROOT / "course").glob("*.ipynb"))
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
pytestmark = pytest.mark.timeout(600)


def _load_build():
    """tools/site/build.py as a module (it needs nbformat only, not Sphinx)."""
    spec = importlib.util.spec_from_file_location("site_build", ROOT / "tools" / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _load_build()


# -- staging, on small synthetic notebooks (no Sphinx, no site build) --------------------

@pytest.mark.parametrize("source, shown", [
    ("# NBVAL_CHECK_OUTPUT\nprint(1)", "print(1)"),
    ("# NBVAL_SKIP\nx = 1\n", "x = 1\n"),
    ("  #NBVAL_IGNORE_OUTPUT\nx = 1", "x = 1"),
    ("from helpers.plots import interact  # noqa: E402", "from helpers.plots import interact"),
    ("f = lambda x: x  # noqa: E731, E501\ny = 2", "f = lambda x: x\ny = 2"),
    ("median = lambda xs: xs[0]  # noqa: E731 - of the steps after the first",
     "median = lambda xs: xs[0]  # of the steps after the first"),
    ("# noqa\nx = 1", "x = 1"),
    ("%time x = 1  # noqa: E501", "%time x = 1"),
    ("f(1,  # noqa: E501\n", "f(1,\n"),  # does not tokenize: the fallback
    # what is not a marker stays
    ('s = "# noqa: E402"  # a string, not a comment', 's = "# noqa: E402"  # a string, not a comment'),
    ("x = 1  # no qa here, and NBVAL_CHECK_OUTPUT in prose", "x = 1  # no qa here, and NBVAL_CHECK_OUTPUT in prose"),
    ("print('# NBVAL_SKIP')", "print('# NBVAL_SKIP')"),
])
def test_staging_strips_test_markers_from_code(source, shown):
    assert build.strip_markers(source) == shown


def test_staging_strips_markers_in_code_cells_only():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("Mark a cell with `# NBVAL_CHECK_OUTPUT` (a markdown cell keeps it)"),
        nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nimport os  # noqa: F401\nprint(os.sep)"),
        nbformat.v4.new_code_cell("print(2)")])
    assert build.strip_notebook_markers(nb) == 1
    assert nb.cells[1].source == "import os\nprint(os.sep)"
    assert "NBVAL_CHECK_OUTPUT" in nb.cells[0].source and nb.cells[2].source == "print(2)"


def _stream(name, text):
    return nbformat.v4.new_output("stream", name=name, text=text)


def test_staging_merges_consecutive_prints_to_the_same_stream():
    image = nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})
    cell = nbformat.v4.new_code_cell("...", outputs=[
        _stream("stdout", "a\n"), _stream("stdout", "b\n"), _stream("stderr", "[launch] ...\n"),
        _stream("stderr", "ready in 2.0 s\n"), _stream("stdout", "c\n"), image,
        _stream("stdout", "d"), _stream("stdout", "e\n")])
    nb = nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_markdown_cell("text")])
    assert build.merge_streams(nb) == 3
    shown = [(o.output_type, o.get("name"), o.get("text")) for o in nb.cells[0].outputs]
    assert shown == [("stream", "stdout", "a\nb\n"), ("stream", "stderr", "[launch] ...\nready in 2.0 s\n"),
                     ("stream", "stdout", "c\n"), ("display_data", None, None), ("stream", "stdout", "de\n")]
    nbformat.validate(nb)


def test_staging_captions_widget_pictures_and_drops_the_run_line():
    view = {"model_id": "m", "version_major": 2, "version_minor": 0}
    picture = nbformat.v4.new_output("display_data", data={
        build.WIDGET: view, "text/plain": "interactive(...)", "image/png": "iVBORw0KGgo="})
    printed = nbformat.v4.new_output("display_data", data={
        build.WIDGET: view, "text/plain": "interactive(...)",
        "text/html": "<pre>x</pre><p><i>At a = 1. Run the cell to get the controls.</i></p>"})
    bare = nbformat.v4.new_output("display_data", data={build.WIDGET: view, "text/plain": "interactive(...)"})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("...", outputs=[picture, printed, bare])])
    assert build.static_widgets(nb) == 1
    outs = nb.cells[0].outputs
    assert [build.WIDGET_CAPTION in o.get("data", {}).get("text/html", "") for o in outs] == [
        False, True, False, True, False]
    assert outs[2]["data"]["text/html"] == "<pre>x</pre><p><i>At a = 1.</i></p>"
    assert outs[4]["data"] == {"text/html": build.NO_PICTURE}


def test_a_strip_is_captioned_as_every_step_not_the_first_settings():
    """A slider's stored strip (step_frames) is every step side by side: its caption says
    so, where another widget's picture is its first settings."""
    from helpers import plots

    assert (build.PICTURE_KEY, build.EVERY_STEP) == (plots.PICTURE_KEY, plots.EVERY_STEP)
    view = {"model_id": "m", "version_major": 2, "version_minor": 0}
    data = {build.WIDGET: view, "text/plain": "interactive(...)", "image/png": "iVBORw0KGgo="}
    strip = nbformat.v4.new_output("display_data", data=dict(data),
                                   metadata={plots.PICTURE_KEY: plots.EVERY_STEP})
    first = nbformat.v4.new_output("display_data", data=dict(data),
                                   metadata={plots.PICTURE_KEY: plots.FIRST_SETTINGS})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("...", outputs=[strip, first])])
    assert build.static_widgets(nb) == 0
    captions = [o["data"]["text/html"] for o in nb.cells[0].outputs[1::2]]
    assert captions == [build.STRIP_CAPTION, build.WIDGET_CAPTION]


def test_step_frames_marks_its_picture_as_every_step(monkeypatch):
    """step_frames' stored picture carries the mark the site reads."""
    import matplotlib
    matplotlib.use("Agg")
    import IPython.display

    from helpers.drawing import step_frames
    from helpers.plots import EVERY_STEP, PICTURE_KEY

    shown = []
    monkeypatch.setattr(IPython.display, "display",
                        lambda obj, raw=False, metadata=None: shown.append(metadata))
    step_frames(lambda ax, i: ax.plot([0, i]), 2)
    assert shown == [{PICTURE_KEY: EVERY_STEP}]


def _book():
    chapters = [("course/01_why", "01 · Why (course)"), ("course/06_memory", "06 · Memory (course)"),
                ("course/21_moe", "21 · Experts (course)"), ("course/33_new", "33 · A new chapter (course)")]
    return build.book(chapters, {"labs/01_why_lab", "labs/06_memory_lab", "labs/21_moe_lab"},
                      {"solutions/01_why_solution", "solutions/21_moe_solution"},
                      [("course/timing_noise", "Timing noise on a laptop")],
                      ["helpers", "helpers.launch"])


def test_the_sidebar_groups_chapters_by_part_each_with_its_lab_and_solution():
    structure = _book()
    groups = {g["title"]: g["entries"] for g in structure["groups"]}
    parts = [t for t, _, _ in build.PARTS]
    assert list(groups) == [parts[0], parts[1], parts[-1], build.NOTES, build.REFERENCE]  # empty parts left out
    assert [e["doc"] for e in groups[parts[0]]] == ["course/01_why"]
    assert groups[parts[0]][0]["title"] == "01 · Why"  # without "(course)"
    assert [(c["doc"], c["label"]) for c in groups[parts[0]][0]["companions"]] == [
        ("labs/01_why_lab", "lab"), ("solutions/01_why_solution", "solution")]
    assert [c["label"] for c in groups[parts[1]][0]["companions"]] == ["lab"]  # no solution: none listed
    # a chapter past every range joins the last part rather than vanishing
    assert [e["doc"] for e in groups[parts[-1]]] == ["course/21_moe", "course/33_new"]
    assert [e["doc"] for e in groups[build.NOTES]] == ["course/timing_noise"]
    (api,) = groups[build.REFERENCE]
    assert api["doc"] == "api/index" and [c["doc"] for c in api["companions"]] == ["api/helpers", "api/helpers.launch"]
    assert structure["pages"]["solutions/21_moe_solution"] == {
        "group": parts[-1], "chapter": "course/21_moe", "role": "solution", "title": "21 · Experts"}
    assert build.reading_order(structure) == [
        "course/01_why", "labs/01_why_lab", "solutions/01_why_solution", "course/06_memory",
        "labs/06_memory_lab", "course/21_moe", "labs/21_moe_lab", "solutions/21_moe_solution",
        "course/33_new", "course/timing_noise", "api/index", "api/helpers", "api/helpers.launch"]


def test_every_chapter_of_the_course_has_a_part():
    for path in CHAPTERS:
        number = int(path.stem[:2])
        owners = [t for t, first, last in build.PARTS if first <= number <= last]
        assert len(owners) == 1, (path.name, owners)


def test_staging_links_a_chapter_with_its_lab_and_solution_and_back():
    structure = _book()
    chapter = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 01 · Why (course)\n\n**Question.** Why?")])
    build.link_companions(chapter, "course/01_why", structure)
    text = chapter.cells[0].source
    assert text.startswith("# 01 · Why (course)\n\n```{container} companions\n")
    assert "(../labs/01_why_lab.ipynb)" in text and "(../solutions/01_why_solution.ipynb)" in text
    assert text.endswith("**Question.** Why?")
    lab = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 06 · Memory (lab: fill in the exercises)")])
    build.link_companions(lab, "labs/06_memory_lab", structure)
    assert "[06 · Memory](../course/06_memory.ipynb)" in lab.cells[0].source
    assert "solution" not in lab.cells[0].source  # chapter 06 has none here
    solution = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 21 · Experts (solutions)")])
    build.link_companions(solution, "solutions/21_moe_solution", structure)
    assert "(../course/21_moe.ipynb)" in solution.cells[0].source
    assert "(../labs/21_moe_lab.ipynb)" in solution.cells[0].source



def test_a_chapter_links_the_module_that_defines_what_it_imports_from_a_package():
    """``from helpers.fsdp import FSDP`` links the package's page (its docstring says how
    it is cut) and the page of ``helpers.fsdp.wrap``, where FSDP is documented."""
    chapter = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from helpers.ddp import assign_buckets\n"
        "from helpers.fsdp import (FSDP,\n    hybrid_grid)\nimport helpers.model")])
    found = build.chapter_modules(chapter, set(build.helpers_modules()))
    assert found == ["helpers.ddp", "helpers.ddp.buckets", "helpers.fsdp", "helpers.fsdp.hybrid",
                     "helpers.fsdp.wrap", "helpers.model"]
    assert build.reexports("helpers.model") == {}  # a module, not a package

# Over 15 s by design: the whole site is built once (sphinx over every notebook and a page
# per helpers module, make site's own work), and every test of this file reads it.
@pytest.fixture(scope="session")
def site() -> pathlib.Path:
    pytest.importorskip("sphinx", reason="the site group is not installed: pip install -e '.[site]'")
    pytest.importorskip("myst_nb", reason="the site group is not installed: pip install -e '.[site]'")
    done = subprocess.run([sys.executable, "tools/site/build.py", "-j", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, f"make site failed:\n{done.stdout}\n{done.stderr}"
    assert "WARNING" not in done.stderr and "ERROR" not in done.stderr, done.stderr
    return SITE


class Page(html.parser.HTMLParser):
    """The links, image sources and element ids of one HTML page."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.links: list[str] = []
        self.images: list[str] = []
        self.ids: set[str] = set()
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        if tag == "a" and a.get("href") is not None:
            self.links.append(a["href"])
        if tag in ("img", "script") and a.get("src"):
            (self.images if tag == "img" else self.links).append(a["src"])
        if tag == "link" and a.get("href"):
            self.links.append(a["href"])


def _pages(site: pathlib.Path) -> list[pathlib.Path]:
    return sorted(site.rglob("*.html"))


def _internal(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    return not parts.scheme and not parts.netloc and not url.startswith("mailto:")


def test_the_site_has_every_notebook_and_a_page_per_helpers_module(site):
    for folder in ("course", "labs", "solutions"):
        for nb in (ROOT / folder).glob("*.ipynb"):
            assert (site / folder / f"{nb.stem}.html").is_file(), f"no page for {folder}/{nb.name}"
    modules = [p for p in (ROOT / "helpers").rglob("*.py")]
    api = list((site / "api").glob("helpers*.html"))
    assert len(api) == len(modules), f"{len(api)} API pages for {len(modules)} helpers modules"
    assert (site / "index.html").is_file() and (site / "search.html").is_file()
    assert "all_reduce" in (site / "searchindex.js").read_text()  # full-text search has the chapters


def test_no_internal_link_or_image_is_broken(site):
    broken = []
    cache: dict[pathlib.Path, Page] = {}

    def page_of(path: pathlib.Path) -> Page:
        """Each page parsed once (a chapter page is linked, with anchors, from dozens
        of pages: parsing it again for each link made this test quadratic)."""
        if path not in cache:
            cache[path] = Page(path)
        return cache[path]

    for path in _pages(site):
        page = page_of(path)
        for url in page.links + page.images:
            if not _internal(url):
                continue
            parts = urllib.parse.urlsplit(url)
            target = (path.parent / urllib.parse.unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{path.relative_to(site)}: {url}")
            elif parts.fragment and target.suffix == ".html":
                ids = page_of(target).ids
                if urllib.parse.unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: {url} (no such anchor)")
    assert not broken, "\n".join(broken[:40])


def test_no_page_shows_a_traceback_or_a_rendering_error(site):
    bad = []
    for path in _pages(site):
        text = path.read_text(encoding="utf-8")
        # reST/MyST errors left in a page: docutils' "problematic" and system messages
        for marker in ('class="problematic"', 'class="system-message"', "Unknown directive"):
            if marker in text:
                bad.append(f"{path.relative_to(site)}: {marker}")
        # an error output of a notebook (API pages may quote tracebacks in docstrings)
        if path.relative_to(site).parts[0] != "api":
            for marker in ("Traceback (most recent call last)", 'class="output traceback"'):
                if marker in text:
                    bad.append(f"{path.relative_to(site)}: {marker}")
    assert not bad, bad


def _pictures(nb: nbformat.NotebookNode) -> int:
    """Pictures among a notebook's outputs: one per output that carries an image
    (a widget's output carries its static picture, helpers.plots.show_widget)."""
    return sum(1 for c in nb.cells for o in c.get("outputs", [])
               if any(m in o.get("data", {}) for m in IMAGE_MIMES))


@pytest.mark.parametrize("nb_path", CHAPTERS, ids=lambda p: p.stem[:2])
def test_every_chapter_page_holds_its_figures(site, nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    page = Page(site / "course" / f"{nb_path.stem}.html")
    in_outputs = [src for src in page.images if "_images/" in src]
    assert len(in_outputs) == _pictures(nb)
    for src in in_outputs:
        assert (site / "course" / src).resolve().stat().st_size > 100, src


def _widget_outputs(nb_path: pathlib.Path) -> list[dict]:
    nb = nbformat.read(nb_path, as_version=4)
    return [o.get("data", {}) for c in nb.cells for o in c.get("outputs", [])
            if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]


def test_the_widget_cells_show_their_picture_and_no_live_widget_code(site):
    widget_chapters = [p for p in CHAPTERS if _widget_outputs(p)]
    assert widget_chapters, "no chapter has a widget: nothing to test"
    for p in widget_chapters:
        text = (site / "course" / f"{p.stem}.html").read_text(encoding="utf-8")
        # never the widget's repr, nor widget JavaScript from a CDN
        assert "jupyter-widgets" not in text and "interactive(children=" not in text, p.name
        # a widget stored without a picture (plain ipywidgets) says to run the notebook
        bare = sum(1 for d in _widget_outputs(p)
                   if not any(m.startswith("image/") or m == "text/html" for m in d))
        assert text.count('class="widget-note"') == bare, p.name


def test_the_solutions_answers_are_folded(site):
    for nb_path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        answers = sum(1 for c in nb.cells if c.cell_type == "code" and "# BEGIN SOLUTION" in c.source)
        text = (site / "solutions" / f"{nb_path.stem}.html").read_text(encoding="utf-8")
        assert answers > 0, nb_path.name
        assert text.count("tag_hide-input") == answers, nb_path.name
        assert text.count('<details class="admonition hide above-input">') == answers, nb_path.name


def test_each_chapter_links_the_helpers_it_teaches(site):
    page = Page(site / "course" / "03_all_reduce_ring.html")
    assert "../api/helpers.collectives.html" in page.links
    api = Page(site / "api" / "helpers.collectives.html")
    assert "../course/03_all_reduce_ring.html" in api.links  # and back
    text = (site / "api" / "helpers.collectives.html").read_text(encoding="utf-8")
    assert "ring_all_reduce" in text or "chunk_bounds" in text  # members documented


def test_math_is_marked_up_for_mathjax(site):
    """Without a browser: the chapter's $...$ became MathJax's markup and the page loads MathJax."""
    nb = nbformat.read(ROOT / "course" / "03_all_reduce_ring.ipynb", as_version=4)
    dollars = sum(c.source.count("$") for c in nb.cells if c.cell_type == "markdown")
    assert dollars >= 2, "chapter 03 has no math any more: pick another chapter"
    text = (site / "course" / "03_all_reduce_ring.html").read_text(encoding="utf-8")
    assert 'class="math notranslate nohighlight"' in text
    # MathJax is served from the site (offline), not from a CDN
    src = re.search(r'<script[^>]+src="([^"]*MathJax\.js[^"]*)"', text)
    assert src and not src.group(1).startswith(("http:", "https:", "//")), src
    assert (site / "_static" / "mathjax" / "MathJax.js").exists()


# -- in a real browser ------------------------------------------------------------

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# As root (CI, a container) Chromium needs --no-sandbox; the rest keep a browser with no
# network from trying to reach one (updates, sync, field trials).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update",
                 "--disable-default-apps", "--disable-sync", "--no-first-run", "--disable-field-trial-config"]


def _launch(p):
    return p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def _typeset(page) -> None:
    """Wait until MathJax (loaded only on pages with math) has typeset the page."""
    page.wait_for_load_state("load")
    page.wait_for_function(
        "() => !document.querySelector('script[src*=\"MathJax.js\"]') || (window.MathJax && MathJax.Hub)",
        timeout=30_000)
    page.evaluate("() => window.MathJax && MathJax.Hub ? new Promise(r => MathJax.Hub.Queue(() => r(1))) : 1")


# Every output of the page against the text column (div.body): its box inside the column,
# nothing in it scrolling sideways (printed lines wrap, pictures scale down), and every
# printed line set to wrap.
MEASURE = """() => {
  const column = document.querySelector('div.body');
  const c = column.getBoundingClientRect();
  const wide = [];
  const check = (el, what) => {
    const r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) return;
    if (r.left < c.left - 1 || r.right > c.right + 1)
      wide.push(`${what}: ${Math.round(r.width)} px wide, in a ${column.clientWidth} px column`);
    else if (el.scrollWidth > el.clientWidth + 1)
      wide.push(`${what}: scrolls sideways (${el.scrollWidth} px in ${el.clientWidth})`);
  };
  const outputs = [...document.querySelectorAll('div.cell_output')];
  outputs.forEach((out, i) => {
    check(out, `output ${i}`);
    out.querySelectorAll(':scope > *, pre, img, table').forEach(el =>
      check(el, `output ${i} ${el.tagName.toLowerCase()}.${[...el.classList].join('.')}`));
  });
  const unwrapped = [...document.querySelectorAll('div.cell_output pre')]
    .filter(pre => !['pre-wrap', 'break-spaces'].includes(getComputedStyle(pre).whiteSpace)).length;
  return {outputs: outputs.length, wide, unwrapped,
          sideways: document.documentElement.scrollWidth - document.documentElement.clientWidth};
}"""

PAGE_PARTS = """() => ({
  prev: [...document.querySelectorAll('nav.pager a.pager-prev')].map(a => [a.href, a.offsetParent !== null]),
  next: [...document.querySelectorAll('nav.pager a.pager-next')].map(a => [a.href, a.offsetParent !== null]),
  groups: [...document.querySelectorAll('nav.book-nav .book-group')].map(g => [
    g.querySelector('.caption-text').textContent.trim(),
    [...g.querySelectorAll('li.book-entry')].map(li => [
      li.querySelector(':scope > a').dataset.doc,
      [...li.querySelectorAll('ul.companions a')].map(a => a.dataset.doc)])]),
  navShown: document.querySelector('nav.book-nav').offsetParent !== null,
  markers: [...document.querySelectorAll('div.cell_input')].map(e => e.textContent)
    .filter(t => /NBVAL_|#\\s*noqa\\b/i.test(t)).map(t => t.slice(0, 80)),
})"""


def _browser_pages(site: pathlib.Path) -> list[str]:
    """Every chapter page, and the lab and solution of the first, middle and last chapter."""
    docs = [f"course/{p.stem}" for p in sorted((ROOT / "course").glob("*")) if p.suffix in (".ipynb", ".md")]
    for path in (CHAPTERS[0], CHAPTERS[len(CHAPTERS) // 2], CHAPTERS[-1]):
        docs += [f"labs/{path.stem}_lab", f"solutions/{path.stem}_solution"]
    return docs


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM, reason="no Chromium (apt-get install chromium, or set CHROMIUM)")
def test_the_index_and_a_chapter_in_a_browser(site):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        browser = _launch(p)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto((site / "index.html").as_uri())
        assert "start here" in page.title().lower() or "start here" in page.content().lower()
        # the course's mark (the favicon) shows; the first "next" is chapter 01
        assert page.evaluate("() => document.querySelector('a.book-brand img').naturalWidth") > 0
        assert page.locator("nav.pager-bottom a.pager-next").get_attribute("href") == "course/01_why_distributed.html"
        page.click("a[href='course/03_all_reduce_ring.html']")
        page.wait_for_load_state("load")
        assert page.url.endswith("course/03_all_reduce_ring.html")
        images = page.eval_on_selector_all(
            "img", "imgs => imgs.map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])")
        assert images and all(ok for _, ok in images), images
        # MathJax 2, served from the site: typeset math sits in .MathJax elements
        page.wait_for_selector(".MathJax, .MathJax_CHTML, .MathJax_SVG", timeout=30_000)
        assert page.locator(".MathJax, .MathJax_CHTML, .MathJax_SVG").count() >= 1
        assert page.evaluate("MathJax.version").startswith("2.")
        # the chapter's links to its lab and solution, and from the lab back to it
        page.click("div.companions a[href='../labs/03_all_reduce_ring_lab.html']")
        page.wait_for_load_state("load")
        assert page.url.endswith("labs/03_all_reduce_ring_lab.html")
        page.click("nav.pager-top a.pager-prev")
        page.wait_for_load_state("load")
        assert page.url.endswith("course/03_all_reduce_ring.html")
        browser.close()


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM, reason="no Chromium (apt-get install chromium, or set CHROMIUM)")
def test_every_chapter_reads_like_a_book_in_a_browser(site):
    """On every chapter page and a sample of labs and solutions, as a reader's 1280 px
    window shows them: no output wider than the text column, no printed line that does
    not wrap, the previous/next links to the right neighbours, the sidebar grouped by
    part with each chapter's lab and solution, and no test marker in a code cell."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    order = _reading_order()
    url = {doc: (site / f"{doc}.html").as_uri() for doc in order}
    problems, outputs = [], 0
    with sync_api.sync_playwright() as p:
        browser = _launch(p)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        for doc in _browser_pages(site):
            page.goto(url[doc])
            _typeset(page)
            m = page.evaluate(MEASURE)
            outputs += m["outputs"]
            problems += [f"{doc}: {w}" for w in m["wide"]]
            if m["unwrapped"]:
                problems.append(f"{doc}: {m['unwrapped']} printed outputs that do not wrap")
            if m["sideways"] > 0:
                problems.append(f"{doc}: the page scrolls sideways by {m['sideways']} px")
            parts = page.evaluate(PAGE_PARTS)
            i = order.index(doc)
            for kind, expected in (("prev", url[order[i - 1]]), ("next", url.get(order[i + 1]) if i + 1 < len(order) else None)):
                links = parts[kind]
                if [h for h, _ in links] != [expected] * 2 or not all(shown for _, shown in links):
                    problems.append(f"{doc}: {kind} links {links}, expected {expected} above and below the text")
            captions = [c for c, _ in parts["groups"]]
            if not parts["navShown"] or captions[-2:] != [build.NOTES, build.REFERENCE] or \
                    not set(captions[:-2]) <= {t for t, _, _ in build.PARTS}:
                problems.append(f"{doc}: sidebar not grouped by part: {captions}")
            entries = {e: c for _, group in parts["groups"][:-2] for e, c in group}
            for path in CHAPTERS:
                if entries.get(f"course/{path.stem}") != [f"labs/{path.stem}_lab", f"solutions/{path.stem}_solution"]:
                    problems.append(f"{doc}: sidebar entry of {path.stem}: {entries.get(f'course/{path.stem}')}")
            problems += [f"{doc}: a code cell shows a marker: {t!r}" for t in parts["markers"]]
        browser.close()
    assert outputs > 200, f"only {outputs} outputs measured: did the pages render?"
    assert not problems, "\n".join(problems[:40])


def _strip_png(width: int = 3000, height: int = 160) -> str:
    """A step-by-step picture as a notebook will store it: a strip of frames in one PNG."""
    import base64
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = 12
    fig, axes = plt.subplots(1, frames, figsize=(width / 100, height / 100), dpi=100)
    for step, ax in enumerate(axes):
        ax.bar(range(4), [(step + r) % 4 + 1 for r in range(4)])
        ax.set_title(f"step {step}")
        ax.set_xticks([])
        ax.set_yticks([])
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM, reason="no Chromium (apt-get install chromium, or set CHROMIUM)")
def test_long_outputs_fold_and_wide_pictures_scale_in_a_browser(site):
    """A long printed output shows its first lines and opens on a click; a picture far
    wider than the column (a strip of frames) scales to the column, keeps its aspect
    ratio, and opens at its own size on a click; on a phone, nothing is wider either."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    folded_pages = [f"course/{p.stem}" for p in CHAPTERS
                    if any(len(o.get("text", "").splitlines()) > 40 for c in nbformat.read(p, as_version=4).cells
                           for o in c.get("outputs", []) if o.get("output_type") == "stream")]
    with sync_api.sync_playwright() as p:
        browser = _launch(p)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        assert folded_pages, "no chapter prints a long output any more: nothing to fold"
        page.goto((site / f"{folded_pages[0]}.html").as_uri())
        _typeset(page)
        box = page.locator("div.cell_output .output.foldable").first  # .folded goes on a click
        assert box.evaluate("e => e.classList.contains('folded')")
        pre = box.locator("pre")
        shown, full = pre.evaluate("e => [e.clientHeight, e.scrollHeight]")
        line = pre.evaluate("e => parseFloat(getComputedStyle(e).lineHeight)")
        assert 8 * line < shown < full, (shown, full)  # the first lines show, not the rest
        button = page.locator("button.fold-toggle").first
        assert re.fullmatch(r"Show all \d+ lines", button.inner_text()), button.inner_text()
        button.click()
        shown, full = pre.evaluate("e => [e.clientHeight, e.scrollHeight]")
        assert shown >= full - 1 and button.get_attribute("aria-expanded") == "true"
        button.click()
        assert box.evaluate("e => e.classList.contains('folded')")

        # a strip of frames, put where a notebook's image output goes
        page.goto((site / "course" / "06_where_memory_goes.html").as_uri())
        _typeset(page)
        page.evaluate("""png => new Promise(done => {
          const out = document.createElement('div');
          out.className = 'cell_output docutils container';
          out.id = 'strip';
          const img = document.createElement('img');
          img.onload = () => done(1);
          img.src = 'data:image/png;base64,' + png;
          out.appendChild(img);
          document.querySelector('div.cell').after(out);
        })""", _strip_png())
        img = page.locator("#strip img")
        width, height, natural, column = img.evaluate(
            "i => [i.getBoundingClientRect().width, i.getBoundingClientRect().height, i.naturalWidth,"
            " document.querySelector('div.body').clientWidth]")
        assert natural == 3000 and width <= column + 0.5, (width, column)
        assert abs(height / width - 160 / 3000) < 0.01, (width, height)
        img.click()
        assert page.locator("div.zoom-view img").evaluate("i => i.getBoundingClientRect().width") >= 2999
        page.keyboard.press("Escape")
        assert page.locator("div.zoom-view").count() == 0

        phone = browser.new_page(viewport={"width": 390, "height": 844})
        for doc in ("course/17_checkpoint_resume", "course/20_design_training_stack"):
            phone.goto((site / f"{doc}.html").as_uri())
            _typeset(phone)
            m = phone.evaluate(MEASURE)
            assert not m["wide"] and m["sideways"] <= 0, (doc, m["wide"][:5], m["sideways"])
        browser.close()


# -- it reads like a book: structure of the built pages ------------------------------------

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Element:
    def __init__(self, tag: str, attrs: dict, parent: "Element | None"):
        self.tag, self.attrs, self.parent, self.children, self.parts = tag, attrs, parent, [], []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)

    def find_all(self, tag: str | None = None, cls: str | None = None) -> list["Element"]:
        found = []
        for child in self.children:
            if (tag is None or child.tag == tag) and (cls is None or cls in child.classes):
                found.append(child)
            found += child.find_all(tag, cls)
        return found

    def find(self, tag: str | None = None, cls: str | None = None) -> "Element | None":
        found = self.find_all(tag, cls)
        return found[0] if found else None


class Tree(html.parser.HTMLParser):
    """A page as a tree of elements, enough to query by tag and class."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.root = self.current = Element("#root", {}, None)
        self.feed(path.read_text(encoding="utf-8"))

    def handle_starttag(self, tag, attrs):
        element = Element(tag, dict(attrs), self.current)
        self.current.children.append(element)
        self.current.parts.append(element)
        if tag not in VOID:
            self.current = element

    def handle_endtag(self, tag):
        node = self.current
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.current = node.parent

    def handle_data(self, data):
        self.current.parts.append(data)


def _reading_order() -> list[str]:
    """The order the previous/next links must follow, from the repository's files alone:
    the index, each chapter followed by its lab and its solution, the course's notes,
    the helpers package and its modules."""
    order = ["index"]
    for path in CHAPTERS:
        order.append(f"course/{path.stem}")
        for folder, suffix in (("labs", "_lab"), ("solutions", "_solution")):
            if (ROOT / folder / f"{path.stem}{suffix}.ipynb").exists():
                order.append(f"{folder}/{path.stem}{suffix}")
    order += [f"course/{p.stem}" for p in sorted((ROOT / "course").glob("*.md"))]
    order += ["api/index"] + [f"api/{m}" for m in build.helpers_modules()]
    return order


def _doc_of(page: pathlib.Path, href: str, site: pathlib.Path) -> str:
    target = (page.parent / urllib.parse.urlsplit(href).path).resolve()
    return target.relative_to(site.resolve()).with_suffix("").as_posix()


def _pager(tree: Tree, where: str) -> dict[str, str]:
    nav = tree.root.find("nav", f"pager-{where}")
    if nav is None:
        return {}
    return {kind: a.attrs["href"] for kind in ("prev", "next")
            for a in nav.find_all("a", f"pager-{kind}")}


def test_every_page_links_its_previous_and_next_in_reading_order(site):
    order = _reading_order()
    wrong = []
    for i, doc in enumerate(order):
        path = site / f"{doc}.html"
        tree = Tree(path)
        for where in ("top", "bottom"):
            links = {k: _doc_of(path, v, site) for k, v in _pager(tree, where).items()}
            expected = {}
            if i > 0:
                expected["prev"] = order[i - 1]
            if i + 1 < len(order):
                expected["next"] = order[i + 1]
            if links != expected:
                wrong.append(f"{doc} ({where}): {links} != {expected}")
    assert not wrong, "\n".join(wrong[:20])


def _sidebar(tree: Tree) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """[(group caption, [(entry docname, [companion docnames])])] of a page's sidebar."""
    nav = tree.root.find("nav", "book-nav")
    groups = []
    for group in nav.find_all("div", "book-group"):
        entries = []
        for li in group.find_all("li", "book-entry"):
            link = next(c for c in li.children if c.tag == "a")
            companions = [a.attrs["data-doc"] for ul in li.find_all("ul", "companions")
                          for a in ul.find_all("a")]
            entries.append((link.attrs["data-doc"], companions))
        groups.append((group.find("span", "caption-text").text.strip(), entries))
    return groups


def test_the_sidebar_is_grouped_by_part_with_each_chapters_lab_and_solution(site):
    parts = [t for t, _, _ in build.PARTS]
    for doc in ("index", "course/03_all_reduce_ring", "labs/11_pipeline_basics_lab", "api/helpers.collectives"):
        groups = _sidebar(Tree(site / f"{doc}.html"))
        captions = [caption for caption, _ in groups]
        assert captions[-2:] == [build.NOTES, build.REFERENCE], (doc, captions)
        assert set(captions[:-2]) <= set(parts) and len(captions) >= 5, (doc, captions)
        chapters = {entry: (caption, companions) for caption, entries in groups[:-2]
                    for entry, companions in entries}
        assert sorted(chapters) == [f"course/{p.stem}" for p in CHAPTERS], doc  # each once
        for path in CHAPTERS:
            caption, companions = chapters[f"course/{path.stem}"]
            assert caption == build.part_of(path.stem)
            assert companions == [f"labs/{path.stem}_lab", f"solutions/{path.stem}_solution"], path.stem
        ((api, modules),) = groups[-1][1]
        assert api == "api/index" and modules == [f"api/{m}" for m in build.helpers_modules()]
    text = (site / "course" / "03_all_reduce_ring.html").read_text(encoding="utf-8")
    assert 'data-doc="course/03_all_reduce_ring" aria-current="page"' in text


def _notebook_pages(site: pathlib.Path) -> list[pathlib.Path]:
    return [site / folder / f"{p.stem}.html" for folder in ("course", "labs", "solutions")
            for p in sorted((ROOT / folder).glob("*.ipynb"))]


MARKER = re.compile(r"NBVAL_|#\s*noqa\b", re.I)


def test_no_code_cell_shows_a_test_marker(site):
    shown = []
    for path in _notebook_pages(site):
        for cell in Tree(path).root.find_all("div", "cell_input"):
            for line in cell.text.splitlines():
                if MARKER.search(line):
                    shown.append(f"{path.relative_to(site)}: {line.strip()}")
    assert not shown, "\n".join(shown[:20])


def test_each_cell_prints_into_one_box_per_stream(site):
    split = []
    for path in _notebook_pages(site):
        for output in Tree(path).root.find_all("div", "cell_output"):
            kinds = [("stderr" if "stderr" in c.classes else "stream") if c.classes & {"stream", "stderr"}
                     else None for c in output.children]
            for a, b in zip(kinds, kinds[1:]):
                if a and a == b:
                    split.append(f"{path.relative_to(site)}: two {a} boxes in a row")
    assert not split, "\n".join(split[:20])


def test_labs_and_solutions_link_their_chapter_and_each_chapter_both(site):
    for path in CHAPTERS:
        stem = path.stem
        pages = {"course": f"course/{stem}", "labs": f"labs/{stem}_lab", "solutions": f"solutions/{stem}_solution"}
        for folder, doc in pages.items():
            page = site / f"{doc}.html"
            box = Tree(page).root.find("div", "companions")
            assert box is not None, f"{doc}: no links to its chapter/lab/solution"
            linked = {_doc_of(page, a.attrs["href"], site) for a in box.find_all("a")}
            assert linked == set(pages.values()) - {doc}, (doc, linked)


def test_every_page_has_the_course_footer_and_favicon(site):
    for path in _pages(site):
        tree = Tree(path)
        icons = [link.attrs["href"] for link in tree.root.find_all("link") if link.attrs.get("rel") == "icon"]
        assert len(icons) == 1 and (path.parent / icons[0]).resolve().is_file(), path
        footer = tree.root.find("footer", "footer")
        assert footer is not None, path
        text = " ".join(footer.text.split())
        assert "Distributed LLM Training, hands-on" in text and "2026" in text, text
        assert not re.search(r"(\(c\)|©)\s*\.", text), text  # never "(c)." with nothing in it
    svg = (site / "_static" / "favicon.svg").read_text()
    assert svg.lstrip().startswith("<svg") and "</svg>" in svg


def test_no_page_says_to_run_a_cell_to_get_controls(site):
    """helpers.plots' line for a notebook not run yet is true in JupyterLab; on a page,
    where nothing runs, each widget's picture says what it is instead."""
    for path in _notebook_pages(site):
        text = path.read_text(encoding="utf-8")
        assert "Run the cell to get the controls" not in text, path
    for nb_path in CHAPTERS:
        shown = sum(1 for d in _widget_outputs(nb_path)
                    if any(m.startswith("image/") or m == "text/html" for m in d))
        text = (site / "course" / f"{nb_path.stem}.html").read_text(encoding="utf-8")
        assert text.count('class="widget-caption"') == shown, nb_path.name
