"""Typed attribute reads: numbers in any OTLP spelling, junk to None, never an exception."""
import math

import pytest

from collectors import attrs
from collectors.base import STATUS_ERROR, STATUS_OK


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1.0), (0.25, 0.25), ("0.25", 0.25), (" 3 ", 3.0), ("1e-3", 0.001), (-2, -2.0)],
)
def test_as_float_accepts_ints_floats_and_numeric_strings(value, expected):
    assert attrs.as_float(value) == pytest.approx(expected)


@pytest.mark.parametrize(
    "value",
    [None, True, False, "abc", "", "nan", "inf", "1e400", 10**400, math.nan, math.inf, -math.inf, [1], {"a": 1}, b"1"],
)
def test_as_float_rejects_junk(value):
    assert attrs.as_float(value) is None


def test_seconds_as_ms_converts_and_refuses_negatives():
    assert attrs.seconds_as_ms(0.0842) == pytest.approx(84.2)
    assert attrs.seconds_as_ms("1.5") == pytest.approx(1500.0)
    assert attrs.seconds_as_ms(0) == 0.0
    assert attrs.seconds_as_ms(-0.001) is None
    assert attrs.seconds_as_ms("soon") is None


@pytest.mark.parametrize(
    ("value", "expected"), [(512, 512), (0, 0), ("512", 512), (512.0, 512), ("12.0", 12)]
)
def test_as_count_accepts_whole_numbers(value, expected):
    assert attrs.as_count(value) == expected


@pytest.mark.parametrize("value", [-1, "-3", 12.5, "12.5", True, None, "many", math.nan, [3], 2**31, "1e12"])
def test_as_count_rejects_negative_fractional_and_junk(value):
    assert attrs.as_count(value) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("True", True), ("false", False), ("1", True), (0, False), (1, True)],
)
def test_as_flag_reads_litellm_style_strings(value, expected):
    assert attrs.as_flag(value) is expected


@pytest.mark.parametrize("value", [None, "maybe", 2, 1.0, [True]])
def test_as_flag_rejects_junk(value):
    assert attrs.as_flag(value) is None


def test_as_text():
    assert attrs.as_text("gpt-4o") == "gpt-4o"
    assert attrs.as_text(42) == "42"
    assert attrs.as_text("  ") is None
    assert attrs.as_text(True) is None
    assert attrs.as_text(["gpt-4o"]) is None


def test_first_event_offset(make_span):
    span = make_span("s", events=[("other", 5.0), ("first", 12.5), ("first", 20.0)])
    assert attrs.first_event_offset_ms(span, frozenset({"first"})) == pytest.approx(12.5)
    assert attrs.first_event_offset_ms(span, frozenset({"absent"})) is None
    before_start = make_span("s", events=[("first", -1.0)])
    assert attrs.first_event_offset_ms(before_start, frozenset({"first"})) is None


@pytest.mark.parametrize("key, read", [
    ("llm_observatory.engine_config", attrs.engine_config_of),
    # The platform's replicas say their group on their resource, its gateway on the span it routed.
    ("llm_observatory.replica_group", attrs.replica_group_of),
])
def test_platform_attributes_prefer_resource_then_span(make_span, key, read):
    both = make_span("s", resource={key: "from-resource"}, attributes={key: "from-span"})
    assert read(both) == "from-resource"
    assert read(make_span("s", attributes={key: "from-span"})) == "from-span"
    assert read(make_span("s")) is None
    assert read(make_span("s", resource={key: ""})) is None


def test_is_error_from_status_or_error_type(make_span):
    assert attrs.is_error(make_span("s", status_code=STATUS_ERROR))
    assert attrs.is_error(make_span("s", attributes={"error.type": "timeout"}))
    assert not attrs.is_error(make_span("s", status_code=STATUS_OK))
    assert not attrs.is_error(make_span("s", attributes={"error.type": ""}))
