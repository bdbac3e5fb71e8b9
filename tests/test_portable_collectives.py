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

Two more scans keep helpers/ portable from gloo on CPU to nccl on GPUs, where
the tests cannot run: no lone ``isend``/``irecv`` (nccl's deadlock pattern,
see ``test_no_helpers_module_posts_a_lone_isend_or_irecv``), and no exact
comparison of ``dist.get_backend()`` with a backend name (the course's GPU
groups are "cpu:gloo,cuda:nccl").
"""

import ast
from pathlib import Path

import helpers

HELPERS = Path(helpers.__file__).parent


def _scan_helpers(finder) -> list[str]:
    """``helpers/x.py:LINE`` for every line ``finder`` (tree -> line numbers) flags."""
    return [f"{path.relative_to(HELPERS.parent)}:{line}"
            for path in sorted(HELPERS.rglob("*.py"))
            for line in finder(ast.parse(path.read_text(), str(path)))]


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
    found = _scan_helpers(_list_form_calls)
    assert not found, ("list-form dist.all_to_all, which torch 2.11's gloo refuses; "
                       f"use dist.all_to_all_single instead: {found}")


def _lone_p2p_calls(tree: ast.AST) -> list[int]:
    """Line numbers of calls to ``isend``/``irecv`` themselves (``dist.isend(...)``,
    or a bare ``isend(...)`` imported from torch). Naming them inside a
    ``P2POp(dist.isend, ...)`` for ``batch_isend_irecv`` is not a call: not found."""
    from_torch = {a.asname or a.name for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torch")
                  for a in n.names if a.name in ("isend", "irecv")}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("isend", "irecv"):
            lines.append(node.lineno)
        elif isinstance(f, ast.Name) and f.id in from_torch:
            lines.append(node.lineno)
    return sorted(lines)


def test_the_scan_finds_a_lone_isend_and_irecv_and_not_a_batch():
    code = ("import torch.distributed as dist\n"
            "reqs = [dist.isend(x, 1), dist.irecv(y, 0)]\n"
            "dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, y, 0)])\n"
            "from torch.distributed import irecv as rx\n"
            "rx(y, 0)\n")
    assert _lone_p2p_calls(ast.parse(code)) == [2, 2, 5]
    assert _lone_p2p_calls(ast.parse("def isend(x): pass\nisend(1)\n")) == []


def test_no_helpers_module_posts_a_lone_isend_or_irecv():
    """Every point-to-point message in helpers/ goes through ``dist.batch_isend_irecv``
    (``helpers.collectives.post_pair`` for a ring's send-and-receive,
    ``helpers.pipeline.p2p.post`` for a pipeline's), never a lone ``isend`` / ``irecv``.

    Why: it is nccl's known deadlock pattern. Each lone call is its own nccl
    operation, queued on a stream in program order; a large send does not
    complete until the peer's matching receive runs. If every rank of a ring
    posts its ``isend`` before its ``irecv``, every send waits for a receive
    queued behind the peer's own send, and the job hangs without an error.
    One batch is one nccl group, in which sends and receives progress
    together. Gloo buffers and runs either form, so the CPU tests cannot see
    the hang: hence a static check (ring attention's ``ring_shift`` had it).
    """
    found = _scan_helpers(_lone_p2p_calls)
    assert not found, ("a lone isend/irecv, which can deadlock under nccl; post the pair "
                       f"with helpers.collectives.post_pair or helpers.pipeline.p2p.post: {found}")


def _exact_backend_comparisons(tree: ast.AST) -> list[int]:
    """Line numbers where a ``get_backend(...)`` call is compared with ==, !=, is,
    is not, or membership in a literal tuple/list/set of names. ``"nccl" in
    dist.get_backend()`` (a substring test) is the portable form: not found."""
    def is_get_backend(node):
        return (isinstance(node, ast.Call) and
                (isinstance(node.func, ast.Attribute) and node.func.attr == "get_backend"
                 or isinstance(node.func, ast.Name) and node.func.id == "get_backend"))

    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, a, b in zip(node.ops, operands, operands[1:]):
            exact = isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot))
            member = (isinstance(op, (ast.In, ast.NotIn)) and is_get_backend(a)
                      and isinstance(b, (ast.Tuple, ast.List, ast.Set)))
            if (exact and (is_get_backend(a) or is_get_backend(b))) or member:
                lines.append(node.lineno)
    return lines


def test_the_scan_finds_an_exact_backend_comparison_and_not_a_substring_test():
    code = ("import torch.distributed as dist\n"
            "a = dist.get_backend() == 'nccl'\n"
            "b = 'gloo' != dist.get_backend(group)\n"
            "c = dist.get_backend() in ('nccl', 'gloo')\n"
            "d = 'nccl' in dist.get_backend()\n")
    assert _exact_backend_comparisons(ast.parse(code)) == [2, 3, 4]


def test_no_helpers_module_compares_the_backend_name_exactly():
    """An nccl job here runs on "cpu:gloo,cuda:nccl" (helpers.launch.arguments'
    ``group_backend``), and that is what ``dist.get_backend()`` returns:
    ``== "nccl"`` is False on every GPU node, and the code picks the CPU for
    tensors that nccl must move (helpers/topology/hierarchical.py and
    helpers/collectives/measure.py had it). Ask ``"nccl" in dist.get_backend()``,
    or look at the tensor (``t.is_cuda``)."""
    found = _scan_helpers(_exact_backend_comparisons)
    assert not found, ('dist.get_backend() compared with a name; under "cpu:gloo,cuda:nccl" '
                       f'use "nccl" in dist.get_backend(): {found}')
