"""The web dashboard in a real browser: Playwright driving Debian's Chromium (the system executable) against a live
platform running the simulated engine with background load (two replica groups), as `make up` does.

Screenshots of every page go to $OBSERVATORY_SCREENSHOTS (default: the test's temporary directory)."""
from __future__ import annotations

import http.server
import json
import os
import threading
import time
import urllib.parse
import uuid

import pytest
from benchkit.payloads import add_attribute
from browser_support import BrowserSession, dashboard_password
from fleet_support import open_fleet_platform
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from otlp_live_helpers import post_traces

# Pages in a browser: run in one CI suite (tests/conftest.py).
pytestmark = pytest.mark.one_suite(suite="embedded")

MS = 1_000_000


class Receiver:
    """A webhook destination: records what it is sent."""

    def __init__(self):
        received = self.received = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                received.append({"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.fixture(scope="module")
def dash(tmp_path_factory, playwright_api, receiver):  # playwright_api: no platform started without a browser
    logins = {"ops": ("default", "operator"), "viewer": ("default", "viewer"), "admin": ("default", "admin"),
              "outsider": ("other", "viewer")}
    # The platform's own fleet (two groups) with a load of 4 req/s, as `make up` runs it; in server mode a
    # PostgreSQL database of its own (the users created here must be new).
    with open_fleet_platform(
            tmp_path_factory.mktemp("dash"), groups=None, args=("--load", "4"), tokens=(("api", "admin"),),
            setup=(*(("dashboard_login", "--user", user, "--project", project, "--role", role)
                     for user, (project, role) in logins.items()),
                   ("dashboard_login", "--user", "ops", "--project", "other", "--role", "viewer")),
            start_timeout=120,
            # SLOs evaluated every 2 s and a page firing 1 s after it became pending: an alert within seconds.
            # Engine models: calibrated from 40 requests, their live error measured every 5 s.
            env={"SLO_EVALUATE_INTERVAL_SECONDS": "2", "ALERTS_PAGE_FOR_SECONDS": "1",
                 "TUNING_CALIBRATION_MIN_REQUESTS": "40", "TUNING_MODEL_LIVE_MIN_REQUESTS": "20",
                 "TUNING_CALIBRATION_CHECK_SECONDS": "5",
                 "NOTIFY_ALLOW_PRIVATE_DESTINATIONS": f"127.0.0.1:{receiver.port}"}) as platform:
        process = platform.process
        passwords = {user: dashboard_password(output) for user, output in zip(logins, platform.outputs)}
        _wait_for_both_groups(process, platform.token)
        yield {"process": process, "keys": platform.keys, "token": platform.token, "passwords": passwords,
               "url": process.url}


def _wait_for_both_groups(process, token: str) -> None:
    since = urllib.parse.quote(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 600)))
    deadline = time.monotonic() + 120
    groups: set = set()
    while time.monotonic() < deadline:
        status, body = process.get(f"/api/v1/latency/summary?group_by=replica_group&since={since}&project=default",
                                   token)
        assert status == 200, body
        groups = {g["key"]["replica_group"] for g in body["groups"] if g["count"] >= 3}
        if {"baseline", "canary"} <= groups:
            return
        time.sleep(1)
    raise AssertionError(f"no traffic in both groups: {groups}\n{process.log_tail()}")


@pytest.fixture
def ops(browser, dash):
    session = BrowserSession(browser, dash["url"])
    session.login("ops", dash["passwords"]["ops"])
    yield session
    assert session.errors == [], session.errors
    session.close()


def _api(dash, path: str):
    status, body = dash["process"].get(path, dash["token"])
    assert status == 200, body
    return body


# -- login and projects --------------------------------------------------------------------------------------
def test_a_logged_out_visitor_is_sent_to_the_login_page_and_a_wrong_password_is_refused(browser, dash, shots):
    session = BrowserSession(browser, dash["url"])
    for path in ("/", "/requests/", "/traces/" + "0" * 32):
        session.goto(path)
        assert urllib.parse.urlparse(session.page.url).path == "/accounts/login/", session.page.url
    session.page.screenshot(path=str(shots / "login.png"))
    session.login("ops", "not the password", expect_ok=False)
    assert session.page.locator("[role=alert]").inner_text().startswith("Please enter a correct")
    cookies = {c["name"]: c for c in session.context.cookies()}
    assert cookies["csrftoken"]["sameSite"] == "Lax"
    session.login("ops", dash["passwords"]["ops"])
    session_cookie = {c["name"]: c for c in session.context.cookies()}["sessionid"]
    assert session_cookie["httpOnly"] is True and session_cookie["sameSite"] == "Lax"
    assert session.errors == []
    session.close()


def test_switching_project(ops):
    ops.goto("/")
    assert ops.page.locator("#project-select").input_value() == "default"
    with ops.page.expect_navigation():
        ops.page.select_option("#project-select", "other")
    assert "project=other" in ops.page.url
    assert ops.page.locator("[data-testid=total]").inner_text() == "0"  # nothing sent to 'other'
    assert "Send traces" in ops.page.locator("[data-testid=no-requests]").inner_text()
    ops.goto("/requests/")  # the choice is remembered
    assert ops.page.locator("#project-select").input_value() == "other"
    assert ops.page.locator("table.requests tbody tr").count() == 0
    with ops.page.expect_navigation():
        ops.page.select_option("#project-select", "default")
    assert "project=default" in ops.page.url and urllib.parse.urlparse(ops.page.url).path == "/requests/"
    assert ops.page.locator("table.requests tbody tr").count() > 0


# -- overview --------------------------------------------------------------------------------------------------
def test_overview_draws_its_charts_from_live_data(ops, dash, shots):
    ops.goto("/?range=15m")
    total = int(ops.page.locator("[data-testid=total]").inner_text())
    assert total > 0
    charts = ops.page.locator("[data-chart]")
    assert charts.count() == 12  # six charts, the four of the caches, and the two of the replica-group comparison
    for index in range(charts.count()):
        chart = charts.nth(index)
        assert chart.locator("canvas").count() == 1, chart.get_attribute("data-chart")
        assert int(chart.get_attribute("data-drawn")) >= 50  # 15 min in 15 s buckets
    data = json.loads(ops.page.locator("#overview-data").inner_text())
    assert round(sum(data["rate"]) * 15) == total
    assert any(v is not None for v in data["decode_ms_mean"])
    cards = ops.page.locator(".group-card h3").all_inner_texts()
    assert cards == ["baseline", "canary"] or cards == ["canary", "baseline"]
    for dimension in ("model", "service", "engine config", "replica group", "prompt length"):
        assert ops.page.get_by_role("heading", name=f"by {dimension}").count() == 1
    ops.page.screenshot(path=str(shots / "overview.png"), full_page=True)
    # Auto-refresh swaps the body and draws again, without errors.
    ops.page.evaluate("htmx.trigger('#overview-body', 'every 30s')")
    ops.page.wait_for_timeout(1500)
    assert ops.page.locator("[data-chart] canvas").count() == 12


# -- requests explorer ----------------------------------------------------------------------------------------
def test_explorer_filters_sorts_and_pages(ops, shots):
    ops.goto("/requests/?range=15m&replica_group=canary")
    groups = ops.page.locator("table.requests tbody tr td:nth-child(4)").all_inner_texts()
    assert groups and set(groups) == {"canary"}
    ops.goto("/requests/?range=15m&sort=e2e_ms&order=desc")
    ops.page.screenshot(path=str(shots / "requests.png"), full_page=True)
    first = [_ms(t) for t in ops.page.locator("table.requests tbody tr td:nth-child(9)").all_inner_texts()]
    assert first == sorted(first, reverse=True)
    next_link = ops.page.locator("a[rel=next]")
    if len(first) == 50:  # a second page, continuing where the first stopped
        assert next_link.count() == 1
        with ops.page.expect_navigation():
            next_link.click()
        second = [_ms(t) for t in ops.page.locator("table.requests tbody tr td:nth-child(9)").all_inner_texts()]
        assert second and max(second) <= min(first)
    # Invalid input: the message next to its field, and no query.
    response = ops.goto("/requests/?min_e2e=abc&prompt_bucket=huge&after=nonsense")
    assert response.status == 400
    invalid = ops.page.locator(".field.invalid").all_inner_texts()
    assert len(invalid) == 2
    assert any(t.startswith("min e2e (ms)") and "Enter a number" in t for t in invalid), invalid
    assert any(t.startswith("Prompt bucket") and "Select a valid choice" in t for t in invalid), invalid
    assert "not a page cursor" in ops.page.content()
    # The browser logs the 400 answer itself as a failed load: expected here, not an error of the page.
    assert all("status of 400" in e for e in ops.errors), ops.errors
    ops.errors.clear()


def _ms(text: str) -> float:
    value, unit = text.split()
    return float(value) * (1000 if unit == "s" else 1)


# -- trace detail ------------------------------------------------------------------------------------------------
def test_waterfall_segments_match_the_api_figures(ops, dash, shots):
    ops.goto("/requests/?range=15m&replica_group=baseline&sort=e2e_ms&order=desc")
    with ops.page.expect_navigation():
        ops.page.locator("table.requests tbody tr a").first.click()
    trace_id = ops.page.url.split("/traces/")[1].split("#")[0]
    ops.page.screenshot(path=str(shots / "trace.png"), full_page=True)
    [row] = [r for r in _api(dash, f"/api/v1/requests?trace_id={trace_id}")["requests"]]
    hops = row["hops"]
    assert [h["role"] for h in hops] == ["client", "gateway", "engine"]
    start = min(h["start_ns"] for h in hops)
    total_ms = (max(h["start_ns"] + h["duration_ms"] * 1e6 for h in hops) - start) / 1e6
    section = ops.page.locator(f"#request-{row['request_key']}")
    track = section.locator(".lane[data-role=engine] .lane-track").bounding_box()
    for name in ("queue", "prefill", "decode"):
        box = section.locator(f".segment[data-segment={name}]").bounding_box()
        expected = track["width"] * row[f"{name}_ms"] / total_ms
        assert abs(box["width"] - max(expected, 1.0)) <= 1.5, (name, box, expected)
    engine_bar = section.locator(".lane[data-role=engine] .bar").bounding_box()
    engine = hops[2]
    assert abs(engine_bar["width"] - track["width"] * engine["duration_ms"] / total_ms) <= 1.5
    assert abs(engine_bar["x"] - track["x"] - track["width"] * (engine["start_ns"] - start) / 1e6 / total_ms) <= 1.5
    # The network between the gateway and the engine is drawn (the gap before the engine starts).
    assert section.locator(".lane[data-role=engine] .gap").count() >= 1
    figures = {cell.get_attribute("data-figure"): cell.inner_text()
               for cell in section.locator("[data-figure]").all()}
    assert figures["decode_ms"] != "–" and figures["e2e_ms"] != "–"


def _otlp(trace_id: str, attributes: list[tuple[str, object]]) -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    add_attribute(rs.resource.attributes, "service.name", "evil<b>app</b>")
    scope = rs.scope_spans.add()
    scope.scope.name = "opentelemetry.instrumentation.openai_v2"
    span = scope.spans.add()
    span.trace_id, span.span_id = bytes.fromhex(trace_id), os.urandom(8)
    span.name, span.kind = "chat <img src=x onerror=alert(1)>", 3
    span.start_time_unix_nano = time.time_ns() - 5_000 * MS
    span.end_time_unix_nano = span.start_time_unix_nano + 300 * MS
    for key, value in [("gen_ai.operation.name", "chat"), ("gen_ai.request.model", "<script>m</script>"),
                       ("gen_ai.response.id", "chatcmpl-" + uuid.uuid4().hex), *attributes]:
        add_attribute(span.attributes, key, value)
    return request.SerializeToString()


def test_span_attributes_and_names_render_as_text(ops, dash):
    trace_id = uuid.uuid4().hex
    status, _, answer = post_traces(dash["process"], dash["keys"]["default"], _otlp(
        trace_id, [("app.note", "<script>window.__pwned = 1</script>")]))
    assert status == 200, answer
    deadline = time.monotonic() + 30
    while not _api(dash, f"/api/v1/requests?trace_id={trace_id}")["requests"]:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    ops.goto(f"/traces/{trace_id}")
    ops.page.locator("details.attributes summary").first.click()
    assert ops.page.get_by_text("<script>window.__pwned = 1</script>").count() == 1
    assert ops.page.evaluate("window.__pwned") is None
    assert ops.page.locator("script:not([src]):not([type='application/json'])").count() == 0
    assert ops.page.locator("img").count() == 0
    assert "evil<b>app</b>" in ops.page.locator("h2").first.inner_text()


def test_another_projects_trace_is_404(browser, dash, ops):
    trace_id = uuid.uuid4().hex
    status, _, _ = post_traces(dash["process"], dash["keys"]["other"], _otlp(trace_id, []))
    assert status == 200
    dash["process"].wait_idle(30)
    outsider = BrowserSession(browser, dash["url"])
    outsider.login("outsider", dash["passwords"]["outsider"])
    assert outsider.goto(f"/traces/{trace_id}").status == 200  # its own project's
    outsider.close()
    viewer = BrowserSession(browser, dash["url"])
    viewer.login("viewer", dash["passwords"]["viewer"])
    assert viewer.goto(f"/traces/{trace_id}").status == 404    # a member of 'default' only
    assert viewer.goto("/?project=other").status == 404        # not a member: no such project for them
    assert viewer.goto("/traces/not-a-trace-id").status == 404
    viewer.close()


# -- every page: keyboard and JavaScript errors ----------------------------------------------------------------------
def test_main_navigation_works_from_the_keyboard(ops):
    ops.goto("/")
    ops.page.keyboard.press("Tab")
    assert ops.page.evaluate("document.activeElement.textContent") == "Skip to content"
    ops.page.keyboard.press("Tab")  # the brand link
    ops.page.keyboard.press("Tab")  # Overview
    assert ops.page.evaluate("document.activeElement.textContent") == "Overview"
    ops.page.keyboard.press("Tab")  # Requests
    assert ops.page.evaluate("document.activeElement.textContent") == "Requests"
    with ops.page.expect_navigation():
        ops.page.keyboard.press("Enter")
    assert urllib.parse.urlparse(ops.page.url).path == "/requests/"
    assert ops.page.locator("nav[aria-label=Main] a[aria-current=page]").inner_text() == "Requests"


def test_no_page_logs_a_javascript_error(ops):
    for path in ("/", "/?range=24h", "/?range=30d", "/requests/", "/requests/?range=7d&sort=ttft_ms"):
        ops.goto(path)
    with ops.page.expect_navigation():
        ops.page.locator("table.requests tbody tr a").first.click()
    ops.page.wait_for_load_state("networkidle")
    assert "/traces/" in ops.page.url
    assert ops.errors == []


# -- SLOs, alerts, silences, and what a viewer may not do ----------------------------------------------------------
def _submit(session, selector: str = "form.form-grid button[type=submit]"):
    with session.page.expect_navigation():
        session.page.click(selector)


def test_creating_an_slo_through_the_form(ops, dash, shots):
    ops.goto("/slos/new")
    ops.page.fill("#f-name", "Not A Slug")
    ops.page.fill("#f-threshold_ms", "fast")
    ops.page.fill("#f-objective", "150%")
    _submit(ops)
    invalid = ops.page.locator(".field.invalid")
    errors = {invalid.nth(i).locator("label").inner_text(): invalid.nth(i).locator(".field-error").all_inner_texts()
              for i in range(invalid.count())}
    ops.page.screenshot(path=str(shots / "slo-form-errors.png"), full_page=True)
    assert errors["Name"][0].startswith("a slug") and len(errors["Name"]) == 1
    assert errors["Threshold (ms)"] == ["Input should be a valid number"]
    assert len(errors["Objective"]) == 1 and errors["Objective"][0].startswith("a percentage above 0%"), errors
    assert all("status of 400" in e for e in ops.errors)
    ops.errors.clear()
    # A check only the definition can make (the default tiers cannot fire under 93.06%): the API's message too.
    ops.page.fill("#f-name", "chat-ttft")
    ops.page.fill("#f-threshold_ms", "1")
    ops.page.fill("#f-objective", "90%")
    _submit(ops)
    assert "can never fire" in ops.page.locator(".field.invalid, .error").first.inner_text()
    ops.errors.clear()
    ops.page.fill("#f-objective", "99%")
    ops.page.fill("#f-service", "llm-loadgen")
    _submit(ops)
    assert ops.page.url.endswith("/slos/chat-ttft/"), ops.page.url
    slo = _api(dash, "/api/v1/slos/chat-ttft?project=default")
    assert (slo["sli"], slo["threshold_ms"], slo["objective_percent"], slo["filters"]) == (
        "ttft_ms", 1.0, "99%", {"service": ["llm-loadgen"]})
    ops.goto("/slos/new")
    ops.page.fill("#f-name", "chat-ttft")
    ops.page.fill("#f-threshold_ms", "100")
    _submit(ops)
    assert "already exists" in ops.page.locator(".field.invalid .field-error").inner_text()
    ops.errors.clear()


@pytest.fixture(scope="module")
def burning(dash) -> str:
    """An SLO every request breaks (TTFT under 1 ms): its page alert fires within seconds."""
    body = json.dumps({"name": "burning-ttft", "sli": "ttft_ms", "threshold_ms": 1, "objective": "99%"}).encode()
    status, _, answer = dash["process"].post("/api/v1/slos?project=default", body, {
        "Authorization": f"Bearer {dash['token']}", "Content-Type": "application/json"})
    assert status == 201, answer
    return "burning-ttft"


def _wait_for_firing(dash, slo: str, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alerts = _api(dash, "/api/v1/alerts?project=default&state=firing&severity=page")["alerts"]
        firing = [a for a in alerts if a["slo"] == slo and a["diagnosis"]]
        if firing:
            return firing[0]
        time.sleep(1)
    raise AssertionError(_api(dash, "/api/v1/alerts?project=default"))


def test_slo_page_draws_burn_rates_and_budget(ops, dash, shots, burning):
    _wait_for_firing(dash, burning)
    ops.goto("/slos/")
    row = ops.page.locator(f"tr[data-slo={burning}]")
    assert "burning" in row.inner_text()
    ops.page.screenshot(path=str(shots / "slos.png"), full_page=True)
    ops.goto(f"/slos/{burning}/?window=6h")
    data = json.loads(ops.page.locator("#slo-data").inner_text())
    assert data["thresholds"] == [14.4, 6.0, 3.0, 1.0] and len(data["t"]) >= 1
    for kind in ("burn", "budget"):
        assert ops.page.locator(f"[data-chart={kind}] canvas").count() == 1
    assert ops.page.locator("[data-testid=budget]").inner_text().endswith("%")
    ops.page.screenshot(path=str(shots / "slo.png"), full_page=True)


def test_alert_page_renders_the_diagnosis_and_silences_it(ops, dash, shots, burning):
    alert = _wait_for_firing(dash, burning)
    ops.goto("/alerts/?state=firing")
    ops.page.screenshot(path=str(shots / "alerts.png"), full_page=True)
    with ops.page.expect_navigation():
        ops.page.locator(f"tr[data-alert='{alert['fingerprint']}'] a").click()
    diagnosis = alert["diagnosis"]
    assert ops.page.locator("[data-testid=dx-summary]").inner_text() == diagnosis["summary"]
    assert ops.page.locator("[data-testid=dx-suggestion]").inner_text() == diagnosis["suggestion"]
    bars = ops.page.locator(".dx-row")
    assert bars.count() >= 5
    assert ops.page.locator(f".dx-row[data-component={diagnosis['dominant_component']}].dominant").count() == 1
    assert ops.page.locator(".timeline li").count() >= 2  # pending, then firing
    ops.page.screenshot(path=str(shots / "alert.png"), full_page=True)
    _fits_a_narrow_window(ops, shots / "alert-narrow.png")
    # Silence it from the page: a bad duration first, then a good one.
    ops.page.fill("#f-duration", "forever")
    ops.page.fill("#f-comment", "looking into it")
    _submit(ops, "form.silence-form button[type=submit]")
    assert ops.page.locator(".silence-form .field.invalid").count() == 1
    ops.errors.clear()
    ops.page.fill("#f-duration", "30m")
    _submit(ops, "form.silence-form button[type=submit]")
    silences = _api(dash, "/api/v1/silences?project=default&status=active")["silences"]
    assert [s["comment"] for s in silences] == ["looking into it"] and silences[0]["created_by"] == "ops"
    again = _api(dash, f"/api/v1/alerts/{alert['fingerprint']}?project=default")["alert"]
    assert again["silenced_by"] == [silences[0]["id"]]
    assert ops.page.locator(f"tr[data-silence='{silences[0]['id']}']").count() == 1
    # ... and expire it.
    _submit(ops, f"tr[data-silence='{silences[0]['id']}'] button[type=submit]")
    assert _api(dash, "/api/v1/silences?project=default&status=active")["silences"] == []


def test_a_viewer_sees_no_edit_controls_and_gets_403_when_posting(browser, dash, burning, ops):
    alert = _wait_for_firing(dash, burning)
    viewer = BrowserSession(browser, dash["url"])
    viewer.login("viewer", dash["passwords"]["viewer"])
    viewer.goto("/slos/")
    assert viewer.page.get_by_text("New SLO").count() == 0
    viewer.goto(f"/slos/{burning}/")
    assert viewer.page.locator("a:has-text('Edit'), button:has-text('Delete')").count() == 0
    viewer.goto(f"/alerts/{alert['fingerprint']}/")
    assert viewer.page.locator("form.silence-form").count() == 0
    assert viewer.goto("/slos/new").status == 403
    csrf = {c["name"]: c["value"] for c in viewer.context.cookies()}["csrftoken"]
    headers = {"X-CSRFToken": csrf}
    request = viewer.context.request
    assert request.post(dash["url"] + "/slos/new", form={"name": "x", "sli": "error_ratio", "objective": "99%"},
                        headers=headers).status == 403
    assert request.post(dash["url"] + f"/slos/{burning}/delete", headers=headers).status == 403
    assert request.post(dash["url"] + f"/alerts/{alert['fingerprint']}/",
                        form={"matchers": f'slo="{burning}"', "duration": "1h", "comment": "no"},
                        headers=headers).status == 403
    # Another project's alert and SLO are not found (a member of 'other' only).
    outsider = BrowserSession(browser, dash["url"])
    outsider.login("outsider", dash["passwords"]["outsider"])
    assert outsider.goto(f"/alerts/{alert['fingerprint']}/").status == 404
    assert outsider.goto(f"/slos/{burning}/").status == 404
    outsider.close()
    # Without the CSRF token even an operator's POST is refused.
    assert ops.context.request.post(dash["url"] + f"/slos/{burning}/delete").status == 403
    assert _api(dash, f"/api/v1/slos/{burning}?project=default")["name"] == burning
    viewer.close()


# -- channels and the engine ---------------------------------------------------------------------------------------
@pytest.fixture
def admin(browser, dash):
    session = BrowserSession(browser, dash["url"])
    session.login("admin", dash["passwords"]["admin"])
    yield session
    assert session.errors == [], session.errors
    session.close()


def test_channels_create_with_the_secret_shown_once_and_a_test_send(admin, ops, dash, receiver, shots):
    ops.goto("/channels/")
    assert ops.page.locator("form.channel-form").count() == 0  # operators read channels, admins manage them
    admin.goto("/channels/")
    admin.page.fill("#f-name", "oncall")
    admin.page.fill("#f-url", "ftp://example.com/x")
    _submit(admin, "form.channel-form button[type=submit]")
    assert admin.page.locator(".channel-form .field.invalid").count() >= 1
    admin.errors.clear()
    admin.page.fill("#f-url", f"http://127.0.0.1:{receiver.port}/hook")
    admin.page.check("input[name=severities][value=page]")
    _submit(admin, "form.channel-form button[type=submit]")
    secret = admin.page.locator("[data-testid=secret]").inner_text()
    assert secret.startswith("whsec_"), secret
    admin.page.screenshot(path=str(shots / "channels.png"), full_page=True)
    assert all("status of 201" in e or "status of 400" in e for e in admin.errors) or admin.errors == []
    admin.errors.clear()
    admin.goto("/channels/")
    assert secret not in admin.page.content()  # shown once
    with admin.page.expect_navigation():
        admin.page.locator("tr[data-channel=oncall] a").click()
    _submit(admin, "form.test-form button[type=submit]")
    assert "succeeded (HTTP 204)" in admin.page.locator("[data-testid=test-result]").inner_text()
    assert receiver.received and "webhook-signature" in receiver.received[-1]["headers"]
    assert admin.page.locator("table.deliveries tbody tr").count() >= 1
    admin.page.screenshot(path=str(shots / "channel.png"), full_page=True)


def _calibrated(dash, group: str) -> dict:
    """The group's engine model, calibrated through the API from the traffic it served, its live error measured."""
    body = json.dumps({"group": group, "window_hours": 1}).encode()
    deadline = time.monotonic() + 180
    while True:  # the group's traffic (a share of 4 req/s) may still be short of the minimum: 400, nothing stored
        status, _, answer = dash["process"].post("/api/v1/engine-models?project=default", body, {
            "Authorization": f"Bearer {dash['token']}", "Content-Type": "application/json"})
        if status != 400 or b"too little traffic" not in answer or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert status == 202, answer
    model_id = json.loads(answer)["id"]
    model = {}
    while time.monotonic() < deadline:
        model = _api(dash, f"/api/v1/engine-models/{model_id}")
        assert model["state"] in ("queued", "fitting", "fitted"), (model["reason"], model)
        if model["state"] == "fitted" and model["live"]["at"]:
            return model
        time.sleep(1)
    raise AssertionError(model)


def test_engine_page_shows_groups_replicas_the_knob_diff_and_live_metrics(admin, dash, shots):
    model = _calibrated(dash, "baseline")
    assert set(model["held_out_curves"]) >= {"ttft_ms", "tpot_ms"} and model["live"]["diagnosis"], model
    admin.goto("/engine/")
    assert sorted(admin.page.locator("table.groups tbody th").all_inner_texts()) == ["baseline", "canary"]
    states = admin.page.locator("table.replicas tbody td:nth-child(3)").all_inner_texts()
    assert states and set(states) == {"healthy"}
    assert admin.page.locator("table.knobs tbody tr").count() >= 1  # the canary runs another config
    admin.page.wait_for_function(
        "document.querySelectorAll('[data-live][data-drawn]').length === 3 && "
        "+document.querySelector('[data-live=kv_cache]').getAttribute('data-drawn') >= 2", timeout=20_000)
    assert admin.page.locator("[data-live] canvas").count() == 3
    # The group's engine model: its row (the live TPOT error and what moved, as the API has them) and a
    # predicted-vs-observed chart per figure, from the latest traffic.
    row = admin.page.locator("table.models tbody tr[data-group=baseline]")
    assert row.count() == 1 and row.get_attribute("data-model") == str(model["id"])
    assert row.locator("td.diagnosis").inner_text().startswith(model["live"]["diagnosis"])
    assert admin.page.locator("table.models tbody tr[data-group=canary]").count() == 0  # not calibrated
    charts = len(model["live"]["curves"])
    admin.page.wait_for_function(f"document.querySelectorAll('[data-model-curve][data-drawn]').length === {charts}",
                                 timeout=10_000)
    assert admin.page.get_by_text("model against observed, by quantile (latest traffic)").count() == 1
    admin.page.screenshot(path=str(shots / "engine.png"), full_page=True)


def test_the_engine_knobs_are_for_admins(ops):
    ops.goto("/engine/")
    assert ops.page.locator("table.groups tbody tr").count() == 2
    assert ops.page.locator("table.knobs").count() == 0


def _span_request(service: str, scope_name: str, spans: list[tuple]) -> bytes:
    request = ExportTraceServiceRequest()
    rs = request.resource_spans.add()
    add_attribute(rs.resource.attributes, "service.name", service)
    scope = rs.scope_spans.add()
    scope.scope.name = scope_name
    for trace_id, span_id, parent, name, kind, start, end, attributes in spans:
        span = scope.spans.add()
        span.trace_id, span.span_id = bytes.fromhex(trace_id), bytes.fromhex(span_id)
        if parent:
            span.parent_span_id = bytes.fromhex(parent)
        span.name, span.kind, span.start_time_unix_nano, span.end_time_unix_nano = name, kind, start, end
        for key, value in attributes:
            add_attribute(span.attributes, key, value)
    return request.SerializeToString()


def test_a_request_joined_across_traces_is_one_waterfall_from_either_trace(ops, dash, shots):
    """The app's client span in one trace, the gateway's and the engine's in another (no traceparent between
    them): one row, found from either trace, its hops marked with the trace they came from."""
    app, serving = uuid.uuid4().hex, uuid.uuid4().hex
    client, gateway, engine = (uuid.uuid4().hex[:16] for _ in range(3))
    rid, base = f"chatcmpl-{uuid.uuid4().hex}", time.time_ns() - 30 * 1_000_000_000
    bodies = [
        _span_request("chat-app", "opentelemetry.instrumentation.openai_v2", [(
            app, client, "", "chat llama", 3, base, base + 800 * MS,
            [("gen_ai.operation.name", "chat"), ("gen_ai.request.model", "llama"), ("gen_ai.response.id", rid)])]),
        _span_request("llm-gateway", "llm_observatory.gateway", [(
            serving, gateway, "", "chat llama", 2, base + 30 * MS, base + 770 * MS,
            [("gen_ai.operation.name", "chat"), ("gen_ai.request.model", "llama"), ("gen_ai.response.id", rid)])]),
        _span_request("vllm", "vllm.tracing.otel", [(
            serving, engine, gateway, "llm_request", 2, base + 35 * MS, base + 760 * MS,
            [("gen_ai.request.id", rid), ("gen_ai.latency.time_in_queue", 0.01),
             ("gen_ai.latency.time_to_first_token", 0.06), ("gen_ai.latency.e2e", 0.72),
             ("gen_ai.latency.time_in_model_prefill", 0.05), ("gen_ai.latency.time_in_model_decode", 0.65),
             ("gen_ai.usage.prompt_tokens", 40), ("gen_ai.usage.completion_tokens", 30)])]),
    ]
    for body in bodies:
        status, _, answer = post_traces(dash["process"], dash["keys"]["default"], body)
        assert status == 200, answer
        dash["process"].wait_idle(30)
    for trace in (app, serving):
        ops.goto(f"/traces/{trace}")
        sections = ops.page.locator("section.request")
        assert sections.count() == 1
        assert "joined by response_id" in sections.first.locator("h2").inner_text()
        lanes = sections.first.locator(".lane .lane-label").all_inner_texts()
        assert [label.split(" · ")[0] for label in lanes] == ["client", "gateway", "engine"]
        # The row belongs to the engine's trace; the client's hop names its own.
        assert f"(trace {app[:8]}…)" in lanes[0] and "(trace" not in lanes[2]
    ops.page.screenshot(path=str(shots / "trace-joined.png"), full_page=True)


def test_a_request_answered_from_the_response_cache_is_its_own_class(ops, dash, shots):
    """A client span above the platform gateway's SERVER span that answered from its exact cache (no engine): the
    waterfall splits the gateway's bar into lookup and overhead, says what served it, and shows no engine figure;
    the explorer tags the row; the overview counts it as cached traffic apart from the engine's percentiles."""
    trace, client, gateway = uuid.uuid4().hex, uuid.uuid4().hex[:16], uuid.uuid4().hex[:16]
    base = time.time_ns() - 20 * 1_000_000_000
    chat = [("gen_ai.operation.name", "chat"), ("gen_ai.request.model", "llama"),
            ("gen_ai.response.id", f"chatcmpl-{uuid.uuid4().hex}")]
    for body in (
        _span_request("chat-app", "opentelemetry.instrumentation.openai_v2", [(
            trace, client, "", "chat llama", 3, base, base + 20 * MS, chat)]),
        _span_request("llm-gateway", "llm_observatory.gateway", [(
            trace, gateway, client, "chat llama", 2, base + 4 * MS, base + 16 * MS,
            [*chat, ("observatory.cache.result", "hit"), ("observatory.cache.served_from", "exact_cache"),
             ("observatory.cache.lookup_ms", 3.5), ("gen_ai.usage.input_tokens", 40)])]),
    ):
        status, _, answer = post_traces(dash["process"], dash["keys"]["default"], body)
        assert status == 200, answer
    dash["process"].wait_idle(30)
    [row] = _api(dash, f"/api/v1/requests?trace_id={trace}")["requests"]
    assert (row["served_from"], row["lookup_ms"], row["prefill_ms"]) == ("exact_cache", 3.5, 0)
    ops.goto(f"/traces/{trace}")
    section = ops.page.locator(f"#request-{row['request_key']}")
    assert section.locator("[data-testid=served-from]").inner_text() == "served from exact cache"
    server = section.locator(".lane[data-role=gateway]")
    assert [s.get_attribute("data-segment") for s in server.locator(".segment").all()] == ["lookup", "overhead"]
    track = server.locator(".lane-track").bounding_box()
    lookup = server.locator(".segment[data-segment=lookup]").bounding_box()
    assert abs(lookup["width"] - track["width"] * 3.5 / 20) <= 1.5  # 3.5 ms of the client's 20 ms axis
    figures = [cell.get_attribute("data-figure") for cell in section.locator("[data-figure]").all()]
    assert "lookup_ms" in figures and not {"queue_ms", "prefill_ms", "decode_ms", "tpot_ms"} & set(figures)
    assert "e2e = network + gateway + lookup + overhead" in section.locator("[data-testid=cache-legend]").inner_text()
    ops.page.screenshot(path=str(shots / "trace-cache-hit.png"), full_page=True)
    _fits_a_narrow_window(ops, shots / "trace-cache-hit-narrow.png")
    ops.goto("/requests/?range=15m&served_from=exact_cache")
    assert ops.page.locator("table.requests tbody tr").count() == 1
    assert ops.page.locator("table.requests [data-served-from=exact_cache]").count() == 1
    # No engine ran: no queue, prefill or decode figure, the lookup instead.
    assert ops.page.locator("table.requests tbody tr td").last.inner_text() == "– (lookup 3.5 ms)"
    ops.goto("/?range=15m")
    classes = {r.get_attribute("data-class"): r.locator("td").all_inner_texts()
               for r in ops.page.locator("[data-testid=classes] tbody tr").all()}
    assert classes["exact_cache"][0] == "1" and classes["engine"][0] != "0", classes
    assert abs(sum(float(cells[1].rstrip("%")) for cells in classes.values()) - 100) < 0.02, classes
    assert ops.page.locator("[data-testid=cache-served]").inner_text().startswith("1 ")
    ops.page.screenshot(path=str(shots / "overview-caches.png"), full_page=True)
    _fits_a_narrow_window(ops, shots / "overview-caches-narrow.png")


def _fits_a_narrow_window(ops, shot) -> None:
    """At a phone's width the page does not scroll sideways: wide tables scroll inside themselves."""
    ops.page.set_viewport_size({"width": 420, "height": 900})
    try:
        ops.page.reload()
        ops.page.wait_for_load_state("networkidle")
        assert ops.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        ops.page.screenshot(path=str(shot), full_page=True)
    finally:
        ops.page.set_viewport_size({"width": 1400, "height": 1000})
