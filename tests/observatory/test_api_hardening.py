"""API and auth hardening, against a live platform: one test per defect found by the attack on `make up`
(issue 19), each answer checked as a client sees it.

- bad input is a 400 naming the field and the reason, never a 500 (Unicode digits, overflowing durations,
  lone surrogates, NUL);
- /metrics: process and ingest series open, per-SLO series only with a token, only its projects';
- repeated bad API tokens from one address: 429 with Retry-After for bad tokens only, never for a valid one;
- /api/v1/engine: viewers see models and states, admins the internals;
- delivery answers only for admins;
- token lifetime: expiry at creation, an expired token's 401 says so, last use recorded, list and revoke.
"""
from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request

import pytest
from otlp_live_helpers import metrics_text
from prometheus_client.parser import text_string_to_metric_families


def call(platform, method: str, path: str, token: str | None, body=None, raw: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, JSON answer, headers) of one API call."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(platform.url + path, data=data, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text, headers = response.status, response.read(), response.headers
    except urllib.error.HTTPError as exc:
        status, text, headers = exc.code, exc.read(), exc.headers
    answer_headers = {name.lower(): value for name, value in headers.items()}
    assert answer_headers.get("content-type", "").startswith("application/json"), (status, text[:300])
    return status, (json.loads(text) if text else {}), answer_headers


@pytest.fixture(scope="module")
def tokens(live_platform):
    manage = live_platform.process.manage
    return {
        "viewer": live_platform.tokens["alice"],
        "operator": manage("create_api_token", "--user", "olga", "--role", "operator", "--project", "alpha"),
        "admin": manage("create_api_token", "--user", "adam", "--role", "admin", "--project", "alpha"),
    }


@pytest.fixture(scope="module")
def slo(live_platform, tokens):
    status, body, _ = call(live_platform, "POST", "/api/v1/slos", tokens["operator"],
                           {"name": "hardening-ttft", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99%"})
    assert status == 201, body
    return body["name"]


def assert_400_naming(status: int, body: dict, field: str) -> None:
    assert status == 400, body
    assert field in body["error"], body
    assert any(p["field"].split(".")[0] == field.split(".")[0] for p in body.get("problems", [])), body


# -- 400 instead of 500 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["²", "₂", "٣", "１", "+5", " 5", "1_0", "5.0", "-1", "0", "99999999999999999999"])
def test_a_limit_that_is_not_ascii_digits_in_bounds_is_400(live_platform, tokens, slo, value):
    for path in ("/api/v1/alerts", "/api/v1/silences", f"/api/v1/slos/{slo}/history"):
        status, body, _ = call(live_platform, "GET", f"{path}?limit={urllib.parse.quote(value)}", tokens["viewer"])
        assert_400_naming(status, body, "limit")


@pytest.mark.parametrize("window", ["1000000000d", "99999999999999999999d", "91d", "0m", "5x", "1.5h", "-1h"])
def test_a_series_window_out_of_bounds_is_400(live_platform, tokens, slo, window):
    status, body, _ = call(live_platform, "GET", f"/api/v1/slos/{slo}?series={urllib.parse.quote(window)}",
                           tokens["viewer"])
    assert_400_naming(status, body, "series")


@pytest.mark.parametrize("field, tier_change", [
    ("tiers", {"long_window": "99999999999999999999d"}),
    ("tiers", {"short_window": "99999999999999999999d"}),
])
def test_an_overflowing_tier_window_is_400(live_platform, tokens, field, tier_change):
    tier = {"name": "page-1h", "severity": "page", "long_window": "1h", "short_window": "5m", "factor": 14.4,
            **tier_change}
    status, body, _ = call(live_platform, "POST", "/api/v1/slos", tokens["operator"],
                           {"name": "overflow", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99.9%",
                            "tiers": [tier]})
    assert_400_naming(status, body, field)


def test_an_overflowing_repeat_interval_is_400(live_platform, tokens):
    status, body, _ = call(live_platform, "POST", "/api/v1/slos", tokens["operator"],
                           {"name": "overflow", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99.9%",
                            "repeat_interval": "99999999999999999999d"})
    assert_400_naming(status, body, "repeat_interval")


LONE_SURROGATE = b'"x\\ud800y"'  # valid JSON text, not valid Unicode


@pytest.mark.parametrize("case", ["slo_description", "silence_comment", "channel_name"])
def test_a_lone_surrogate_is_400_not_500(live_platform, tokens, case):
    if case == "slo_description":
        raw = b'{"name": "surrogate", "sli": "ttft_ms", "threshold_ms": 500, "objective": "99%", "description": ' \
              + LONE_SURROGATE + b"}"
        status, body, _ = call(live_platform, "POST", "/api/v1/slos", tokens["operator"], raw=raw)
        assert_400_naming(status, body, "description")
    elif case == "silence_comment":
        raw = b'{"matchers": ["severity=page"], "duration": "1h", "comment": ' + LONE_SURROGATE + b"}"
        status, body, _ = call(live_platform, "POST", "/api/v1/silences", tokens["operator"], raw=raw)
        assert_400_naming(status, body, "comment")
    else:
        raw = b'{"kind": "webhook", "url": "https://hooks.example.com/x", "name": ' + LONE_SURROGATE + b"}"
        status, body, _ = call(live_platform, "POST", "/api/v1/channels", tokens["admin"], raw=raw)
        assert_400_naming(status, body, "name")
    assert "surrogate" in body["error"]


@pytest.mark.parametrize("name", ["a\u0000b", "bell\u0007", "line\nbreak"])
def test_nul_and_control_characters_in_a_channel_name_are_400(live_platform, tokens, name):
    status, body, _ = call(live_platform, "POST", "/api/v1/channels", tokens["admin"],
                           {"kind": "webhook", "url": "https://hooks.example.com/x", "name": name})
    assert_400_naming(status, body, "name")


def test_problems_name_each_field_and_where_it_is(live_platform, tokens):
    status, body, _ = call(live_platform, "POST", "/api/v1/slos?project=alpha", tokens["operator"],
                           {"name": "Not A Slug", "sli": "ttft_ms", "objective": 2, "min_requests": "20"})
    assert status == 400
    fields = {(p["field"], p["location"]) for p in body["problems"]}
    assert {("name", "body"), ("objective", "body"), ("threshold_ms", "body"), ("min_requests", "body")} <= fields, body
    assert all(p["reason"] for p in body["problems"])
    # The SLI picks the form of the body: an unknown one is the one problem reported.
    status, body, _ = call(live_platform, "POST", "/api/v1/slos?project=alpha", tokens["operator"],
                           {"name": "x", "sli": "latency", "objective": "99%"})
    assert status == 400 and [(p["field"], p["location"]) for p in body["problems"]] == [("sli", "body")], body
    assert "ttft_ms" in body["problems"][0]["reason"]


def test_an_unknown_field_is_400_naming_it(live_platform, tokens):
    status, body, _ = call(live_platform, "POST", "/api/v1/silences", tokens["operator"],
                           {"matchers": ["severity=page"], "duration": "1h", "comment": "x", "colour": "red"})
    assert_400_naming(status, body, "colour")


# -- /metrics --------------------------------------------------------------------------------------------------
def test_metrics_serve_slo_series_only_with_a_token_and_only_its_projects(live_platform, tokens, slo):
    beta_token = live_platform.tokens["bob"]
    status, body, _ = call(live_platform, "POST", "/api/v1/slos?project=beta",
                           live_platform.process.manage("create_api_token", "--user", "bert", "--role", "operator",
                                                        "--project", "beta"),
                           {"name": "beta-errors", "sli": "error_ratio", "objective": "99%"})
    assert status == 201, body
    open_text = metrics_text(live_platform.process)
    assert "observatory_spans_accepted_total" in open_text and "process_cpu_seconds_total" in open_text
    assert "observatory_slo_objective_ratio" not in open_text and 'project="' not in open_text

    def scrape(token: str) -> tuple[int, str]:
        request = urllib.request.Request(live_platform.url + "/metrics", headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def objectives(text: str) -> dict[tuple[str, str], float]:
        return {(sample.labels["project"], sample.labels["slo"]): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == "observatory_slo_objective_ratio"}

    status, alpha_text = scrape(tokens["viewer"])
    assert status == 200 and "observatory_spans_accepted_total" in alpha_text
    assert objectives(alpha_text) == {("alpha", slo): 0.99}
    status, beta_text = scrape(beta_token)
    assert objectives(beta_text) == {("beta", "beta-errors"): 0.99}
    status, wrong = scrape("lot_not-a-token")
    assert status == 401 and "invalid API token" in wrong


# -- /api/v1/engine --------------------------------------------------------------------------------------------
def test_engine_internals_need_an_admin(live_platform, tokens):
    status, viewer, _ = call(live_platform, "GET", "/api/v1/engine", tokens["viewer"])
    assert status == 200 and viewer["detail"] == "summary", viewer
    flat = json.dumps(viewer)
    for secret in ("pid", "argv", "run_dir", "port", "log", "control_url", "url"):
        assert f'"{secret}"' not in flat, (secret, viewer)
    status, admin, _ = call(live_platform, "GET", "/api/v1/engine", tokens["admin"])
    assert status == 200 and admin["detail"] == "full", admin


# -- token lifetime --------------------------------------------------------------------------------------------
def test_tokens_expire_say_so_record_their_last_use_and_can_be_listed_and_revoked(live_platform):
    manage = live_platform.process.manage
    token = manage("create_api_token", "--user", "tess", "--role", "viewer", "--project", "alpha",
                   "--expires-in", "30d", "--name", "ci")
    status, _, _ = call(live_platform, "GET", "/api/v1/slos", token)
    assert status == 200
    listing = manage("list_api_tokens", "--user", "tess")
    [row] = [line.split() for line in listing.splitlines() if line.startswith(token[:12])]
    # PREFIX USER ROLE NAME STATE CREATED(date time) LAST-USED(date time) EXPIRES(date time)
    assert row[1:5] == ["tess", "viewer", "ci", "active"], row
    assert row[7] != "-", row  # the use above is recorded (to the minute)
    assert row[9] != "never", row
    # Expire it (as if 30 days had passed): the 401 says it expired, and when.
    manage("shell", "-c", "from tenancy.models import ApiToken; from django.utils import timezone; import datetime; "
                          f"ApiToken.objects.filter(display_prefix='{token[:12]}').update("
                          "expires_at=timezone.now() - datetime.timedelta(seconds=1))")
    status, body, _ = call(live_platform, "GET", "/api/v1/slos", token)
    assert status == 401 and "expired at" in body["error"], body
    assert "expired" in manage("list_api_tokens", "--user", "tess")
    other = manage("create_api_token", "--user", "tess", "--role", "viewer", "--project", "alpha")
    assert "revoked API token" in manage("revoke_api_token", other[:12])
    status, body, _ = call(live_platform, "GET", "/api/v1/slos", other)
    assert status == 401
    with pytest.raises(subprocess.CalledProcessError) as info:
        manage("create_api_token", "--user", "tess", "--expires-in", "99999999999999999999d")
    assert "--expires-in" in info.value.stderr


# -- throttling of bad tokens ----------------------------------------------------------------------------------
def test_bad_tokens_are_throttled_per_address_and_never_lock_out_a_valid_token(fresh_platform_factory):
    """The default limit (20 failures a minute): the 21st bad token from one address gets 429 with Retry-After, and a
    valid token from that same address (a shared NAT, a proxy left untrusted) is still answered 200. Behind one
    trusted proxy, the address is X-Forwarded-For's: one client's failures neither block another client nor its
    own valid token."""
    platform = fresh_platform_factory(extra_env={"API_AUTH_FAILURE_LIMIT": "20", "API_AUTH_COOLOFF_SECONDS": "60",
                                                 "OBSERVATORY_TRUSTED_PROXIES": "1"})
    good = platform.tokens["alice"]

    def statuses(token_prefix: str, count: int, headers: dict | None = None) -> list[int]:
        return [call(platform, "GET", "/api/v1/slos", f"{token_prefix}{i}", headers=headers)[0] for i in range(count)]

    # Direct (no X-Forwarded-For: the socket's address, 127.0.0.1).
    assert statuses("lot_wrong", 20) == [401] * 20
    status, body, headers = call(platform, "GET", "/api/v1/slos", "lot_wrong-21st")
    assert status == 429 and 1 <= int(headers["retry-after"]) <= 60, (status, body, headers)
    assert "127.0.0.1" in body["error"], body
    assert statuses("lot_more", 4) == [429] * 4  # 25 bad tokens in all
    assert call(platform, "GET", "/api/v1/slos", good)[0] == 200
    assert call(platform, "GET", "/api/v1/slos", None)[0] == 429  # no token at all is a bad attempt too

    # Through the trusted proxy: client 203.0.113.7 fails 25 times; 203.0.113.8 is not affected.
    noisy, quiet = {"X-Forwarded-For": "203.0.113.7"}, {"X-Forwarded-For": "203.0.113.8"}
    assert statuses("lot_proxied", 20, noisy) == [401] * 20
    status, body, headers = call(platform, "GET", "/api/v1/slos", "lot_proxied-21st", headers=noisy)
    assert status == 429 and int(headers["retry-after"]) >= 1 and "203.0.113.7" in body["error"], body
    assert statuses("lot_proxied-more", 4, noisy) == [429] * 4
    assert call(platform, "GET", "/api/v1/slos", good, headers=noisy)[0] == 200
    assert call(platform, "GET", "/api/v1/slos", "lot_other-client", headers=quiet)[0] == 401
    assert call(platform, "GET", "/api/v1/slos", good, headers=quiet)[0] == 200
