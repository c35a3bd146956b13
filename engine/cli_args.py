"""Value parsers for argparse ``type=``, shared by the engine's command lines.

Each parser takes the flag's text and returns the value, or raises
``argparse.ArgumentTypeError`` with a message argparse prints after the flag name, e.g.
``argument --timeout: must be > 0, not '-1'``. NaN is always refused; infinity only
where a parser says so. Checks that involve several flags (or want the flag's name in
the message) stay with the caller, e.g. ``LoadSpec.problems``.

    parser.add_argument("--timeout", type=positive_float)
    parser.add_argument("--port", type=port_number)
    parser.add_argument("--grace", type=bounded_float(above=0, below=86400))
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _bounds_message(text: str, bounds: list[str]) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"must be {' and '.join(bounds)}, not {text!r}")


def bounded_float(*, above: float | None = None, at_least: float | None = None, below: float | None = None,
                  at_most: float | None = None, allow_inf: bool = False) -> Callable[[str], float]:
    """A parser of floats within the given bounds (``above``/``below`` exclusive, ``at_least``/``at_most`` inclusive).

    The value must be finite unless ``allow_inf``; NaN is never accepted.
    """
    bounds = [f"{op} {limit:g}" for op, limit in ((">", above), (">=", at_least), ("<", below), ("<=", at_most))
              if limit is not None]

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if ((above is not None and not value > above) or (at_least is not None and not value >= at_least)
                or (below is not None and not value < below) or (at_most is not None and not value <= at_most)):
            raise _bounds_message(text, bounds)
        return value

    return parse


def bounded_int(*, at_least: int | None = None, at_most: int | None = None) -> Callable[[str], int]:
    """A parser of integers within the given (inclusive) bounds."""
    bounds = [f"{op} {limit}" for op, limit in ((">=", at_least), ("<=", at_most)) if limit is not None]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
            raise _bounds_message(text, bounds)
        return value

    return parse


def _named(parse: Callable[[str], T], name: str, doc: str) -> Callable[[str], T]:
    parse.__name__ = parse.__qualname__ = name
    parse.__doc__ = doc
    return parse


finite_float = _named(bounded_float(), "finite_float", "Any finite number.")
positive_float = _named(bounded_float(above=0), "positive_float", "A finite number > 0 (durations, rates, timeouts).")
non_negative_float = _named(bounded_float(at_least=0), "non_negative_float", "A finite number >= 0.")

integer = _named(bounded_int(), "integer", "Any whole number (seeds).")
positive_int = _named(bounded_int(at_least=1), "positive_int", "A whole number >= 1 (counts, sizes).")
non_negative_int = _named(bounded_int(at_least=0), "non_negative_int", "A whole number >= 0.")
port_number = _named(bounded_int(at_least=0, at_most=65535), "port_number", "A TCP port: 0 (any free port) to 65535.")
