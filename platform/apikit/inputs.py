"""The declared types every input of the JSON API (and the dashboard's forms) is parsed with: pydantic v2, through
django-ninja, which turns the same declarations into the OpenAPI document.

Each type says what it accepts in words a client can act on, and carries its bounds into the schema:

- integers in a query string are ASCII digits only (no sign, space, underscore, decimal point: `int()` would
  take `²`, `٣` and `1_000`), within stated bounds;
- text is valid Unicode (no lone surrogates: PostgreSQL and UTF-8 cannot store them), without NUL or other
  control characters except tab and newline where a multi-line text is expected, and bounded in length;
- durations are `<digits><s|m|h|d>` within stated bounds (never an overflowing timedelta);
- times are ISO 8601 within what the trace store can hold;
- names are slugs, ids are hex of the stated length.

A value that fails gets a 400 naming the field and the reason (apikit.api).
"""
from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any, Optional

from pydantic import AfterValidator, BeforeValidator, Field, PlainSerializer, WithJsonSchema

# What the store's DateTime64 columns can hold; outside it a time is refused instead of being clamped or
# overflowing Python's datetime.
EARLIEST = dt.datetime(1900, 1, 1, tzinfo=dt.timezone.utc)
LATEST = dt.datetime(2299, 12, 31, 23, 59, 59, tzinfo=dt.timezone.utc)

_DIGITS = re.compile(r"[0-9]{1,18}")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_CONTROL_LINE = re.compile(r"[\x00-\x1f\x7f]")
_DURATION = re.compile(r"([0-9]{1,7})([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
SLUG_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,99}$"
PROJECT_PATTERN = r"^[-a-zA-Z0-9_]{1,100}$"


# -- integers --------------------------------------------------------------------------------------------------
def _ascii_int(value: Any) -> Any:
    if isinstance(value, str):
        if not _DIGITS.fullmatch(value):
            raise ValueError("a whole number in ASCII digits (0-9), without sign, spaces or separators")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("a whole number")
    return value


def QueryInt(ge: int, le: int, description: str = "") -> Any:
    """A whole number from a query string (or JSON), ge ≤ n ≤ le."""

    def bounded(value: int) -> int:
        if not ge <= value <= le:
            raise ValueError(f"a whole number from {ge} to {le}")
        return value

    return Annotated[int, BeforeValidator(_ascii_int), AfterValidator(bounded),
                     Field(description=description or None, json_schema_extra={"minimum": ge, "maximum": le})]


def Matching(pattern: str, reason: str, *, min_length: int = 0, max_length: int | None = None,
             description: str = "") -> Any:
    """A string matching `pattern` (the same in the schema and here), within its length; else `reason`."""
    compiled = re.compile(pattern)
    schema: dict[str, Any] = {"pattern": pattern}
    if min_length:
        schema["minLength"] = min_length
    if max_length is not None:
        schema["maxLength"] = max_length

    def check(value: str) -> str:
        if not min_length <= len(value) <= (max_length if max_length is not None else len(value)) \
                or not compiled.search(value):
            raise ValueError(reason)
        return value

    return Annotated[str, AfterValidator(check), Field(description=description or reason, json_schema_extra=schema)]


# -- text ------------------------------------------------------------------------------------------------------
def _clean_text(value: str, *, multiline: bool) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    if (_CONTROL if multiline else _CONTROL_LINE).search(value):
        raise ValueError("text must not hold NUL or other control characters"
                         + (" (tab and newline are allowed)" if multiline else ""))
    return value


def Text(max_length: int, *, min_length: int = 0, multiline: bool = False, pattern: str | None = None,
         reason: str = "", description: str = "") -> Any:
    """Valid Unicode of min_length to max_length characters, no NUL/control characters (tab and newline with
    multiline); with `pattern`, also matching it (else `reason`)."""
    # The schema's pattern keeps generated text within what the validator takes (control characters are
    # excluded by it too).
    schema_pattern = pattern or (r"^[^\x00-\x08\x0b-\x1f\x7f]*$" if multiline else r"^[^\x00-\x1f\x7f]*$")
    compiled = re.compile(pattern) if pattern else None

    def check(value: str) -> str:
        value = _clean_text(value, multiline=multiline)
        if len(value) < min_length:
            raise ValueError("required (empty)" if min_length == 1 else f"at least {min_length} characters")
        if len(value) > max_length:
            raise ValueError(f"at most {max_length} characters")
        if compiled is not None and not compiled.search(value):
            raise ValueError(reason or description or "not of the expected form")
        return value

    schema: dict[str, Any] = {"pattern": schema_pattern, "maxLength": max_length}
    if min_length:
        schema["minLength"] = min_length
    return Annotated[str, AfterValidator(check), Field(description=description or None, json_schema_extra=schema)]


Slug = Matching(SLUG_PATTERN, "a slug: lowercase letters, digits, '-' and '_', starting with a letter or digit "
                              "(at most 100)", min_length=1, max_length=100)
ProjectName = Matching(PROJECT_PATTERN, "a project name: letters, digits, '-' and '_' (at most 100)", min_length=1,
                       max_length=100)
TraceId = Matching(r"^[0-9a-fA-F]{32}$", "32 hex characters", min_length=32, max_length=32)
Fingerprint = Matching(r"^[0-9a-f]{64}$", "64 lower-case hex characters", min_length=64, max_length=64)


def Subset(*choices: str) -> Any:
    """A comma-separated subset of `choices` (a query parameter such as state=pending,firing)."""
    alternatives = "|".join(choices)
    return Matching(f"^({alternatives})(,({alternatives}))*$", f"a comma-separated subset of {', '.join(choices)}",
                    max_length=sum(len(c) + 1 for c in choices) * 2)


# -- durations -------------------------------------------------------------------------------------------------
def parse_duration(value: Any, *, minimum: dt.timedelta, maximum: dt.timedelta) -> dt.timedelta:
    if not isinstance(value, str):
        raise ValueError("a duration such as 30m, 6h or 7d")
    found = _DURATION.fullmatch(value)
    if not found:
        raise ValueError("a duration: digits and a unit s, m, h or d, such as 30m, 6h or 7d")
    seconds = int(found.group(1)) * _UNITS[found.group(2)]
    if not minimum.total_seconds() <= seconds <= maximum.total_seconds():
        raise ValueError(f"between {format_duration(minimum)} and {format_duration(maximum)}")
    return dt.timedelta(seconds=seconds)


def format_duration(value: dt.timedelta) -> str:
    seconds = int(value.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


# What the document says of a duration's text: no zero (every bound here is above it), at most 7 digits.
DURATION_PATTERN = r"^[1-9][0-9]{0,6}[smhd]$"


def Duration(minimum: dt.timedelta, maximum: dt.timedelta, description: str = "") -> Any:
    """A duration `<digits><s|m|h|d>` between minimum and maximum, as a timedelta."""
    text = f"a duration such as 30m, 6h or 7d, from {format_duration(minimum)} to {format_duration(maximum)}"
    return Annotated[
        dt.timedelta,
        BeforeValidator(lambda v: parse_duration(v, minimum=minimum, maximum=maximum)),
        PlainSerializer(format_duration, return_type=str),
        WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "description": description or text,
                        "examples": [format_duration(minimum), format_duration(maximum)]}),
    ]


def DurationOrSeconds(minimum: dt.timedelta, maximum: dt.timedelta, description: str = "", *,
                      whole_seconds: bool = False) -> Any:
    """A duration as text (`30m`, `6h`) or as a number of seconds, between minimum and maximum."""
    low, high = minimum.total_seconds(), maximum.total_seconds()

    def parse(value: Any) -> dt.timedelta:
        if isinstance(value, bool):
            raise ValueError("a duration such as 30m, or a number of seconds")
        if isinstance(value, (int, float)):
            if whole_seconds and not isinstance(value, int):
                raise ValueError("a whole number of seconds")
            if not (value == value and low <= value <= high):  # NaN fails the first test
                raise ValueError(f"between {format_duration(minimum)} and {format_duration(maximum)}")
            return dt.timedelta(seconds=value)
        return parse_duration(value, minimum=minimum, maximum=maximum)

    number = {"type": "integer" if whole_seconds else "number", "minimum": int(low) if whole_seconds else low,
              "maximum": int(high) if whole_seconds else high, "description": "seconds"}
    return Annotated[
        dt.timedelta,
        BeforeValidator(parse),
        PlainSerializer(format_duration, return_type=str),
        WithJsonSchema({"oneOf": [{"type": "string", "pattern": DURATION_PATTERN}, number],
                        "examples": [format_duration(minimum), format_duration(maximum)],
                        "description": description or f"e.g. 30m, 6h or 7d, or seconds; {format_duration(minimum)} "
                                                      f"to {format_duration(maximum)}"}),
    ]


# -- times -----------------------------------------------------------------------------------------------------
def parse_time(value: Any) -> dt.datetime:
    if isinstance(value, dt.datetime):
        parsed = value
    elif isinstance(value, str) and value.isascii() and 10 <= len(value) <= 40:
        try:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise ValueError("an ISO 8601 time, e.g. 2026-01-31T12:00:00Z") from None
    else:
        raise ValueError("an ISO 8601 time, e.g. 2026-01-31T12:00:00Z")
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    try:
        parsed = parsed.astimezone(dt.timezone.utc)
    except OverflowError:
        raise ValueError(f"between {EARLIEST:%Y-%m-%d} and {LATEST:%Y-%m-%d}") from None
    if not EARLIEST <= parsed <= LATEST:
        raise ValueError(f"between {EARLIEST:%Y-%m-%d} and {LATEST:%Y-%m-%d}")
    return parsed


def iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


Time = Annotated[
    dt.datetime,
    BeforeValidator(parse_time),
    PlainSerializer(iso, return_type=str),
    # The pattern keeps generated times a little inside the bounds (an offset may move a time across one).
    WithJsonSchema({"type": "string", "format": "date-time", "pattern": r"^(19[1-9][0-9]|2[01][0-9]{2}|22[0-8][0-9])-",
                    "description": f"ISO 8601 (Z or an offset; none = UTC), {EARLIEST:%Y-%m-%d} to {LATEST:%Y-%m-%d}"}),
]


def _empty_is_none(value: Any) -> Any:
    return None if value == "" else value


# Query parameters where an empty value means the default, as they always did (`since=&until=`).
OptionalTime = Annotated[Optional[Time], BeforeValidator(_empty_is_none)]


def _flag(value: Any) -> Any:
    if value == "":
        return False
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError("true or false (also 1/0, yes/no, on/off; empty = false)")
    return value


Flag = Annotated[bool, BeforeValidator(_flag)]
