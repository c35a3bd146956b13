"""traces.store renders lists of strings itself (one join) for tenant queries; the text must be exactly what
clickhouse-connect would bind, whatever the strings hold, and query_json must read every row back."""
from __future__ import annotations

import pytest
from clickhouse_connect.driver.binding import format_bind_value
from traces.store import _tenant_parameters

SQL = "SELECT 1 WHERE project_id = {project_id:UInt32} AND trace_id IN {values:Array(String)}"


@pytest.mark.parametrize("values", [
    [],
    ["a"],
    [f"{i:032x}" for i in range(1000)],
    ["it's"],
    ["back\\slash", "plain"],
    ["tab\there"],
    ["new\nline"],
    ["`tick`"],
    ["'", "''"],
    ["é€ unicode", "日本"],
    [1, 2],
    ["a", None],
    [None, "a"],
])
def test_bound_lists_render_exactly_as_clickhouse_connect_renders_them(values):
    params = _tenant_parameters(SQL, 7, {"values": values})
    assert format_bind_value(params["values"]) == format_bind_value(values)
    assert params["project_id"] == 7


def test_query_json_reads_every_row_with_many_ids_and_odd_strings(make_store):
    store = make_store()
    table = store.table("kv")
    store.command(f"CREATE TABLE {table} (project_id UInt32, trace_id String, n Float64) ENGINE = MergeTree ORDER BY trace_id")
    ids = [f"{i:032x}" for i in range(3000)] + ["it's", "back\\slash", "tab\t", "new\nline", "日本"]
    store.command(f"INSERT INTO {table} SELECT 1, arrayJoin({{ids:Array(String)}}), 0.5", {"ids": ids})
    store.command(f"INSERT INTO {table} VALUES (2, 'other project', 1)")
    rows = store.query_json(f"SELECT trace_id, n FROM {table} WHERE project_id = {{project_id:UInt32}} "
                            "AND trace_id IN {ids:Array(String)} ORDER BY trace_id",
                            project_id=1, parameters={"ids": ids + ["other project"]})
    assert [r[0] for r in rows] == sorted(ids)
    assert all(r[1] == 0.5 for r in rows)
    assert store.query_json(f"SELECT trace_id FROM {table} WHERE project_id = {{project_id:UInt32}} AND n > 5",
                            project_id=1) == []


@pytest.mark.parametrize("values", [
    [],
    [""],
    ["", ""],
    ["a"],
    ["1"],
    [f"{i:032x}" for i in range(3000)],
    ["a,b", "c"],
    ["it's", "back\\slash", "tab\there", "new\nline", "cr\rreturn", "`tick`", "\\n", "日本", " spaced "],
])
def test_string_set_is_exactly_the_strings_given(make_store, values):
    """string_set() gives back the very set of strings, whichever form it picks for them."""
    from traces.store import string_set

    store = make_store()
    table = store.table("one")
    store.command(f"CREATE TABLE {table} (project_id UInt32) ENGINE = MergeTree ORDER BY project_id")
    store.command(f"INSERT INTO {table} VALUES (1)")
    sql, param = string_set("values", values)
    rows = store.query_json(f"SELECT arraySort(arrayDistinct({sql})) FROM {table} WHERE project_id = {{project_id:UInt32}}",
                            project_id=1, parameters={"values": param})
    assert rows == [[sorted(set(values))]]
    found = store.query_json(f"SELECT count() FROM {table} WHERE project_id = {{project_id:UInt32}} "
                             f"AND toString(project_id) IN {sql}", project_id=1, parameters={"values": param})
    assert found == [[1 if "1" in values else 0]]
    if values and all(v.isalnum() for v in values):
        assert "splitByChar" in sql  # ids take the cheap form
