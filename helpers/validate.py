"""Argument checks shared by every module: one rule, one message.

Python's ``bool`` is an ``int`` (``True == 1``), so ``isinstance(x, int)``
alone would read ``True`` as one rank or one micro-batch; these checks refuse
it, and floats such as ``2.0``, with a ``ValueError`` that names the argument.

This module imports nothing from ``helpers``: the launcher, the model and the
cost models all call it, so it has to sit below all of them (it is not in
``helpers.memory``, which imports ``helpers.recompute`` and so the model).
"""

from __future__ import annotations

__all__ = ["is_int", "positive_int", "int_at_least"]


def is_int(value) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(name: str, value, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``; else ``ValueError`` naming ``name``.

    The message reads "<name> must be a positive int, got <value>" for
    ``minimum == 1`` and "<name> must be an int >= <minimum>, got <value>"
    otherwise. ``name`` may carry what the number counts, e.g.
    ``"dp (data-parallel ranks)"``.
    """
    if not is_int(value) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return value


def positive_int(name: str, value) -> int:
    """``value`` if it is an int >= 1 (not a bool); else ``ValueError`` naming ``name``."""
    return int_at_least(name, value, 1)
