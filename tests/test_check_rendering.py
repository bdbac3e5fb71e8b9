"""A failing lab check shows the learner its message, not frames inside helpers.checks.

The cells run in a real IPython shell, which is what renders errors in Jupyter
(ipykernel sends IPython's traceback lines to the browser unchanged)."""

import re

import pytest
from IPython.core.interactiveshell import InteractiveShell

from helpers.checks import CheckFailed

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    yield sh
    InteractiveShell.clear_instance()


def shown(shell, capsys, source: str) -> str:
    capsys.readouterr()
    shell.run_cell(source)
    captured = capsys.readouterr()
    return ANSI.sub("", captured.out + captured.err)


def test_failing_check_shows_message_expected_and_got_only(shell, capsys):
    out = shown(shell, capsys, "from helpers.checks import ch01\n"
                               "ch01.check_bytes_per_param(lambda weights, optimizer: 12)")
    assert "✗ check failed: bytes_per_param('fp32', 'adam') = 12, expected 16." in out
    assert "Traceback" not in out and "helpers/checks" not in out and "raise CheckFailed" not in out


def test_stub_shows_not_implemented_without_frames(shell, capsys):
    out = shown(shell, capsys, "def f(w, o):\n    raise NotImplementedError('Exercise: add bytes')\n"
                               "ch01.check_bytes_per_param(f)")
    assert ("✗ check failed: bytes_per_param('fp32', 'adam') is not implemented yet "
            "(Exercise: add bytes)") in out
    assert "Traceback" not in out and "helpers/checks" not in out


def test_other_errors_keep_their_traceback(shell, capsys):
    """The capture above is real: an ordinary exception still shows its frames."""
    out = shown(shell, capsys, "def g():\n    raise ValueError('mine')\ng()")
    assert "Traceback" in out and "ValueError: mine" in out and "----> 3 g()" in out


def test_multiline_message_keeps_every_line():
    lines = CheckFailed("first\nsecond\nthird")._render_traceback_()
    assert ANSI.sub("", lines[0]) == "✗ check failed: first" and lines[1:] == ["second", "third"]


def _learner_indexes_none(x):
    return x.shape[0]  # the learner's line: x is None


def test_attempt_turns_a_learner_exception_into_an_explanation():
    """A RuntimeError/AttributeError/AssertionError from the learner's code is a CheckFailed
    naming the case, the exception and the learner's own line -- not a traceback."""
    from helpers.checks import attempt

    with pytest.raises(CheckFailed) as info:
        attempt(_learner_indexes_none, None, what="shard_sizes(10, p=3)")
    msg = str(info.value)
    assert msg.startswith("shard_sizes(10, p=3) raised AttributeError: 'NoneType'")
    assert "test_check_rendering.py" in msg and "x.shape[0]" in msg

    def own_assert():
        assert False, "my own check"

    with pytest.raises(CheckFailed, match="raised AssertionError: my own check"):
        attempt(own_assert)
    with pytest.raises(CheckFailed, match="not implemented yet"):
        attempt(lambda: (_ for _ in ()).throw(NotImplementedError("stub")))
