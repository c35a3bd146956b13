"""The shared argparse value parsers: what each accepts, and the message for what it refuses."""
from __future__ import annotations

import argparse
import math

import pytest

from engine.cli_args import (
    bounded_float,
    finite_float,
    integer,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)


@pytest.mark.parametrize(("parse", "text", "value"), [
    (finite_float, "-2.5", -2.5),
    (positive_float, "1e-3", 0.001),
    (non_negative_float, "0", 0.0),
    (integer, "-7", -7),
    (positive_int, "1", 1),
    (non_negative_int, "0", 0),
    (port_number, "0", 0),
    (port_number, "65535", 65535),
    (bounded_float(above=0, below=86400), "86399.5", 86399.5),
])
def test_accepted_values(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(("parse", "text", "message"), [
    (finite_float, "abc", "'abc' is not a number"),
    (finite_float, "nan", "'nan' is not a finite number"),
    (positive_float, "inf", "'inf' is not a finite number"),
    (positive_float, "0", "must be > 0, not '0'"),
    (non_negative_float, "-1", "must be >= 0, not '-1'"),
    (integer, "1.5", "'1.5' is not a whole number"),
    (positive_int, "0", "must be >= 1, not '0'"),
    (non_negative_int, "-1", "must be >= 0, not '-1'"),
    (port_number, "70000", "must be >= 0 and <= 65535, not '70000'"),
    (bounded_float(above=0, below=86400), "86400", "must be > 0 and < 86400, not '86400'"),
    (bounded_float(allow_inf=True), "nan", "'nan' is not a finite number"),
])
def test_refused_values_say_why(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)


def test_infinity_only_when_allowed():
    assert bounded_float(allow_inf=True)("inf") == math.inf
    assert bounded_float(above=0, allow_inf=True)("inf") == math.inf


def test_named_parsers_read_well_in_argparse_errors(capsys):
    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--port", type=port_number)
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "x"])
    assert "argument --port: 'x' is not a whole number" in capsys.readouterr().err
    assert port_number.__name__ == "port_number" and port_number.__doc__
