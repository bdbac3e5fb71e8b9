"""Sphinx configuration of the course's static site (``make site``; built by tools/site/build.py).

The pages are the committed notebooks, rendered by myst-nb from their stored
outputs (``nb_execution_mode = "off"``): nothing is re-executed, so the rank
output, timings and the stored GPU runs on the site are the ones the
repository holds. The API pages are Sphinx autodoc over the ``helpers``
docstrings.
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # autodoc imports helpers from the checkout

project = "Distributed LLM Training, hands-on"
author = "the course authors"
copyright = f"2026 {project} · {author}"  # the footer: "© 2026 Distributed LLM ... · the course authors"
root_doc = "index"
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.mathjax"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

nb_execution_mode = "off"  # render the committed outputs, never run a cell
# A widget's stored state is not shown: the static picture that
# helpers.plots.interact stores next to it (an image output) is.
nb_render_markdown_format = "myst"
myst_enable_extensions = ["dollarmath", "amsmath", "html_image", "colon_fence"]
myst_heading_anchors = 3
# [text](other.ipynb#section) links between notebooks: resolved by heading anchors above.
# A widget's output bundle holds the widget view, a text repr and the static
# picture (helpers.plots.show_widget). Drop the view (a live widget needs a
# kernel), so the picture is what the page shows.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]

# Each page documents what its module defines; a package's re-exports are
# documented once, on the page of the module that defines them.
autodoc_default_options = {"members": True, "undoc-members": True, "show-inheritance": True,
                           "ignore-module-all": True}
autodoc_inherit_docstrings = False  # torch.autograd.Function's docs belong to torch's site
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # signatures as written; forward refs need no resolution
add_module_names = False

# Every cross-reference must resolve (a class's bases included), except two kinds
# that have no page here by design: torch's classes (torch's own site documents
# them; linking it would need intersphinx, i.e. the network at build time) and
# the helpers' private base classes (a leading underscore: not an API).
nitpicky = True
nitpick_ignore_regex = [("py:class", r"torch\..*"), ("py:class", r"helpers\..*\._\w+")]

# MathJax from the site itself, not from a CDN, so that the pages show their math
# offline (a workshop room without internet, a saved copy, CI). The copy is the
# MathJax 2.7 that Jupyter serves to notebooks, packaged on PyPI as
# jupyter-server-mathjax (in the site group): no npm, no download at build time.
def _local_mathjax() -> str:
    import shutil

    import jupyter_server_mathjax
    src = pathlib.Path(jupyter_server_mathjax.__file__).parent / "static"
    dest = pathlib.Path(__file__).parent / "_static_mathjax" / "mathjax"
    if not (dest / "MathJax.js").exists():
        shutil.copytree(src, dest, dirs_exist_ok=True)
    return str(dest.parent)


html_static_path = [_local_mathjax()]
# myst would configure MathJax 3 and mark each page's section "tex2jax_ignore" (so that
# a 3.x reads only the math elements); MathJax 2 would then skip the whole page.
# MathJax 2's own defaults read \(..\) and \[..\], which is what myst writes, and
# never a bare $.
myst_update_mathjax = False
mathjax_path = "mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"  # the config it ships
# The package carries the STIX-Web fonts only (as Jupyter configures it): use them,
# and no image fonts.
# A formula wider than the column breaks at an operator (automatic line breaks) rather
# than running past it.
mathjax2_config = {"HTML-CSS": {"availableFonts": [], "preferredFont": None,
                                "webFont": "STIX-Web", "imageFont": None,
                                "linebreaks": {"automatic": True}},
                   "CommonHTML": {"linebreaks": {"automatic": True}},
                   "SVG": {"font": "STIX-Web", "linebreaks": {"automatic": True}}}

# The look: tools/site/theme/course_book, alabaster's templates with the course's own
# layout (previous/next links above and below the text, the footer), sidebar (the book's
# contents grouped by part, from _book.json that build.py writes) and stylesheet. No
# theme package beyond alabaster (Sphinx's own dependency), no web fonts, no CDN.
html_theme = "course_book"
html_theme_path = [str(ROOT / "tools" / "site" / "theme")]
html_title = project
html_favicon = str(ROOT / "tools" / "site" / "favicon.svg")
html_css_files = ["book.css"]  # after mystnb.css, whose rules it overrides
html_js_files = [("book.js", {"defer": "defer"})]
html_context = {"book": json.loads((pathlib.Path(__file__).parent / "_book.json").read_text())}
html_show_sourcelink = False
html_copy_source = False


def _verbatim(app, what, name, obj, options, lines):
    """Show a docstring as written, in a literal block.

    The helpers' docstrings are written to be read in an editor or with
    help(): ``code`` and bullet lists, but also aligned tables, |x| and
    indented formulas that are not reStructuredText. Parsed as reST they
    would render wrongly (and warn); verbatim they read as their author
    laid them out."""
    if any(line.strip() for line in lines):
        lines[:] = ["::", ""] + ["   " + line for line in lines] + [""]


def setup(app):
    app.connect("autodoc-process-docstring", _verbatim)
