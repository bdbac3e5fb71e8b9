"""One harness for the lab checks' tests: every ``tests/test_checks_chNN.py`` is a table.

A chapter's test file declares its checks, then the wrong answers a learner could
plausibly write, each next to the mistake it stands for and the words the check's
message must contain::

    class TestChapter01(ChapterChecks):
        lab = "labs/01_why_distributed_lab.ipynb"
        sol = "solutions/01_why_distributed_solution.ipynb"
        checks = {"gpus_needed": Check(ch01.check_gpus_needed)}
        wrong = [
            Wrong("gpus_needed", lambda n, b, g: int(n * b / (g * 1e9)),
                  "rounds the GPU count down", says="round up"),
        ]

and gets one test per row (ids like ``test_wrong_answer_fails[gpus_needed: rounds ...]``):

* ``test_passes``: each check passes on the solution notebook's code, and on each
  ``Right`` answer (another correct way to write it), printing its one ✓ line;
* ``test_wrong_answer_fails``: each ``Wrong`` answer makes its check raise CheckFailed
  whose message contains ``says`` (a regular expression, searched as by
  ``pytest.raises(match=...)``; ``None``: any CheckFailed) -- not another exception;
* ``test_passes_spelled``: a check that counts or refuses communication
  (``Check(..., wire=True)``) passes on the solution's code spelled as learners also
  write it: every ``dist.x`` as a name imported before (``from torch.distributed import
  x as td_x``, which the checks' spy must see as well: ``helpers.launch.wire``) and as
  ``torch.distributed.x``, with NCCL's rules on and off;
* ``test_stub_fails``: each check fails on the lab notebook's untouched stub, saying
  it is "not implemented yet". A check taking several exercises (``check_f_g(f, g)``)
  is tried with all of them stubbed and with each one stubbed alone, the others
  from the solution.

Tests that don't fit the table stay ordinary test functions in the chapter's file.

Wrong answers are module-level functions (or lambdas, or classes) of the test file,
passed to the check as they are: checks that run the learner's code on ranks ship it
there with cloudpickle, by value (``tests/conftest.py`` registers every module of
``tests/`` with ``cloudpickle.register_pickle_by_value``, so a rank never imports the
test module, and with it pytest). Nothing of this module is shipped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from helpers.checks import CheckFailed
from tools.nbtool import exercise

STUB_SAYS = "not implemented yet"


class Check:
    """One check and what it is called with.

    ``Check(ch08.check_f_g, "CopyToTP", "ReduceFromTP")``: a string argument names an
    object the notebooks define (loaded from the solution, or the lab for the stub
    test); anything else is passed as it is (``Check(ch18.check_fixed, 1, "fixed_x")``).
    No arguments: the one exercise named like the check's key in ``checks``.

    slow: the check starts ranks (marks its solution and wrong-answer tests ``slow``;
        a stub is expected to fail before any rank starts, so its test is not marked).
    stubs: the names whose lab stub must make the check fail (default: all of them);
        e.g. only "attach" for ``check_attach(gather, free, attach)``, whose gather and
        free have their own check.
    notebook: False for a check no notebook calls (no solution or stub to load): only
        its ``Right`` and ``Wrong`` answers are tested, passed as its one argument.
    wire: the check counts or refuses communication: its solution is also run respelled
        (``test_passes_spelled``); "p2p" for a check of point-to-point code.
    """

    def __init__(self, fn: Callable, *args: Any, slow: bool = False,
                 stubs: tuple[str, ...] | None = None, notebook: bool = True,
                 wire: bool | str = False) -> None:
        self.fn, self.args, self.slow, self.notebook = fn, args, slow, notebook
        self._stubs = stubs
        self.wire = wire

    @property
    def names(self) -> list[str]:
        return [a for a in self.args if isinstance(a, str)]

    @property
    def stubs(self) -> list[str]:
        return list(self._stubs) if self._stubs is not None else self.names


@dataclass(frozen=True)
class Wrong:
    """A plausible wrong answer: the check named ``check`` must fail on it, saying ``says``.

    answer: the wrong code. For a check of several exercises, ``{name: code}``: those
        replaced, the others from the solution.
    mistake: the learner's mistake it stands for, in a few words (the test's id).
    says: a regular expression the CheckFailed message must contain; None: any message.
    kwargs: extra keyword arguments for the check (``{"timeout": 3}``).
    """

    check: str
    answer: Any
    mistake: str
    says: str | None
    kwargs: dict = field(default_factory=dict)
    rules: bool | None = None  # NCCL's rules for this row's launches; None: as the run says


@dataclass(frozen=True)
class Right:
    """Another correct answer (``answer`` as in ``Wrong``): the check must pass on it.
    ``rules=False`` for an answer right on gloo only (a lone isend/irecv ring), which
    under NCCL's rules is a ``Wrong`` row of its own."""

    check: str
    answer: Any
    why: str
    kwargs: dict = field(default_factory=dict)
    rules: bool | None = None


def _id(*parts: str) -> str:
    return ": ".join(parts)


def _rules(monkeypatch: pytest.MonkeyPatch, rules: bool | None) -> None:
    """A row that says so runs its launches with (or without) NCCL's rules, whatever the
    environment of the run (``make test`` turns them on: helpers.launch.nccl_rules)."""
    from helpers.launch import nccl_rules

    if rules is not None:
        monkeypatch.setenv(nccl_rules.ENV, "1" if rules else "0")


class ChapterChecks:
    """Base of a chapter's table (see the module's docstring). Subclass it as
    ``TestChapterNN`` and set ``lab``, ``sol``, ``checks``, ``wrong`` (and ``right``,
    ``uses``)."""

    lab: str
    sol: str
    checks: dict[str, Check]
    wrong: list[Wrong] = []
    right: list[Right] = []
    # {name: names of other cells' objects its code calls}: loaded from the same notebook
    # into its globals, as running the notebook's cells in order would
    uses: dict[str, tuple[str, ...]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Fill in default arguments and catch a malformed row at collection."""
        super().__init_subclass__(**kwargs)
        for key, check in cls.checks.items():
            if not check.args:
                check.args = (key,)
            unknown = set(check.stubs) - set(check.names)
            assert not unknown, f"{cls.__name__}: {key}: stubs {unknown} are not arguments"
        for row in [*cls.wrong, *cls.right]:
            assert row.check in cls.checks, \
                f"{cls.__name__}: {row!r} names no check; checks are {sorted(cls.checks)}"
            cls._given(cls.checks[row.check], row.answer)

    # ---- loading the code

    @staticmethod
    def _given(check: Check, answer: Any) -> dict[str, Any]:
        """A row's answer as {exercise name: code}."""
        names = check.names
        if len(names) == 1:
            return {names[0]: answer}
        assert isinstance(answer, dict) and set(answer) <= set(names), \
            f"{check.fn.__name__} takes {names}: give the answer as {{name: code}}"
        return answer

    def _load(self, notebook: str, name: str, spelling: str | None = None) -> Any:
        obj = exercise(notebook, name, spelling)
        for dep in self.uses.get(name, ()):
            obj.__globals__[dep] = self._load(notebook, dep, spelling)
        return obj

    def _call(self, key: str, given: dict | None = None, stubbed: tuple = (),
              kwargs: dict | None = None, spelling: str | None = None) -> None:
        """Run check ``key``: ``given`` names' code as given, ``stubbed`` names' from the
        lab, the others from the solution (respelled: ``tools.nbtool.exercise``)."""
        check, given = self.checks[key], given or {}
        args = [a if not isinstance(a, str)
                else given[a] if a in given
                else self._load(self.lab if a in stubbed else self.sol, a, spelling)
                for a in check.args]
        check.fn(*args, **(kwargs or {}))

    # ---- the table, as test cases

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        cases = {"test_passes": self._passing, "test_wrong_answer_fails": self._wrong,
                 "test_stub_fails": self._stubbed,
                 "test_passes_spelled": self._spelled}[metafunc.function.__name__]()
        metafunc.parametrize("case", cases)

    def _marks(self, key: str) -> list:
        return [pytest.mark.slow] if self.checks[key].slow else []

    def _passing(self) -> list:
        cases = [pytest.param(Right(key, None, "the solution"), id=key, marks=self._marks(key))
                 for key, check in self.checks.items() if check.notebook]
        return cases + [pytest.param(r, id=_id(r.check, r.why),
                                     marks=self._marks(r.check) + ([pytest.mark.gloo_only]
                                                                   if r.rules is False else []))
                        for r in self.right]

    @staticmethod
    def _spellings(wire: bool | str) -> list[tuple[str, bool]]:
        """Names imported before (what a spy that replaces torch.distributed's functions
        cannot see) under the rules; point-to-point checks also without them (lone calls
        are right on gloo and wrong under the rules) and as ``torch.distributed.x``.
        (``torch.distributed.x`` and ``dist.x`` are one attribute of one module object:
        the point-to-point checks' row stands for the others.)"""
        return [("imported", True)] + ([("imported", False), ("torch.distributed", False)]
                                       if wire == "p2p" else [])

    def _spelled(self) -> list:
        cases = [pytest.param((key, spelling, rules), id=_id(key, spelling, f"rules {rules}"),
                              marks=self._marks(key))
                 for key, check in self.checks.items() if check.wire and check.notebook
                 for spelling, rules in self._spellings(check.wire)]
        return cases or [pytest.param(None, marks=pytest.mark.skip(reason="no check here "
                                                                   "counts communication"))]

    def _wrong(self) -> list:
        return [pytest.param(w, id=_id(w.check, w.mistake), marks=self._marks(w.check))
                for w in self.wrong]

    def _stubbed(self) -> list:
        cases = []
        for key, check in self.checks.items():
            if not check.notebook:
                continue
            stubs = check.stubs
            if len(stubs) > 1:
                cases.append(pytest.param((key, tuple(stubs)), id=_id(key, "all stubbed")))
            cases += [pytest.param((key, (name,)), id=key if len(stubs) == 1 else _id(key, name))
                      for name in stubs]
        return cases

    # ---- the tests

    def test_passes(self, case: Right, capsys: pytest.CaptureFixture,
                    monkeypatch: pytest.MonkeyPatch) -> None:
        _rules(monkeypatch, case.rules)
        given = None if case.answer is None else self._given(self.checks[case.check], case.answer)
        self._call(case.check, given, kwargs=case.kwargs)
        out = capsys.readouterr().out
        assert out.count("✓") == 1, f"expected one ✓ line from the check, got:\n{out}"

    def test_passes_spelled(self, case: tuple[str, str, bool], capsys: pytest.CaptureFixture,
                            monkeypatch: pytest.MonkeyPatch) -> None:
        key, spelling, rules = case
        _rules(monkeypatch, rules)
        self._call(key, spelling=spelling)
        out = capsys.readouterr().out
        assert out.count("✓") == 1, f"expected one ✓ line from the check, got:\n{out}"

    def test_wrong_answer_fails(self, case: Wrong, monkeypatch: pytest.MonkeyPatch) -> None:
        _rules(monkeypatch, case.rules)
        with pytest.raises(CheckFailed, match=case.says) as failed:
            self._call(case.check, self._given(self.checks[case.check], case.answer),
                       kwargs=case.kwargs)
        assert str(failed.value).strip(), "a check failed without saying why"

    def test_stub_fails(self, case: tuple[str, tuple[str, ...]]) -> None:
        key, stubbed = case
        with pytest.raises(CheckFailed, match=re.escape(STUB_SAYS)):
            self._call(key, stubbed=stubbed)
