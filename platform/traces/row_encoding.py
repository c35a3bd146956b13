"""JSONCompactEachRow encoding of ClickHouse rows and the settings of the bulk inserts that carry them: what the
span writer (ingest) and the decomposition (traces) both write with."""
from __future__ import annotations

import json
import math
from typing import Any

import orjson

JSON_INSERT_SETTINGS = {
    "input_format_json_read_numbers_as_strings": 1,
    "input_format_json_read_bools_as_strings": 1,
    "input_format_json_read_arrays_as_strings": 1,
    "input_format_json_read_objects_as_strings": 1,
    "input_format_skip_unknown_fields": 0,
}


def bulk_insert_settings(embedded: bool) -> dict:
    """Settings for the span writer's and the decomposition's inserts (JSON_INSERT_SETTINGS plus two).

    - optimize_on_insert = 0: our tables are ReplacingMergeTrees, and by default ClickHouse runs
      the replacing merge on every inserted block, copying each row once more (Map columns
      row by row); that was ~25% of the CPU of a spans insert. Rows repeated within one block
      then stay until a merge, exactly like rows repeated across blocks (spool replays) always
      could: every read of these tables already uses FINAL or counts distinct span ids.
    - input_format_parallel_parsing = 0 with chdb: the parser's extra threads share the two
      cores with ingest's Python thread, and parallel parsing costs ~10% more CPU in all (a
      server on its own machine keeps it, for latency).
    """
    settings = {**JSON_INSERT_SETTINGS, "optimize_on_insert": 0}
    if embedded:
        settings["input_format_parallel_parsing"] = 0
    return settings


_encode = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode


def _finite(value: Any) -> Any:
    """Replace NaN/±Infinity (not valid JSON) with their names as text, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def encode_value(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer beyond 64 bits (OTLP-JSON allows any): the stdlib writes it as text
        return _encode(_finite(value)).encode()


def encode_rows(rows: list[list]) -> bytes:
    """JSONCompactEachRow bytes for these rows (orjson: ~10x the stdlib encoder on these rows).

    Rows are separated by commas (`[...],[...]`), which JSONCompactEachRow reads like newlines:
    the whole batch is then one orjson call with the brackets cut off, ~25% cheaper than one call
    per row. Batches are joined with newlines by their consumers."""
    if not rows:
        return b""
    try:
        # orjson writes NaN/Infinity as null; doubles from OTLP were already made text by the decoder.
        return orjson.dumps(rows)[1:-1]
    except TypeError:  # an integer beyond 64 bits (OTLP-JSON allows any): the stdlib writes it as text
        return "\n".join(_encode(_finite(row)) for row in rows).encode()
