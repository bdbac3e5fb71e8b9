"""helpers/ uses only collectives that every supported torch's gloo has.

The list form ``dist.all_to_all(output_list, input_list)`` is refused by torch
2.11's gloo ("Backend gloo does not support alltoall"): on a CPU-only machine,
or a node with fewer GPUs than ranks, the sequence-parallel code and chapter
10's Ulysses would stop there. ``dist.all_to_all_single`` exists in gloo on
every version we support, so helpers/ must use it (helpers/sp/attention/ulysses.py's
``_exchange`` shows the one-line translation: stack the chunks, exchange dim 0, with
helpers/collectives/alltoall.py's ``all_to_all``).

Checked statically (an AST scan) because the torch that runs the tests may
well be one whose gloo still accepts the list form.
"""

import ast
from pathlib import Path

import helpers

HELPERS = Path(helpers.__file__).parent


def _list_form_calls(tree: ast.AST) -> list[int]:
    """Line numbers of ``<anything>.all_to_all(...)`` calls, and of bare
    ``all_to_all(...)`` calls where the module imports that name from torch."""
    from_torch = any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torch")
                     and any(a.name == "all_to_all" for a in n.names)
                     for n in ast.walk(tree))
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "all_to_all":
            lines.append(node.lineno)          # dist.all_to_all, torch.distributed.nn...all_to_all
        elif isinstance(f, ast.Name) and f.id == "all_to_all" and from_torch:
            lines.append(node.lineno)          # (helpers.moe's own all_to_all is not torch's)
    return lines


def test_the_scan_finds_the_list_form_and_not_the_single_form():
    code = ("import torch.distributed as dist\n"
            "dist.all_to_all(out, inp)\n"
            "dist.all_to_all_single(o, i)\n"
            "from torch.distributed import all_to_all\n"
            "all_to_all(out, inp)\n")
    assert _list_form_calls(ast.parse(code)) == [2, 5]
    assert _list_form_calls(ast.parse("def all_to_all(x): pass\nall_to_all(1)\n")) == []


def test_no_helpers_module_calls_the_list_form_all_to_all():
    found = [f"{path.relative_to(HELPERS.parent)}:{line}"
             for path in sorted(HELPERS.rglob("*.py"))
             for line in _list_form_calls(ast.parse(path.read_text(), str(path)))]
    assert not found, ("list-form dist.all_to_all, which torch 2.11's gloo refuses; "
                       f"use dist.all_to_all_single instead: {found}")
