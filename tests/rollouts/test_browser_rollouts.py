"""The rollout pages in a real browser (Playwright driving Debian's Chromium) against the live world: a form refused
with the engine's and the plan's messages, a rollout started from the form and watched (its steps, the canary's
latency distributions against the baseline's, the verdicts with their values), aborted from its page (rolled back,
audited); the overview draws its events; a viewer sees neither the form nor the controls.

Screenshots go to $OBSERVATORY_SCREENSHOTS (default: the test's temporary directory)."""
from __future__ import annotations

import re

import pytest
from browser_support import dashboard_login, logged_in_page

# Pages in a browser: run in one CI suite (tests/conftest.py).
pytestmark = pytest.mark.one_suite(suite="embedded")


def session(browser, world, role: str):
    user = f"roll-{role}"
    return logged_in_page(browser, world.process.url, user, dashboard_login(world.process, user, role))


def test_start_watch_and_abort_a_rollout_in_the_browser(browser, world, shots):
    context, page, errors = session(browser, world, "admin")
    url = world.process.url
    page.goto(url + "/rollouts/")
    page.wait_for_load_state("networkidle")
    assert page.locator("nav a", has_text="Rollouts").count() == 1
    # Refused: an invalid config (every problem), then a plan whose step is too short for its analysis window.
    page.fill("#f-config", "max_num_seqs: 0\ngpu_memory_utilization: 2")
    page.click("form.rollout-form button[type=submit]")
    page.wait_for_load_state("networkidle")
    invalid = page.locator(".field.invalid").first.inner_text()
    assert "max_num_seqs" in invalid and "gpu_memory_utilization" in invalid, invalid
    page.fill("#f-config", "max_num_seqs: 64")
    page.fill("#f-plan", "steps:\n  - canary: 20\n    interval: 30s")
    page.click("form.rollout-form button[type=submit]")
    page.wait_for_load_state("networkidle")
    assert "too short for the analysis" in page.locator(".field.invalid").first.inner_text()
    page.screenshot(path=str(shots / "rollouts-refused.png"), full_page=True)
    # A real one: a 20% canary judged on 5 s of settling and 30 s windows, then an approval.
    page.fill("#f-plan", "steps:\n  - canary: 20\n    interval: 120s\n  - approval\nanalysis:\n  settle_seconds: 5\n"
                         "  window_seconds: 20\n  look_every_seconds: 3\n  min_requests: 20")
    page.click("form.rollout-form button[type=submit]")
    page.wait_for_url(re.compile(r".*/rollouts/\d+/$"))
    rollout_id = int(page.url.rstrip("/").rsplit("/", 1)[1])
    assert "max_num_seqs" in page.locator("[data-testid=changes]").inner_text()
    # The page refreshes itself: the canary's distributions and verdicts appear once it has data.
    page.wait_for_selector("[data-testid=distributions] svg path.dist-canary", timeout=120_000)
    verdicts = page.locator("[data-testid=verdicts]").inner_text()
    assert "TTFT" in verdicts and "queue time" in verdicts and "error rate" in verdicts
    steps = page.locator("[data-testid=steps]").inner_text()
    assert "canary 20% for 120 s" in steps and "manual approval" in steps and "promote" in steps
    page.screenshot(path=str(shots / "rollout-canary.png"), full_page=True)
    # Abort from the page (a confirm dialog first): rolled back, audited with the admin's name.
    page.on("dialog", lambda dialog: dialog.accept())
    page.click("[data-testid=abort]")
    page.wait_for_load_state("networkidle")
    page.wait_for_selector("[data-testid=state]:has-text('aborted')", timeout=30_000)
    audit = page.locator("[data-testid=transitions]").inner_text()
    assert "user:roll-admin" in audit and "aborted" in audit
    page.screenshot(path=str(shots / "rollout-aborted.png"), full_page=True)
    world.wait_canary_gone(world.rollout(rollout_id)["canary_group"])
    # The overview marks the rollout's events on its time series.
    page.goto(url + "/?range=15m")
    page.wait_for_load_state("networkidle")
    events = page.locator("[data-testid=rollout-events]").inner_text()
    assert f"rollout #{rollout_id}" in events and "canary 20%" in events and "aborted" in events
    page.screenshot(path=str(shots / "overview-rollout-events.png"), full_page=True)
    assert not errors, errors
    context.close()


def test_a_viewer_sees_no_form_and_no_controls_and_is_refused(browser, world):
    context, page, errors = session(browser, world, "viewer")
    page.goto(world.process.url + "/rollouts/")
    page.wait_for_load_state("networkidle")
    assert page.locator("form.rollout-form").count() == 0
    link = page.locator("[data-testid=rollouts] a").first
    link.click()
    page.wait_for_load_state("networkidle")
    assert page.locator("[data-testid=abort], [data-testid=pause], [data-testid=promote]").count() == 0
    response = page.request.post(world.process.url + "/rollouts/new", form={"group": "base", "config": "a: 1"})
    assert response.status in (403, 302)
    assert not errors, errors
    context.close()
