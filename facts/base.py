"""The base of this project's facts: pyinfra's ``FactBase``, whose parser errors are
pyinfra's own fact error.

pyinfra's ``get_fact`` catches ``FactProcessError`` only: it logs "could not process
fact", fails that host and goes on with the fact's default. Any other exception a
parser raises (a ``ValueError`` on output it never saw) is raised while pyinfra plans
the run and ends the whole run, every host's. A fact made on this base raises whatever
its ``process`` raises as a ``FactProcessError``, with the parser's own exception as its
cause (which is what pyinfra prints), so a parser error fails only the host it read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from pyinfra.api import facts as pyinfra_facts
from pyinfra.api.exceptions import FactProcessError
from typing_extensions import override

T = TypeVar("T")


def process_error(name: str, error: Exception) -> FactProcessError:
    """``error``, raised by fact ``name``'s parser, as pyinfra's FactProcessError."""
    if isinstance(error, FactProcessError):
        return error
    failed = FactProcessError(f"{name} could not parse its output: "
                              f"{type(error).__name__}: {error}")
    failed.__cause__ = error
    return failed


def _raising_fact_errors(process: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(process)
    def parse(self: pyinfra_facts.FactBase, output: list[str]) -> Any:
        try:
            return process(self, output)
        except FactProcessError:
            raise
        except Exception as error:
            raise process_error(self.name, error) from error

    return parse


class FactBase(pyinfra_facts.FactBase[T]):
    """
    pyinfra's FactBase: a subclass's ``process`` raises its errors as FactProcessError.
    """

    @override
    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        process = cls.__dict__.get("process")
        if process is not None:
            cls.process = _raising_fact_errors(process)  # type: ignore[method-assign]
