"""The helpers package stays readable as a house: no circles, no back doors.

A circle (a imports b, b imports a, possibly through others) means neither
module can be read without the other; a private import (``from helpers.x
import _name``) reaches into another module's inside, which that module may
change without notice. tools/import_graph.py draws the whole graph.
"""

from tools import import_graph


def test_the_import_graph_has_no_circle():
    arrows, _ = import_graph.imports(import_graph.modules())
    assert import_graph.circles(arrows) == []


def test_no_circle_between_packages_either():
    """One level up (helpers.costs, helpers.frameworks, ... as rooms): a package
    must not need another that needs it back, even through different modules."""
    arrows, _ = import_graph.imports(import_graph.modules())
    assert import_graph.circles(import_graph.rooms(arrows)) == []


def test_the_launcher_imports_nothing_from_the_debugger():
    """helpers.debug plugs into helpers.launch through its hooks, not the other way."""
    arrows, _ = import_graph.imports(import_graph.modules())
    launcher = {m: a for m, a in arrows.items() if m.startswith("helpers.launch")}
    assert launcher and not [(m, t) for m, a in launcher.items() for t in a
                             if not t.startswith("helpers.launch")]


def test_a_circle_and_a_private_import_are_seen(tmp_path, monkeypatch):
    """The checks above can fail: a planted circle and back door are found."""
    pkg = tmp_path / "helpers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from helpers.b import _inside\n")
    (pkg / "b.py").write_text("def f():\n    import helpers.a\n_inside = 1\n")
    monkeypatch.setattr(import_graph, "ROOT", tmp_path)
    monkeypatch.setattr(import_graph, "PACKAGE", pkg)
    arrows, private = import_graph.imports(import_graph.modules())
    assert import_graph.circles(arrows)[0] in (["helpers.a", "helpers.b", "helpers.a"],
                                               ["helpers.b", "helpers.a", "helpers.b"])
    assert private == [("helpers.a", "helpers.b", "_inside")]
