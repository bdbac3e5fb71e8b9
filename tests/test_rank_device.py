"""Every rank function builds its model, data and tensors on its rank's device.

On a GPU node ``launch(..., backend="auto")`` gives each rank one GPU and an
nccl group ("cpu:gloo,cuda:nccl"); ``rank_info().device`` is then
"cuda:<local_rank>". A rank function that builds its tensors on the CPU still
runs there, but every collective goes over the gloo half: the node runs the
CPU course. So:

* static: in every course/ and solutions/ notebook, inside a *rank function*,
  every torch tensor factory (``torch.randn``, ``zeros``, ``arange``, ...)
  passes ``device=`` or is moved at once (``torch.randint(..., generator=g)
  .to(dev)``: generated on the CPU so the values are the CPU course's, then
  moved), and ``build_model`` is not pinned to ``device="cpu"`` (its default
  is the rank's device). ``*_like`` factories inherit their argument's device
  and are not checked.

  A *rank function* is a function defined in a notebook cell that runs on
  ranks: one passed to ``launch(...)`` (by name, or a lambda), one passed to
  a lab check (``check_*(fn)``: checks run the learner's function on ranks or
  on tensors a rank made), and, transitively, every notebook function that one
  of those calls by name. Functions that only run in the kernel (plots,
  single-process references, cost formulas) are not rank functions: their
  tensors are the notebook's, and ``launch`` hands results back on the CPU.
* runtime: ``build_model()`` and ``MarkovDataset.batch()`` inside ``launch``
  put their tensors on ``rank_info().device``; with a RankInfo whose device is
  "meta" the defaults follow it (no GPU needed to see the rule).
"""

import ast
import pathlib

import pytest
import torch

import importlib
from helpers import launch, rank_info
from helpers.data import make_dataset
from helpers.model import build_model
from notebook_ast import called_name, code_cells

info_mod = importlib.import_module("helpers.launch.info")  # helpers.launch is also a function

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "course").glob("*.ipynb")) + sorted(
    (ROOT / "solutions").glob("*.ipynb"))

FACTORIES = {"randn", "rand", "randint", "randperm", "zeros", "ones", "empty", "full",
             "tensor", "as_tensor", "arange", "linspace", "logspace", "eye", "normal"}



def _names_passed(call: ast.Call) -> list[ast.expr]:
    return list(call.args) + [k.value for k in call.keywords]


def rank_functions(cells: list[tuple[int, ast.Module]]) -> dict[str, list]:
    """{name: [(cell, FunctionDef)]} of the notebook's rank functions, plus
    "<lambda>" for lambdas passed to launch."""
    defs: dict[str, list] = {}
    roots: set[str] = set()
    lambdas: list = []
    for i, tree in cells:
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(node.name, []).append((i, node))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = called_name(node)
            if name == "launch" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Name):
                    roots.add(first.id)
                elif isinstance(first, ast.Lambda):
                    lambdas.append((i, first))
            elif name and name.startswith("check_"):
                roots.update(a.id for a in _names_passed(node) if isinstance(a, ast.Name))
    found, todo = set(), [r for r in roots if r in defs]
    while todo:  # notebook functions that a rank function calls run on ranks too
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for _, fn in defs[name]:
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                        and node.func.id in defs:
                    todo.append(node.func.id)
                for a in _names_passed(node) if isinstance(node, ast.Call) else []:
                    if isinstance(a, ast.Name) and a.id in defs:  # e.g. launch(fn) inside
                        todo.append(a.id)
    out = {name: defs[name] for name in sorted(found)}
    if lambdas:
        out["<lambda>"] = lambdas
    return out


def _names_a_device(to_call: ast.Call) -> bool:
    """Does ``.to(...)`` move to a device? ``.to(dev)``, ``.to(x.device, dtype)``,
    ``.to(device=...)`` do; ``.to(torch.float32)`` and ``.to(dtype)`` do not."""
    if any(k.arg == "device" for k in to_call.keywords):
        return True
    if not to_call.args:
        return False
    first = to_call.args[0]
    is_dtype = (isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name)
                and first.value.id == "torch") or (
        isinstance(first, ast.Name) and "dtype" in first.id)
    return not is_dtype


def offences(fn: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each tensor built off the rank's device inside ``fn``."""
    moved = set()  # factory calls whose result is moved to a device at once
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "to" and isinstance(node.func.value, ast.Call) \
                and _names_a_device(node):
            moved.add(id(node.func.value))
    bad = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        f = node.func
        is_torch = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
            and f.value.id == "torch"
        if is_torch and f.attr in FACTORIES and "device" not in keywords \
                and id(node) not in moved:
            bad.append((node.lineno, f"{ast.unparse(node)[:70]} has no device="))
        elif called_name(node) == "build_model" and isinstance(keywords.get("device"),
                                                                 ast.Constant):
            bad.append((node.lineno, f"{ast.unparse(node)[:70]} pins the device "
                                     f"(leave it out: the default is the rank's device)"))
    return bad


def notebook_offences(path: pathlib.Path) -> list[str]:
    cells = code_cells(path)
    out = []
    for name, places in rank_functions(cells).items():
        for cell, fn in places:
            for line, what in offences(fn):
                out.append(f"{path.relative_to(ROOT)} cell {cell} line {line} ({name}): {what}")
    return sorted(set(out))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_rank_functions_build_on_the_ranks_device(path):
    found = notebook_offences(path)
    assert not found, "tensors built off the rank's device:\n" + "\n".join(found)


def test_the_scan_sees_what_it_claims(tmp_path):
    """The scanner flags a factory without device= (or moved only to a dtype) in a
    launched function and in what it calls, and a build_model pinned to a
    device; passes device=, .to(dev), *_like and kernel-only functions."""
    import nbformat

    from tools.nbtool import write

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (
        "%matplotlib inline\nimport torch\nfrom helpers import launch, rank_info",
        "def make(n):\n    return torch.zeros(n)\n\n"
        "def fn():\n    dev = rank_info().device\n    a = torch.randn(3, device=dev)\n"
        "    b = torch.randint(0, 4, (2,), generator=None).to(dev)\n"
        "    d = torch.rand(2).to(torch.float64)\n"
        "    c = torch.zeros_like(a)\n    m = build_model('toy', device='cpu')\n"
        "    return make(2) + a + b + c",
        "def plot_only():\n    return torch.ones(3)",
        "out = launch(fn, 2)\nlaunch(lambda: torch.arange(3), 2)",
    )]
    path = tmp_path / "nb.ipynb"
    write(nb, path)
    cells = code_cells(path)
    assert set(rank_functions(cells)) == {"fn", "make", "<lambda>"}
    lines = {(name, line) for name, places in rank_functions(cells).items()
             for _, f in places for line, _ in offences(f)}
    assert lines == {("make", 2), ("fn", 8), ("fn", 10), ("<lambda>", 2)}


# runtime: the default follows the rank's device

def _devices():
    m = build_model("toy")
    x, y = make_dataset(seq_len=8, num_sequences=8).batch(range(2))
    return str(next(m.parameters()).device), str(x.device), str(y.device), rank_info().device


def test_build_model_and_batch_land_on_the_ranks_device():
    results = launch(_devices, 2, backend="gloo")
    assert len(results) == 2
    for *built, rank_dev in results:
        assert {torch.device(d) for d in built} == {torch.device(rank_dev)}


def test_defaults_follow_rank_info(monkeypatch):
    """A rank whose device is "meta" gets its model and batch there: the
    default is read from rank_info(), not fixed to the CPU."""
    data = make_dataset(seq_len=8, num_sequences=8)
    cpu_x, _ = data.batch([3, 1])
    monkeypatch.setattr(info_mod, "_RANK_INFO", info_mod.RankInfo(0, 1, 0, "none", "meta"))
    assert {p.device.type for p in build_model("toy").parameters()} == {"meta"}
    assert {t.device.type for t in data.batch([3, 1])} == {"meta"}
    # an explicit device still wins
    assert {p.device.type for p in build_model("toy", device="cpu").parameters()} == {"cpu"}
    assert torch.equal(data.batch([3, 1], device="cpu")[0], cpu_x)
    monkeypatch.setattr(info_mod, "_RANK_INFO", None)  # outside a launch: the CPU
    assert {p.device.type for p in build_model("toy").parameters()} == {"cpu"}
    assert torch.equal(data.batch([3, 1])[0], cpu_x)
