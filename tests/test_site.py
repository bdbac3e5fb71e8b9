"""make site (tools/site/build.py): the course as a static site, from the committed outputs.

The site is built once per session, by the same script as `make site`
(``sphinx-build -W`` with ``nitpicky``: any warning, a cross-reference that
resolves nowhere included, fails the build; tools/site/conf.py lists the two
kinds of target exempted and why). Then every page is read back: each internal link
and image points at a file (and an anchor) that exists, no page shows a
traceback or a reST error, every chapter page holds as many pictures as its
notebook's outputs, the solutions' answers are folded, each chapter links the
helpers modules it imports. The browser test opens the index and a chapter in
headless Chromium (see tests/test_browser.py for what it needs).

Needs the site group (``pip install -e '.[site]'``; `make site` and CI install
it); without it the module is skipped.
"""

from __future__ import annotations

import html.parser
import os
import pathlib
import re
import shutil
import subprocess
import sys
import urllib.parse

import nbformat
import pytest

pytest.importorskip("sphinx", reason="the site group is not installed: pip install -e '.[site]'")
pytest.importorskip("myst_nb", reason="the site group is not installed: pip install -e '.[site]'")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SITE = ROOT / "_build" / "site"
CHAPTERS = sorted((ROOT / "course").glob("*.ipynb"))
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="session")
def site() -> pathlib.Path:
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
    for path in _pages(site):
        page = cache.setdefault(path, Page(path))
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
                ids = cache.setdefault(target, Page(target)).ids
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


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM, reason="no Chromium (apt-get install chromium, or set CHROMIUM)")
def test_the_index_and_a_chapter_in_a_browser(site):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page()
        page.goto((site / "index.html").as_uri())
        assert "start here" in page.title().lower() or "start here" in page.content().lower()
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
        browser.close()
