"""Properties of the API's input types (apikit.inputs) that a JSON Schema cannot state, checked with
hypothesis: integers are ASCII digits only (Unicode digits, signs, spaces and separators are refused, never an
exception), text refuses lone surrogates, NUL and control characters, durations and times of any size are
refused or bounded (never an OverflowError). Every refusal is a pydantic ValidationError, which the API turns
into a 400 naming the field."""
from __future__ import annotations

import datetime as dt
import string
import unicodedata

import pytest
from apikit.inputs import EARLIEST, LATEST, Duration, QueryInt, Text, Time
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

LIMIT = TypeAdapter(QueryInt(1, 500))
NAME = TypeAdapter(Text(100))
COMMENT = TypeAdapter(Text(1000, multiline=True))
WINDOW = TypeAdapter(Duration(dt.timedelta(minutes=1), dt.timedelta(days=90)))
TIME = TypeAdapter(Time)

NON_ASCII_DIGITS = st.characters(categories=["Nd", "No"]).filter(lambda c: c not in string.digits)


def refused(adapter: TypeAdapter, value) -> bool:
    try:
        adapter.validate_python(value)
    except ValidationError:
        return True
    return False


@given(st.text(alphabet=NON_ASCII_DIGITS, min_size=1, max_size=6))
def test_unicode_digits_are_never_a_number(text):
    assert unicodedata.category(text[0]) in ("Nd", "No")
    assert refused(LIMIT, text)


@given(st.integers(min_value=1, max_value=500), st.sampled_from(["+", " ", "\t", "_", ".0", "\n", "0x"]),
       st.booleans())
def test_signs_spaces_separators_and_decimals_are_refused(number, extra, before):
    text = extra + str(number) if before else str(number) + extra
    assert refused(LIMIT, text)


@given(st.integers(min_value=-10**30, max_value=10**30))
def test_ascii_integers_are_taken_exactly_when_in_bounds(number):
    text = str(number)
    if text.isdigit() and 1 <= number <= 500:
        assert LIMIT.validate_python(text) == number
    else:
        assert refused(LIMIT, text)


@given(st.text(min_size=0, max_size=20), st.integers(min_value=0xD800, max_value=0xDFFF), st.text(max_size=20))
def test_a_lone_surrogate_is_refused_anywhere_in_text(head, surrogate, tail):
    value = head + chr(surrogate) + tail
    assert refused(NAME, value) and refused(COMMENT, value)


@given(st.text(max_size=30), st.sampled_from(["\x00", "\x01", "\x07", "\x1b", "\x7f"]), st.text(max_size=30))
def test_nul_and_control_characters_are_refused(head, control, tail):
    assert refused(NAME, head + control + tail) and refused(COMMENT, head + control + tail)


@given(st.text(alphabet=st.characters(blacklist_categories=["Cs", "Cc"]), max_size=100))
def test_valid_text_within_the_length_is_kept_as_it_is(value):
    assert NAME.validate_python(value) == value
    assert COMMENT.validate_python(value + "\n\tsecond line") == value + "\n\tsecond line"


def test_text_beyond_its_length_is_refused():
    assert refused(NAME, "a" * 101) and NAME.validate_python("a" * 100)


@given(st.integers(min_value=0, max_value=10**40), st.sampled_from("smhd"))
@settings(max_examples=300)
def test_durations_of_any_size_are_bounded_or_refused_never_overflowing(number, unit):
    text = f"{number}{unit}"
    seconds = number * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    if len(str(number)) <= 7 and 60 <= seconds <= 90 * 86400:
        assert WINDOW.validate_python(text) == dt.timedelta(seconds=seconds)
    else:
        assert refused(WINDOW, text)


@given(st.text(max_size=12))
def test_anything_that_is_not_digits_and_a_unit_is_refused(text):
    if not (text[:-1].isascii() and text[:-1].isdigit() and text[-1:] in ("s", "m", "h", "d")):
        assert refused(WINDOW, text)


@given(st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30)),
       st.sampled_from(["Z", "+00:00", "+14:00", "-12:00", ""]))
def test_times_outside_what_the_store_holds_are_refused_never_overflowing(moment, zone):
    text = moment.isoformat() + zone
    try:
        parsed = TIME.validate_python(text)
    except ValidationError:
        return
    assert EARLIEST <= parsed <= LATEST and parsed.tzinfo is not None


@pytest.mark.parametrize("text", ["0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-12:00", "2026-13-01T00:00:00Z",
                                  "2026-01-01T00:00:00Z\u0660", "２０２６-01-01T00:00:00Z", "2026-01-01"])
def test_edge_times_are_refused_cleanly(text):
    if text == "2026-01-01":
        assert TIME.validate_python(text) == dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    else:
        assert refused(TIME, text)
