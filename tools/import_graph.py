"""The helpers package as a house: modules as rooms, imports as arrows.

    python tools/import_graph.py            # floors, arrows, circles, private imports
    python tools/import_graph.py --dot      # the same graph for Graphviz (dot -Tsvg)

A module's floor is one more than the highest floor it imports from, so
arrows point down; an arrow that cannot (a circle) is listed. Imports inside
functions count too: a lazy import is still a dependency a reader must know.
A *private* import is ``from helpers.x import _name`` from another module, or
a reach through an imported module (``x._name`` after ``from helpers import x``):
the other module's inside, which it may change without notice. The line count
of each module is printed beside it (the house's rooms are read in one sitting:
``MAX_LINES``).
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "helpers"
MAX_LINES = 500  # a module a learner reads beside its chapter, in one sitting


def module_name(path: pathlib.Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = here.split(".") if is_package else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _outside(importer: str, module: str) -> bool:
    """``module`` is another module than ``importer`` and not a package holding it."""
    return module != importer and not importer.startswith(module + ".")


def _reaches(tree: ast.AST, bound: dict[str, str], mods: dict[str, pathlib.Path]):
    """(module, name) of every ``alias.sub._name`` whose ``alias`` is bound to a
    module of helpers and whose ``_name`` is private (not a dunder)."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in bound:
            module = ".".join([bound[value.id]] + chain[::-1])
            if module in mods:
                yield module, node.attr


def imports(mods: dict[str, pathlib.Path]) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """Arrows (module -> modules of helpers it imports) and private imports
    (importer, imported module, name): ``from helpers.x import _name``, or
    ``x._name`` through a module bound by an import."""
    arrows: dict[str, set[str]] = {m: set() for m in mods}
    private: list[tuple[str, str, str]] = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}  # a local name -> the module of helpers it is
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
                for a in node.names:
                    if a.asname:
                        bound[a.asname] = a.name
                    elif a.name.split(".")[0] == "helpers":
                        bound["helpers"] = "helpers"
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, path.name == "__init__.py")
                if base is None:
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in mods:
                        targets.append(full)
                        bound[alias.asname or alias.name] = full
                    else:
                        targets.append(base)
                        if alias.name.startswith("_") and base in mods and _outside(name, base):
                            private.append((name, base, alias.name))
            for target in targets:
                # a package's own __init__ importing its submodules is the package's front door
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != name and not name.startswith(target + "."):
                    arrows[name].add(target)
        private += [(name, module, attr) for module, attr in _reaches(tree, bound, mods)
                    if _outside(name, module)]
    return arrows, private


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    found, done, stack = [], set(), []

    def visit(m: str) -> None:
        if m in stack:
            found.append(stack[stack.index(m):] + [m])
            return
        if m in done:
            return
        stack.append(m)
        for n in sorted(arrows[m]):
            visit(n)
        stack.pop()
        done.add(m)

    for m in sorted(arrows):
        visit(m)
    return found


def rooms(arrows: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph one level up: each top-level module or package of helpers
    is a room (``helpers.zero.base`` is in the room ``helpers.zero``)."""
    def room(m: str) -> str:
        return ".".join(m.split(".")[:2])

    out: dict[str, set[str]] = {}
    for a, targets in arrows.items():
        out.setdefault(room(a), set()).update(room(t) for t in targets if room(t) != room(a))
    return out


def floors(arrows: dict[str, set[str]]) -> dict[str, int]:
    """Floor 0: imports nothing of helpers. Modules on a circle share the
    floor of their first visit (the circle is reported separately)."""
    floor: dict[str, int] = {}

    def height(m: str, seen: frozenset) -> int:
        if m in floor:
            return floor[m]
        below = [height(n, seen | {m}) for n in arrows[m] if n not in seen | {m}]
        floor[m] = 1 + max(below) if below else 0
        return floor[m]

    for m in sorted(arrows):
        height(m, frozenset())
    return floor


def line_counts(mods: dict[str, pathlib.Path]) -> dict[str, int]:
    return {m: sum(1 for _ in p.open()) for m, p in mods.items()}


def report() -> str:
    mods = modules()
    arrows, private = imports(mods)
    floor = floors(arrows)
    lines_of = line_counts(mods)
    out = [f"helpers: {len(mods)} modules, {sum(lines_of.values())} lines, "
           f"{sum(len(a) for a in arrows.values())} arrows, {max(floor.values()) + 1} floors"]
    for level in sorted(set(floor.values()), reverse=True):
        out.append(f"floor {level}:")
        for m in sorted(k for k, v in floor.items() if v == level):
            short = sorted(a.removeprefix("helpers.") for a in arrows[m])
            out.append(f"  {m.removeprefix('helpers.')} ({lines_of[m]})"
                       + (f" -> {', '.join(short)}" if short else ""))
    loops = circles(arrows) + circles(rooms(arrows))
    out.append(f"circles (modules, then packages as rooms): {len(loops)}")
    out += ["  " + " -> ".join(c) for c in loops]
    out.append(f"private imports across modules: {len(private)}")
    out += [f"  {a} imports {name} from {b}" for a, b, name in private]
    long = sorted((m for m, n in lines_of.items() if n > MAX_LINES), key=lines_of.get)
    out.append(f"modules over {MAX_LINES} lines: {len(long)}")
    out += [f"  {m} ({lines_of[m]})" for m in long]
    return "\n".join(out)


def dot() -> str:
    arrows, _ = imports(modules())
    body = "".join(f'  "{a}" -> "{b}";\n' for a in sorted(arrows) for b in sorted(arrows[a]))
    return "digraph helpers {\n  rankdir=TB; node [shape=box];\n" + body + "}\n"


if __name__ == "__main__":
    print(dot() if "--dot" in sys.argv else report())
