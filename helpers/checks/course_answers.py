"""The course's own answers, switched off while a learner's exercise runs.

Every lab exercise has a finished version in ``helpers``: the chapter teaches with it
(``helpers.pipeline.partition``, ``helpers.tp.vocab_parallel_cross_entropy``, ...). A
learner who calls it in place of writing the exercise gets the right numbers, and a
check that compares numbers would pass a one-line answer. So a check that must see the
learner's own work runs it inside ``refusing(...)``: for as long as the block lasts,
calling one of the named functions or classes raises ``CourseAnswerUsed``, a
``CheckFailed`` that names what was called, so the learner reads why instead of a
traceback. How: a function's code object is swapped for one that raises (every
reference to the function, whatever name it was imported under, reaches the same
function object, so an alias such as ``from helpers.sp import merge_partials as mp``
is refused too); a class gets an ``__init__`` that raises. Everything is put back when
the block ends, also when it ends with an error. The check's own calls to the reference
(to compute what the answer should be) stay outside the block.

Inside a rank function the same works (the rank is a fresh process; the swap lives and
dies with it). There, catch ``CourseAnswerUsed`` and return its message, so that every
rank stops alike and the check reports one clear line.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Iterator

from helpers.checks import CheckFailed

__all__ = ["CourseAnswerUsed", "refusing"]


class CourseAnswerUsed(CheckFailed):
    """The learner's code called the course's own answer to the exercise."""


def _resolve(path: str):
    """'helpers.pipeline.partition.partition' -> the object (module path, then attribute)."""
    module, _, name = path.rpartition(".")
    obj = importlib.import_module(module)
    return getattr(obj, name)


def _raising_code(nfree: int, message: str) -> types.CodeType:
    """The code of a function that raises CourseAnswerUsed(message), with ``nfree`` free
    variables (a function's code may only be replaced by code with as many). The code
    runs with the replaced function's globals, so it names nothing but builtins: the
    exception class comes through ``__import__``, the message is a constant."""
    names = [f"_free{i}" for i in range(nfree)]
    src = ("def _outer():\n"
           + "".join(f"    {n} = None\n" for n in names)
           + "    def _refused(*args, **kwargs):\n"
           + (f"        ({', '.join(names)},)\n" if names else "")
           + "        raise __import__('helpers.checks.course_answers', fromlist=['_'])"
           + f".CourseAnswerUsed({message!r})\n"
           + "    return _refused\n")
    scope: dict = {}
    exec(src, scope)  # noqa: S102 - a fixed template; the message goes in as a repr
    return scope["_outer"]().__code__


@contextlib.contextmanager
def refusing(paths: list[str] | tuple[str, ...] | dict[str, str], exercise: str = "your code",
             instead: str = "write it yourself: the exercise is that code") -> Iterator[None]:
    """While the block runs, calling any object named in ``paths`` (dotted import
    paths of functions or classes) raises ``CourseAnswerUsed``: '<exercise> called
    <path>, switched off in this check: the course's own answer: <instead>'. ``paths``
    may be a dict of path to its own reason (an empty one says the default)."""
    restore: list = []
    reasons = paths if isinstance(paths, dict) else dict.fromkeys(paths, "")
    default = f"the course's own answer: {instead}"
    try:
        for path, why in reasons.items():
            obj = _resolve(path)
            if hasattr(obj, "cache_clear"):
                # functools.lru_cache: a cached result would skip the swapped code
                obj.cache_clear()
                restore.append(("cache", obj, None, None))
                obj = obj.__wrapped__
            message = (f"{exercise} called {path}, switched off in this check: "
                       f"{why or default}")
            if isinstance(obj, type):
                had = "__init__" in vars(obj)
                old = vars(obj).get("__init__")

                def init(self, *args, _message=message, **kwargs):
                    raise CourseAnswerUsed(_message)
                obj.__init__ = init
                restore.append(("class", obj, had, old))
            elif isinstance(obj, types.FunctionType):
                old_code = obj.__code__
                # the stub's default arguments must not clash with the function's own:
                # it takes *args, **kwargs, so whatever defaults the function has are unused
                obj.__code__ = _raising_code(len(old_code.co_freevars), message)
                restore.append(("function", obj, old_code, None))
            else:
                raise TypeError(f"refusing: {path} is a {type(obj).__name__}, expected a "
                                f"function or a class")
        yield
    finally:
        for kind, obj, a, b in reversed(restore):
            if kind == "function":
                obj.__code__ = a
            elif kind == "cache":
                obj.cache_clear()  # nothing the refused calls left behind
            elif a:
                obj.__init__ = b
            else:
                del obj.__init__
