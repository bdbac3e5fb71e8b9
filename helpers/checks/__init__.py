"""Lab checks: one module per chapter (``helpers.checks.ch01`` ...).

The contract between a lab and its checks, the same in every chapter:

* A lab cell defines a function (or class) with a documented signature.
* The next cell calls ``checks.check_<thing>(that_function)``.
* The check runs the learner's code against a reference on fixed cases. It
  prints one line starting with ``✓`` on success, and raises ``CheckFailed``
  (an AssertionError) with a message saying *what* differed otherwise, also
  when the exercise still raises NotImplementedError.

Tests in ``tests/test_checks_*.py`` prove that every check passes on the
solution and fails on the lab's stub and on at least one plausible mistake.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["CheckFailed", "attempt", "passed", "expect_close"]


class CheckFailed(AssertionError):
    """The learner's answer is wrong (or not written yet); the message says how."""


def attempt(fn: Callable, *args: Any, what: str = "", **kwargs: Any) -> Any:
    """Call the learner's function; turn 'not done yet' into a clear CheckFailed."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        raise CheckFailed(f"{what or getattr(fn, '__name__', 'the exercise')} is not "
                          f"implemented yet ({exc})") from None


def passed(message: str) -> None:
    print(f"✓ {message}")


def expect_close(got: float, want: float, what: str, rel: float = 1e-9, abs_: float = 0.0) -> None:
    """Raise CheckFailed unless got == want within the stated tolerance."""
    try:
        ok = abs(float(got) - float(want)) <= max(abs_, rel * abs(float(want)))
    except (TypeError, ValueError):
        raise CheckFailed(f"{what}: expected a number, got {got!r}") from None
    if not ok:
        raise CheckFailed(f"{what}: expected {want:,.6g}, got {float(got):,.6g}")
