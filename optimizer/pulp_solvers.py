"""PuLP, imported so that it keeps nothing of its importer alive.

On import PuLP tries each optional solver (COPT, CPLEX, ...) and keeps the error of each one it could not
load on that solver's class (`err`; pulp only says its text when the solver is asked for). The error's
traceback holds every frame that was running when pulp was first imported: planning imports the
optimizer on a job's first plan, so the first `LLM` of a process stayed alive, with its model, for good.
"""

from __future__ import annotations

import sys

import pulp

__all__ = ["pulp"]


def _without_traceback(error: BaseException) -> None:
    """The error and those chained to it keep their text, not their frames."""
    stack: list[BaseException | None] = [error]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack += [e.__cause__, e.__context__]


def forget_import_tracebacks() -> None:
    """Drop the tracebacks of the errors pulp's modules keep (their text stays)."""
    for name, module in list(sys.modules.items()):
        if name != "pulp" and not name.startswith("pulp."):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, BaseException):
                _without_traceback(value)
            elif isinstance(value, type):
                for kept in list(vars(value).values()):
                    if isinstance(kept, BaseException):
                        _without_traceback(kept)


forget_import_tracebacks()
