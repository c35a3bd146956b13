"""Validating SLO definitions: the same rules for YAML, the API and the admin, with messages that say what to fix."""
from __future__ import annotations

import hashlib

import pytest
from slo import definitions
from slo.definitions import DefinitionError, validate
from slo.models import sli_key

BASE = {"name": "chat-ttft", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99%"}


def problems_of(data) -> list[str]:
    with pytest.raises(DefinitionError) as info:
        validate(data)
    return info.value.problems


def test_a_minimal_definition_gets_documented_defaults():
    fields = validate(BASE)
    assert fields == {
        "name": "chat-ttft", "description": "", "sli": "ttft_ms", "threshold_ms": 500.0, "threshold": None,
        "objective": 0.99, "period_days": 30, "filters": {}, "include_cached": False, "tiers": [], "min_requests": 20,
        "min_bad": 3, "no_data": "ok", "repeat_interval_seconds": 4 * 3600, "labels": {}, "enabled": True,
    }


@pytest.mark.parametrize(("written", "value"), [
    (0.99, 0.99), ("0.99", 0.99), ("99%", 0.99), ("99.9%", 0.999), (" 99.95 % ", 0.9995), ("95%", 0.95),
])
def test_objective_forms(written, value):
    assert validate({**BASE, "objective": written})["objective"] == value


@pytest.mark.parametrize(("written", "message"), [
    (99, "must be a fraction below 1 (0.99) or a percentage string ('99%')"),
    (1, "must be a fraction below 1"),
    ("100%", "above 0% and below 100%"),
    (0, "above 0% and below 100%"),
    ("-5%", "above 0% and below 100%"),
    ("ninety", "neither a fraction (0.99) nor a percentage"),
    (None, "objective is required"),
    (True, "objective is required"),
    ("99.99999%", "at most 99.9999%"),
])
def test_objective_errors(written, message):
    [problem] = problems_of({**BASE, "objective": written})
    assert problem.startswith("objective: ") and message in problem


def test_90_percent_slo_with_default_tiers_is_refused_with_the_reason():
    [problem] = problems_of({**BASE, "objective": "90%"})
    assert "objective 90% leaves an error budget of 10%" in problem
    assert "tier page-1h (14.4× over 1h, 2.0% of the 30-day budget) can never fire" in problem
    assert "needs 14.4 × 10% = 144% of requests to be bad, and at most 100% can be" in problem
    assert "The default tiers include it: list your own `tiers:` without it" in problem
    assert "raise the objective above 93.0556%" in problem


def test_90_percent_slo_with_feasible_tiers_is_accepted():
    tiers = [
        {"name": "page-6h", "severity": "page", "long_window": "6h", "short_window": "30m", "factor": 6},
        {"name": "ticket-3d", "severity": "ticket", "long_window": "3d", "short_window": "6h", "factor": 1},
    ]
    fields = validate({**BASE, "objective": "90%", "tiers": tiers})
    assert [t["name"] for t in fields["tiers"]] == ["page-6h", "ticket-3d"]
    assert fields["tiers"][0] == {"name": "page-6h", "severity": "page", "long_window": "6h",
                                  "short_window": "30m", "factor": 6.0}


def test_the_default_tiers_written_out_are_the_defaults():
    from slo.burn import DEFAULT_TIERS

    assert validate({**BASE, "tiers": [t.as_dict() for t in DEFAULT_TIERS]})["tiers"] == []
    assert validate({**BASE, "tiers": "default"})["tiers"] == []


def test_an_explicit_infeasible_tier_is_named():
    tiers = [{"name": "fast", "severity": "page", "long_window": "1h", "short_window": "5m", "factor": 30}]
    [problem] = problems_of({**BASE, "objective": "96%", "tiers": tiers})
    assert "tier fast (30× over 1h" in problem and "Drop this tier" in problem
    assert "needs 30 × 4% = 120% of requests" in problem and "lower its factor to at most 25" in problem


@pytest.mark.parametrize(("tiers", "message"), [
    ([], "'default' or a list of 1 to 8 tiers"),
    ("fast", "'default' or a list"),
    ([{"name": "a", "severity": "pager", "long_window": "1h", "short_window": "5m", "factor": 2}],
     "tiers[0].severity: page or ticket"),
    ([{"name": "a", "severity": "page", "long_window": "5m", "short_window": "1h", "factor": 2}],
     "short_window must be shorter than long_window"),
    ([{"name": "a", "severity": "page", "long_window": "1x", "short_window": "5m", "factor": 2}],
     "tiers[0].long_window: a window is written like 5m, 1h or 3d"),
    ([{"name": "a", "severity": "page", "long_window": "1h", "short_window": "5m", "factor": 0}],
     "tiers[0].factor: a burn rate > 0"),
    ([{"name": "a", "severity": "page", "long_window": "1h", "short_window": "5m", "factor": 2},
      {"name": "a", "severity": "ticket", "long_window": "1d", "short_window": "2h", "factor": 1}],
     "'a' is used twice"),
    ([{"name": "a", "severity": "page", "long_window": "1h", "short_window": "5m", "factor": 2, "for": "5m"}],
     "tiers[0]: unknown field(s) for"),
    ([{"name": "a", "severity": "ticket", "long_window": "31d", "short_window": "1d", "factor": 1}],
     "windows of at most 30d"),
])
def test_tier_errors(tiers, message):
    problems = problems_of({**BASE, "tiers": tiers})
    assert any(message in p for p in problems), problems


def test_long_window_beyond_a_28_day_period_is_refused():
    tiers = [{"name": "slow", "severity": "ticket", "long_window": "30d", "short_window": "1d", "factor": 1}]
    problems = problems_of({**BASE, "period": "28d", "tiers": tiers})
    assert any("longer than the period (28d)" in p for p in problems)


@pytest.mark.parametrize(("change", "message"), [
    ({"sli": "latency"}, "sli: one of ttft_ms, tpot_ms, e2e_ms, queue_ms, error_ratio"),
    ({"threshold_ms": None}, "threshold_ms: sli ttft_ms needs a latency threshold in milliseconds > 0"),
    ({"threshold_ms": -1}, "needs a latency threshold"),
    ({"threshold_ms": "500ms"}, "needs a latency threshold"),
    ({"sli": "error_ratio"}, "error_ratio counts failed requests and takes no threshold"),
    ({"period": "7d"}, "period: period must be 28d or 30d"),
    ({"period": 31}, "28d or 30d"),
    ({"name": "Chat TTFT"}, "name: a slug"),
    ({"name": None}, "name: a slug"),
    ({"filters": {"region": "eu"}}, "filters: unknown key 'region'"),
    ({"filters": {"service": []}}, "filters.service: a non-empty string or a list"),
    ({"filters": {"prompt_bucket": "<2k"}}, "'<2k' is not a bucket; buckets are <256, <1k, <4k, <16k, >=16k, unknown"),
    ({"filters": ["service"]}, "filters: a mapping"),
    ({"no_data": "ignore"}, "no_data: one of ok, keep, alert"),
    ({"min_requests": -1}, "min_requests: a whole number"),
    ({"min_bad": 2.5}, "min_bad: a whole number"),
    ({"repeat_interval": "30s"}, "repeat_interval: a window is written like"),
    ({"repeat_interval": "30d"}, "repeat_interval: between 1m and 7d"),
    ({"labels": {"severity": "high"}}, "labels: at most 20"),
    ({"labels": {"team": 5}}, "labels: at most 20"),
    ({"enabled": "yes"}, "enabled: true or false"),
    ({"include_cached": "yes"}, "include_cached: true (also count requests the gateway's response cache answered)"),
    ({"include_cached": 1}, "include_cached: true"),
    ({"objectiv": "99%"}, "unknown field(s) 'objectiv'"),
])
def test_field_errors(change, message):
    problems = problems_of({**BASE, **change})
    assert any(message in p for p in problems), problems


def test_every_problem_is_reported_at_once():
    problems = problems_of({"name": "x", "sli": "ttft_ms", "objective": "150%", "period": "1d", "no_data": "?"})
    assert len(problems) == 4
    assert [p.split(":")[0] for p in problems] == ["threshold_ms", "objective", "period", "no_data"]


def test_filters_are_normalised_to_sorted_lists():
    fields = validate({**BASE, "filters": {"model": ["b", "a", "a"], "service": "chat-app"}})
    assert fields["filters"] == {"model": ["a", "b"], "service": ["chat-app"]}
    fields = validate({**BASE, "filters": {"replica_group": "canary", "engine_config": ["cfg-b", "cfg-a"]}})
    assert fields["filters"] == {"engine_config": ["cfg-a", "cfg-b"], "replica_group": ["canary"]}


def test_counting_response_cache_hits_is_its_own_series_and_engine_only_keeps_its_key():
    """include_cached changes what is counted, so it changes the SLI key; an engine-only SLI keeps the key it had
    before response caches existed (its buckets of old rows, all engine-served, stay valid)."""
    assert validate({**BASE, "include_cached": True})["include_cached"] is True
    filters = {"service": ["chat"]}
    before = int.from_bytes(hashlib.blake2b(
        b'{"filters":{"service":["chat"]},"sli":"ttft_ms","threshold_ms":500.0}', digest_size=8).digest(), "big") >> 1
    assert sli_key("ttft_ms", 500.0, filters) == sli_key("ttft_ms", 500.0, filters, False) == before
    assert sli_key("ttft_ms", 500.0, filters, True) != before


def test_not_a_mapping():
    with pytest.raises(DefinitionError, match="an SLO definition is a mapping"):
        validate(["name", "x"])


def test_objective_formatting():
    assert definitions.format_objective(0.999) == "99.9%"
    assert definitions.format_objective(0.99) == "99%"
    assert definitions.format_objective(0.9995) == "99.95%"
