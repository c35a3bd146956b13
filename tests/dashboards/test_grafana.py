"""The Grafana dashboards in dashboards/grafana/: generated (the committed JSON is what generate.py writes), valid
PromQL (every expression through `promtool check rules`, skipped with the reason when promtool is missing; CI fetches
it), metric names the platform and vLLM 0.32 export, and vLLM's per-request means as rate(_sum) / rate(_count).
caches.json's SQL, expanded as Grafana and its ClickHouse plugin expand it, on an embedded store with the platform's
migrations and hand-made rows of two projects: each panel shows the figures of its project's newest rows, read from
the clean hours' rollups and the rest's rows; hostile variable values change no query."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest
import yaml
from traces import ch_migrate, rollups
from traces.row_encoding import encode_rows
from traces.store import ClickHouseStore

from dashboards.grafana import caches, generate

REPO = Path(__file__).resolve().parents[2]
PROMTOOL = shutil.which("promtool")
# vLLM 0.32's metric families (../shared/VLLM_CPU.md, "Metrics seen on /metrics"), without their suffixes.
VLLM_FAMILIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:request_success", "vllm:num_preemptions", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
}
SUFFIX = re.compile(r"_(total|bucket|sum|count)$")


def _expressions(board: dict) -> list[str]:
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def _concrete(expr: str) -> str:
    return expr.replace("$project", ".*").replace("$model", ".*").replace("$engine", ".*").replace("$group", ".*")


@pytest.mark.parametrize("name", sorted(generate.BOARDS))
def test_the_committed_json_is_what_the_generator_writes(name):
    assert (REPO / "dashboards" / "grafana" / name).read_text() == generate.render(name), \
        "run: python -m dashboards.grafana.generate"


@pytest.mark.parametrize("name", sorted(generate.BOARDS))
def test_dashboard_structure(name):
    board = json.loads((REPO / "dashboards" / "grafana" / name).read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    kind, label = (("prometheus", "Prometheus") if name in generate.PROMETHEUS_BOARDS
                   else ("grafana-clickhouse-datasource", "ClickHouse"))
    assert board["templating"]["list"][0] == {"name": "datasource", "type": "datasource", "query": kind,
                                              "label": label, "current": {}}
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": kind, "uid": "${datasource}"} and panel["targets"], panel["title"]
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24


def test_platform_metric_names_exist_in_the_platform():
    source = "\n".join(p.read_text() for p in (REPO / "platform").rglob("*.py"))
    board = json.loads((REPO / "dashboards" / "grafana" / "observatory-platform.json").read_text())
    names = {SUFFIX.sub("", m) for e in _expressions(board) for m in re.findall(r"observatory_[a-z_]+", e)}
    assert names and all(f'"{name}"' in source for name in names), sorted(n for n in names if f'"{n}"' not in source)


def test_gateway_metric_names_exist_in_the_gateway():
    """Every llm_gateway_* family the gateway board reads is one the engine's gateway registers, with the labels it
    aggregates by."""
    source = "\n".join(p.read_text() for p in (REPO / "engine" / "gateway").glob("*.py"))
    board = json.loads((REPO / "dashboards" / "grafana" / "gateway.json").read_text())
    expressions = _expressions(board)
    names = {SUFFIX.sub("", m) for e in expressions for m in re.findall(r"llm_gateway_[a-z_]+", e)}
    assert {"llm_gateway_cache_requests", "llm_gateway_cache_lookups", "llm_gateway_cache_misses",
            "llm_gateway_cache_lookup_seconds", "llm_gateway_cache_entries", "llm_gateway_cache_bytes",
            "llm_gateway_cache_evictions"} <= names
    assert all(f'"{name}"' in source for name in names), sorted(n for n in names if f'"{n}"' not in source)
    for label in {label for e in expressions for by in re.findall(r"by \(([a-z_, ]+)\)", e) for label in by.split(", ")}:
        assert label == "le" or f'"{label}"' in source, label


def test_vllm_names_and_means():
    board = json.loads((REPO / "dashboards" / "grafana" / "vllm.json").read_text())
    expressions = _expressions(board)
    used = {SUFFIX.sub("", m) for e in expressions for m in re.findall(r"vllm:[a-z0-9_]+", e)}
    assert used <= VLLM_FAMILIES, used - VLLM_FAMILIES
    assert "vllm:time_per_output_token_seconds" not in json.dumps(board)  # the name vLLM removed
    for expr in expressions:
        for metric in re.findall(r"(vllm:[a-z0-9_]+)_sum", expr):
            # A mean: the rate of the sum divided by the rate of the count of the same histogram, never alone.
            assert re.search(rf"rate\({re.escape(metric)}_sum[^)]*\)\)\s*/\s*sum by \([a-z_]+\) "
                             rf"\(rate\({re.escape(metric)}_count", expr), expr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus; CI fetches it)")
@pytest.mark.parametrize("name", sorted(generate.PROMETHEUS_BOARDS))
def test_every_expression_is_valid_promql(name, tmp_path):
    board = json.loads((REPO / "dashboards" / "grafana" / name).read_text())
    rules = {"groups": [{"name": "grafana", "rules": [
        {"record": f"grafana:check:{i}", "expr": _concrete(expr)} for i, expr in enumerate(_expressions(board))]}]}
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules['groups'][0]['rules'])} rules found" in done.stdout


# -- caches.json: every panel's SQL, as Grafana and the ClickHouse plugin expand it, on a real (embedded) store ------
# The expansion, in the order it happens: the plugin's frontend replaces `$__conditionalAll(condition, $var)` by
# `1=1` when the variable is All ('$__all') or empty, else by the condition (CHDatasource.applyConditionalAll: the
# last macro first, its arguments split at top-level commas); Grafana interpolates `${var:percentencode}`
# (encodeURIComponent, plus !'()*; a list as `{a,b}` encoded); the plugin's backend expands its macros
# (pkg/macros/macros.go): $__timeFilter(c) -> `c >= toDateTime(from) AND c <= toDateTime(to)`, $__timeInterval(c)
# -> `toStartOfInterval(toDateTime(c), INTERVAL <interval s> second)`, $__fromTime / $__toTime ->
# `toDateTime(<epoch s>)`, $__interval_s -> the interval's seconds. The data source's default database holds the
# tables; here they are qualified with the test's.
ALL = "$__all"
PROJECT, OTHER = 7, 8
A, B, C = "meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "o'brien\\"  # C: a hostile name
BASE = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=8)).replace(minute=0, second=0, microsecond=0)
FROM, TO = BASE + dt.timedelta(minutes=30), BASE + dt.timedelta(hours=4)  # the first hour is cut by the range
COLUMNS = ("project_id", "trace_id", "request_key", "request_id", "start_time", "service", "model", "engine_config",
           "replica_group", "prompt_tokens", "completion_tokens", "prompt_bucket", "prefill_ms", "hops", "status",
           "version", "is_deleted", "retention_days", "cached_prompt_tokens", "served_from")
TABLES = re.compile(r"\b(llm_requests|request_rollup_hourly|request_rollup_builds|request_hour_touches)\b")


@dataclasses.dataclass(frozen=True)
class Row:
    minute: int
    model: str
    service: str
    replica_group: str
    prompt_bucket: str
    served_from: str
    prompt: int
    cached: int | None
    prefill: float | None
    project: int = PROJECT
    key: str = ""
    deleted: int = 0


ROWS = [Row(*r, key=f"r{i}") for i, r in enumerate([
    (10, A, "chat", "g1", "<1k", "engine", 1000, 1000, 100.0),  # before the range
    (40, A, "chat", "g1", "<1k", "engine", 1000, 500, 200.0),
    (70, A, "chat", "g1", "<1k", "engine", 800, 400, 160.0),
    (80, B, "agent", "g2", "<4k", "engine", 2000, 0, 900.0),
    (90, B, "agent", "g2", "<4k", "engine", 2000, None, 800.0),  # reports no cached tokens: not a miss
    (100, A, "chat", "g1", "<1k", "exact_cache", 800, None, None),
    (110, A, "chat", "g1", "<1k", "engine", 500, 0, 100.0),
    (130, C, "chat", "", "<256", "engine", 200, 100, 30.0),
    (140, A, "agent", "g2", "<4k", "engine", 3000, 1200, 600.0),
    (150, A, "agent", "g2", "<4k", "semantic_cache", 3000, None, None),
    (160, B, "chat", "g1", "<1k", "engine", 900, 0, 200.0),  # replaced by a newer version below
    (170, A, "chat", "g1", "<1k", "engine", 1000, 1000, 10.0),  # cancelled below
    (190, B, "agent", "g2", "<4k", "engine", 1000, 250, 150.0),
    (250, A, "chat", "g1", "<1k", "engine", 1000, 1000, 50.0),  # after the range
])]
NEWER = [dataclasses.replace(ROWS[10], cached=450, prefill=90.0), dataclasses.replace(ROWS[11], deleted=1)]
# Rows that arrive after their hour's rollup was built (the second and the last hour: the third stays clean).
LATE = [Row(75, B, "chat", "g1", "<1k", "engine", 400, 200, 40.0, key="late1"),
        Row(200, A, "chat", "g1", "<1k", "engine", 600, 300, 120.0, key="late2")]
# Another project's rows in every hour, model, service, group and class, all prompt tokens cached.
OTHERS = [Row(m, model, service, group, bucket, served, 700, 700 if served == "engine" else None,
              7.0 if served == "engine" else None, project=OTHER, key=f"o{m}{i}{served}")
          for m in range(15, 240, 30) for i, (model, service, group, bucket) in enumerate(
              [(A, "chat", "g1", "<1k"), (B, "agent", "g2", "<4k"), (C, "chat", "", "<256"),
               ("other/model", "batch", "g3", "<16k")]) for served in ("engine", "exact_cache")]


def _start(row: Row) -> dt.datetime:
    return BASE + dt.timedelta(minutes=row.minute)


def _insert(store, rows: list[Row], version: int) -> None:
    store.insert_encoded("llm_requests", COLUMNS, encode_rows([[
        r.project, f"{r.project:02x}{r.key:0>30}", r.key, "", _start(r).strftime("%Y-%m-%d %H:%M:%S.%f"), r.service,
        r.model, "stable", r.replica_group, r.prompt, 20, r.prompt_bucket, r.prefill, "[]", "ok", version, r.deleted,
        30, r.cached, r.served_from] for r in rows]), "JSONCompactEachRow")
    for project in {r.project for r in rows}:
        rollups.record_touches(store, project, {int(_start(r).timestamp()) // 3600 * 3600 for r in rows
                                                if r.project == project}, version)


@pytest.fixture(scope="module")
def cache_store(chdb_session_path):
    """Rows of two projects; the hourly rollups built, then late rows in two hours (their rollups now stale)."""
    store = ClickHouseStore(url=None, chdb_path=chdb_session_path, database=f"grafana_caches_{uuid.uuid4().hex[:8]}")
    ch_migrate.apply(store, log=lambda *_: None)
    store.command(f"SYSTEM STOP MERGES {store.table('llm_requests')}")  # replaced rows stay until FINAL
    version = time.time_ns()
    _insert(store, ROWS + OTHERS, version)
    _insert(store, NEWER, version + 1)
    for project in (PROJECT, OTHER):
        while rollups.build_dirty_hours(store, project, settle_seconds=0):
            pass
    # Rollup rows of the other project with our hours and build versions (two projects' builds may share a
    # version), their prompt tokens all cached: only the project filter keeps them out.
    table = store.table("request_rollup_hourly")
    store.tenant_command(f"INSERT INTO {table} SELECT * REPLACE ({OTHER} AS project_id, 'copy' AS engine_config, "
                         f"sum_reported_prompt_tokens AS sum_cached_prompt_tokens) FROM {table} AS r "
                         "WHERE r.project_id = {project_id:UInt32}", project_id=PROJECT)
    _insert(store, LATE, version + 2)
    # Then the other project's last hour is rebuilt after a late row of its own: clean for it, not for us.
    _insert(store, [dataclasses.replace(OTHERS[-1], key="olate")], version + 3)
    while rollups.build_dirty_hours(store, OTHER, settle_seconds=0):
        pass
    yield store
    store.command(f"DROP DATABASE IF EXISTS `{store.database}` SYNC")
    store.close()


def _macro_args(sql: str, start: int) -> list[str]:
    args, depth, last = [], 0, 1
    for match in re.finditer(r"[(),]", sql[start:]):
        depth += {"(": 1, ")": -1}.get(match.group(0), 0)
        if match.group(0) == "," and depth == 1 or depth == 0:
            args.append(sql[start:][last:match.end() - 1])
            last = match.end()
        if depth == 0:
            return args
    return []


def expand(sql: str, store, variables: dict, interval: int, tables: dict | None = None) -> str:
    """`sql` as ClickHouse receives it from Grafana and the plugin (the comment above), over [FROM, TO]."""
    macro = "$__conditionalAll("
    while (at := sql.rfind(macro)) != -1:
        condition, var = _macro_args(sql, at + len(macro) - 1)
        value = variables[re.search(r"(?<=\$\{)\w+(?=\})|(?<=\$)\w+", var.strip()).group(0)]
        text = ",".join(value) if isinstance(value, list) else value
        sql = sql.replace(f"{macro}{condition},{var})", "1=1" if text in ("", ALL) else condition, 1)

    def variable(match):
        name, fmt = match.group(1) or match.group(3), match.group(2)
        if name not in variables:
            return match.group(0)  # $__ macros: the backend's
        assert fmt == "percentencode", match.group(0)  # the only format the board uses
        value = variables[name]
        return urllib.parse.quote("{" + ",".join(value) + "}" if isinstance(value, list) else value, safe="")

    sql = re.sub(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)", variable, sql)
    start, end = int(FROM.timestamp()), int(TO.timestamp())
    macros = {"fromTime": lambda: f"toDateTime({start})", "toTime": lambda: f"toDateTime({end})",
              "interval_s": lambda: str(interval),
              "timeFilter": lambda c: f"{c} >= toDateTime({start}) AND {c} <= toDateTime({end})",
              "timeInterval": lambda c: f"toStartOfInterval(toDateTime({c}), INTERVAL {interval} second)"}
    sql = re.sub(r"\$__(\w+)(?:\(([^()]*)\))?", lambda m: macros[m.group(1)](*filter(None, [m.group(2)])), sql)
    tables = {name: store.table(name) for name in ("llm_requests", "request_rollup_hourly", "request_rollup_builds",
                                                   "request_hour_touches")} | (tables or {})
    return TABLES.sub(lambda m: tables[m.group(1)], sql)


def run(store, sql: str, variables: dict, interval: int, tables: dict | None = None) -> list[tuple]:
    """The rows of `sql` (Grafana's data source runs it as it is: nothing bound), times as epoch seconds."""
    rows = store.system_query(expand(sql, store, variables, interval, tables))
    return [tuple(int(v.replace(tzinfo=dt.timezone.utc).timestamp()) if isinstance(v, dt.datetime) else v
                  for v in row) for row in rows]


def _visible(rows: list[Row]) -> list[Row]:
    """The project's rows in [FROM, TO], newest version, none cancelled (what FINAL reads)."""
    newest = {r.key: r for r in rows}
    return [r for r in newest.values() if r.project == PROJECT and not r.deleted and FROM <= _start(r) <= TO]


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def expected(panel: dict, interval: int, chosen) -> dict:
    """What a panel shows for the rows `chosen` keeps: {(bucket start?, name?): figures}, computed from ROWS."""
    rows = [r for r in _visible(ROWS + OTHERS + NEWER + LATE) if chosen(r)]
    timed = panel["type"] == "timeseries"
    dimension = next((c for c, label in caches.DIMENSIONS.items() if f"by {label.lower()}" in panel["title"]), None)
    cells: dict[tuple, list[Row]] = {}
    for r in rows:
        bucket = (int(_start(r).timestamp()) // interval * interval,) if timed else ()
        cells.setdefault(bucket + ((getattr(r, dimension) or "(unknown)",) if dimension else ()), []).append(r)
    out = {}
    for cell, members in cells.items():
        if panel["title"].startswith("Share"):
            out[cell] = tuple(sum(r.served_from == s for r in members) / len(members) for s in caches.SERVED_FROM)
            continue
        engine = [r for r in members if r.served_from == "engine"]
        reporting = [r for r in engine if r.cached is not None]
        tokens = _ratio(sum(r.cached for r in reporting), sum(r.prompt for r in reporting))
        requests = _ratio(sum(r.cached > 0 for r in reporting), len(reporting))
        known = [r for r in reporting if r.prefill is not None and r.cached <= r.prompt]
        prefill = _ratio(sum(r.prefill for r in known), sum(r.prompt - r.cached for r in known))
        if not engine or (dimension and not reporting):
            continue
        out[cell] = ((prefill,) if panel["title"].startswith("Prefill") else (tokens,) if timed and dimension
                     else (tokens, requests))
    return out


def _same(got: tuple, want: tuple) -> bool:
    return len(got) == len(want) and all(g is w is None or None not in (g, w) and g == pytest.approx(w, rel=1e-9)
                                         for g, w in zip(got, want))


def _as_figures(rows: list[tuple]) -> dict:
    """{key columns: value columns}: the leading int/str columns are the key."""
    split = next(i for i, v in enumerate(rows[0]) if not isinstance(v, (int, str))) if rows else 0
    return {row[:split]: row[split:] for row in rows}


CACHE_BOARD = caches.caches_board()
CACHE_PANELS = [p for p in CACHE_BOARD["panels"] if p["type"] != "row"]


def _tokens(store, column: str, names: list[str]) -> list[str]:
    """The values of the board's `column` variable whose text is one of `names` (the variable's own query)."""
    [query] = [v["query"] for v in CACHE_BOARD["templating"]["list"] if v["name"] == column]
    options = dict((text, value) for value, text in run(store, query, {"project_id": str(PROJECT)}, 3600))
    return [options[name] for name in names]


@pytest.mark.parametrize("interval", [3600, 900])
@pytest.mark.parametrize("selection", ["all", "some"])
def test_every_caches_panel_shows_the_rows_figures(cache_store, interval, selection):
    """Hourly buckets read the clean hour's rollups (the third) and the rows of the rest (the range's first half
    hour, the hours whose rollups late rows made stale); 15-minute buckets read every row. Either way each panel
    equals the figures of the project's newest rows, whatever the other project holds."""
    variables = {"project_id": str(PROJECT), "model": [ALL], "service": [ALL], "replica_group": [ALL]}
    chosen = lambda r: True  # noqa: E731
    if selection == "some":
        variables |= {"model": _tokens(cache_store, "model", [A, C]),
                      "replica_group": _tokens(cache_store, "replica_group", ["", "g1"])}
        chosen = lambda r: r.model in (A, C) and r.replica_group in ("", "g1")  # noqa: E731
    for panel in CACHE_PANELS:
        got = _as_figures(run(cache_store, panel["targets"][0]["rawSql"], variables, interval))
        want = expected(panel, interval, chosen)
        assert want and sorted(got) == sorted(want), panel["title"]
        for cell, figures in want.items():
            assert _same(got[cell], figures), (panel["title"], cell, got[cell], figures)


def test_a_models_hit_ratios_by_hand(cache_store):
    """Model A over the range: cached / prompt tokens of its engine rows that report them (the row before the range,
    the one after it and the cancelled one left out; the late one in) = (500 + 400 + 0 + 1200 + 300) / (1000 + 800 +
    500 + 3000 + 600); requests with a hit: 4 of 5."""
    [panel] = [p for p in CACHE_PANELS if p["title"].startswith("Hit ratios by model")]
    figures = _as_figures(run(cache_store, panel["targets"][0]["rawSql"], {
        "project_id": str(PROJECT), "model": ALL, "service": ALL, "replica_group": ALL}, 3600))
    assert figures[(A,)] == pytest.approx((2400 / 5900, 0.8))
    # B: the newer version's 450, not the replaced 0; the late row's 200 of 400.
    assert figures[(B,)] == pytest.approx(((0 + 450 + 250 + 200) / (2000 + 900 + 1000 + 400), 3 / 4))


def test_clean_hours_come_from_the_rollups(cache_store):
    """With the rows hidden, hourly buckets still show the clean hour (its rollups); 15-minute ones show nothing."""
    cache_store.command(f"CREATE TABLE IF NOT EXISTS {cache_store.table('no_rows')} AS {cache_store.table('llm_requests')}")
    hidden = {"llm_requests": cache_store.table("no_rows")}
    variables = {"project_id": str(PROJECT), "model": ALL, "service": ALL, "replica_group": ALL}
    clean = lambda r: 120 <= r.minute < 180  # noqa: E731
    for panel in CACHE_PANELS:
        sql = panel["targets"][0]["rawSql"]
        want = expected(panel, 3600, clean)
        if panel["type"] == "timeseries":
            assert _as_figures(run(cache_store, sql, variables, 3600, hidden)).keys() == want.keys(), panel["title"]
            assert run(cache_store, sql, variables, 900, hidden) == [], panel["title"]
        else:  # over the range: whole clean hours from the rollups at any interval
            got = _as_figures(run(cache_store, sql, variables, 900, hidden))
            assert got.keys() == want.keys() and all(_same(got[k], v) for k, v in want.items()), panel["title"]


def test_variables_list_the_projects_values_and_hostile_values_reach_no_sql(cache_store):
    options = run(cache_store, CACHE_BOARD["templating"]["list"][2]["query"], {"project_id": str(PROJECT)}, 3600)
    assert sorted(text for _value, text in options) == sorted([A, B, C])  # not the other project's "other/model"
    [panel] = [p for p in CACHE_PANELS if p["title"].startswith("Hit ratios by model")]
    hostile = ["') OR 1=1 --", "x\\", "', '" + _tokens(cache_store, "model", [B])[0]]  # as a crafted URL might set
    rows = run(cache_store, panel["targets"][0]["rawSql"], {"project_id": str(PROJECT), "model": hostile,
                                                             "service": ALL, "replica_group": ALL}, 3600)
    assert [row[0] for row in rows] == [B]  # only the one well-formed token inside the third value matched
    with pytest.raises(Exception, match="(?i)cannot parse|syntax"):
        run(cache_store, panel["targets"][0]["rawSql"], {"project_id": "7 OR 1=1", "model": ALL, "service": ALL,
                                                         "replica_group": ALL}, 3600)
