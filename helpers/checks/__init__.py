"""Lab checks: one module per chapter (``helpers.checks.ch01`` ...).

The contract between a lab and its checks, the same in every chapter:

* A lab cell defines a function (or class) with a documented signature.
* The next cell calls ``checks.check_<thing>(that_function)``.
* The check runs the learner's code against a reference on fixed cases. It
  prints one line starting with ``✓`` on success, and raises ``CheckFailed``
  (an AssertionError) with a message saying *what* differed otherwise, also
  when the exercise still raises NotImplementedError.

In a notebook a failing check shows only its message (see
``CheckFailed._render_traceback_``), not a traceback through this package:
the learner needs what was expected and what came back, not our frames.

What the chapter modules share, each in one place:

* ``helpers.checks.spy``: ``communication_spy`` counts every send and receive (lone
  or in a ``batch_isend_irecv``) and every collective the learner's code makes;
* ``helpers.checks.course_answers``: ``refusing(...)`` switches the course's own
  answer to an exercise off while the learner's code runs, so a one-line call of
  it fails with a sentence, not with the right numbers;
* ``helpers.checks.groups``: ``split_world`` runs the exercise in groups that are
  not the world, and ``GroupWatch`` stops a collective called without its ``group=``.

Tests in ``tests/test_checks_*.py`` prove that every check passes on the
solution and fails on the lab's stub and on at least one plausible mistake.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["CheckFailed", "attempt", "passed", "expect_close", "on_ranks"]


class CheckFailed(AssertionError):
    """The learner's answer is wrong (or not written yet); the message says how."""

    def _render_traceback_(self) -> list[str]:
        """What IPython (and so Jupyter) shows instead of the traceback.

        IPython calls this hook on an exception that has it and prints the lines
        it returns as the whole error. The frames would all be inside the check;
        the message already names the case, what was expected and what came back.
        A rank's traceback, when a check ran the learner's code on ranks, is part
        of the message and so still shown.
        """
        red, bold, reset = "\x1b[31m", "\x1b[1m", "\x1b[0m"  # ANSI, as IPython's own tracebacks
        first, *rest = str(self).splitlines() or ["(no message)"]
        return [f"{red}{bold}✗ check failed:{reset} {first}", *rest]


def attempt(fn: Callable, *args: Any, what: str = "", **kwargs: Any) -> Any:
    """Call the learner's function; turn any exception it raises into a CheckFailed.

    'Not done yet' (NotImplementedError) says so; any other exception (a shape
    error, a None where a tensor belongs, the learner's own assert) is named with
    its type, its message and the learner's line that raised it, so the learner
    reads an explanation instead of a traceback through the check.
    """
    name = what or getattr(fn, "__name__", "the exercise")
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        raise CheckFailed(f"{name} is not implemented yet ({exc})") from None
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - every learner error becomes an explanation
        raise CheckFailed(f"{name} raised {type(exc).__name__}: {exc}"
                          f"{learner_line(exc)}") from exc


def learner_line(exc: BaseException) -> str:
    """' (at <file>, line N: <code>)' for the innermost frame outside torch and helpers.

    That frame is the learner's code (a notebook cell or their module); frames in
    torch or in this package say where the error surfaced, not where the mistake is.
    """
    import traceback
    from pathlib import Path

    import torch

    ours = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(ours)]
    if not frames:
        return ""
    f = frames[-1]
    code = f": `{f.line.strip()}`" if f.line else ""
    return f" (at {f.filename}, line {f.lineno}{code})"


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


# gloo's reason goes to the rank's stderr; the rank itself is just killed by SIGABRT
GLOO_ABORT = ("gloo aborts a rank (SIGABRT) when the ranks' communication does not match: "
              "a collective called on some ranks only or in another order, tensors of "
              "different sizes on different ranks, or a receive buffer of another size than "
              "the message sent to it")


def on_ranks(fn: Callable, world_size: int, *args: Any, what: str, timeout: float = 60,
             probe: Callable | None = None, hints: dict[str, str] | None = None,
             **kwargs: Any) -> list:
    """``launch(fn, world_size, ...)`` with a learner's mistake as a CheckFailed.

    ``probe()``, if given, first calls the learner's code once in this process
    (no process group): an untouched exercise raises NotImplementedError right
    there, and we say so without starting ranks. Any other exception from the
    probe is ignored: code that needs a process group is expected to fail
    outside one.
    ``hints`` maps a piece of a rank's error message to advice appended to it
    (e.g. "storage of size 0" -> "a weight was used while freed ...").
    """
    from helpers.launch import RankError, RankTimeout, launch

    if probe is not None:
        try:
            probe()
        except NotImplementedError as exc:
            raise CheckFailed(f"{what} is not implemented yet ({exc})") from None
        except Exception:  # noqa: BLE001 - see docstring
            pass
    try:
        return launch(fn, world_size, *args, timeout=timeout, **kwargs)
    except RankTimeout as err:
        # under NCCL's rules (helpers.launch.nccl_rules) the launch says which
        # communicator each rank was waiting to create: that is the explanation
        rules = getattr(err, "nccl_rules", None)
        raise CheckFailed(
            f"{what} hung: rank(s) {err.ranks} were still waiting after {timeout:g} s. "
            + (rules if rules else
               "A deadlock? Every rank must post matching sends and receives, and call "
               "the same collectives in the same order.")) from None
    except RankError as err:
        # the lab's stub raises NotImplementedError("Exercise: ..."); another
        # NotImplementedError (nccl's "does not support recvAnysource") is an error
        if err.exc_type == "NotImplementedError" and ": Exercise" in str(err).split("\n")[0]:
            raise CheckFailed(f"{what} is not implemented yet") from None
        first = str(err).split("\n--- traceback")[0]
        advice = list(dict.fromkeys(tip for key, tip in (hints or {}).items() if key in first))
        if "SIGABRT" in first and not advice:
            advice.append(GLOO_ABORT)
        raise CheckFailed(f"{what} failed on a rank: {first}"
                          + "".join(f" -- {tip}" for tip in advice)
                          + f"\n\n--- traceback of rank {err.rank} ---\n"
                          + (err.rank_traceback or "")) from None
