"""The regression pages in a real browser (Playwright driving Debian's Chromium) against the live platform: import
a dataset from a file (a bad one first), start a paired run from the form, watch its progress to the verdict,
read the gates, the ECDF charts and the per-item table, follow an item to its request's waterfall; a viewer
sees no forms and is refused when posting anyway.

Screenshots go to $OBSERVATORY_SCREENSHOTS (default: the test's temporary directory)."""
from __future__ import annotations

import json
import re

import pytest
from browser_support import dashboard_login, logged_in_page

# Pages in a browser: run in one CI suite (tests/conftest.py).
pytestmark = pytest.mark.one_suite(suite="server")


@pytest.fixture(scope="module")
def passwords(live):
    return {role: dashboard_login(live.process, f"reg-{role}", role) for role in ("operator", "viewer")}


def test_import_run_and_read_a_comparison_in_the_browser(browser, live, passwords, shots, tmp_path):
    context, page, errors = logged_in_page(browser, live.process.url, "reg-operator", passwords["operator"])
    url = live.process.url
    page.goto(url + "/regressions/")
    page.wait_for_load_state("networkidle")
    assert "No datasets yet" in page.content() or page.locator("[data-testid=datasets]").count() == 1
    if "No datasets yet" in page.content():  # nothing to run yet: no form with an empty dataset list
        assert page.locator("form.run-form").count() == 0
        assert page.locator("[data-testid=no-run-form]").count() == 1

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": \n{"messages": []}\n')
    page.fill("#f-name", "browser-set")
    page.set_input_files("#f-file", str(bad))
    page.click("form.import-form button[type=submit]")
    page.wait_for_load_state("networkidle")
    problems = page.locator("[data-testid=import-errors]").inner_text()
    assert "Nothing was imported" in problems and "line 2: not JSON" in problems and "line 3:" in problems
    page.screenshot(path=str(shots / "regressions-import-errors.png"), full_page=True)

    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({
        "id": f"b{i}", "messages": [{"role": "user", "content": "Explain the decode phase " + "token " * (10 + 9 * i)}],
        "max_tokens": 16 + i % 5, "evaluators": [{"type": "regex", "pattern": "\\w"}]}) for i in range(30)))
    page.fill("#f-name", "browser-set")
    page.set_input_files("#f-file", str(good))
    page.click("form.import-form button[type=submit]")
    page.wait_for_load_state("networkidle")
    assert "/regressions/datasets/browser-set/" in page.url
    assert page.locator("[data-testid=dataset-items] tbody tr").count() == 30
    page.screenshot(path=str(shots / "regressions-dataset.png"), full_page=True)

    page.goto(url + "/regressions/")
    page.select_option("#f-dataset", "browser-set")
    page.fill("#f-target", "group:same")
    page.fill("#f-baseline", "group:base")
    page.fill("#f-max_concurrency", "4")
    page.select_option("#f-arms", "in_turn")
    page.click("form.run-form button[type=submit]")
    page.wait_for_load_state("networkidle")
    assert re.search(r"/regressions/runs/\d+/$", page.url), page.url
    run_path = page.url.removeprefix(url)
    assert "in turn: the baseline's whole replay, then the candidate's" in page.locator("p.meta").first.inner_text()
    page.screenshot(path=str(shots / "regressions-run-progress.png"), full_page=True)
    # The page polls while the run goes, then reloads itself with the comparison.
    page.wait_for_selector("[data-testid=verdict]", timeout=120_000)
    page.wait_for_selector("[data-testid=gates]", timeout=30_000)
    page.wait_for_load_state("networkidle")
    assert page.locator("[data-testid=gates] tbody tr.gate").count() >= 5
    drawn = page.locator("[data-ecdf][data-drawn]")
    assert drawn.count() >= 4, page.content()[:3000]
    assert page.locator("[data-testid=items] tbody tr").count() == 30
    assert "synthetic" in page.locator("[data-testid=synthetic]").inner_text()
    page.screenshot(path=str(shots / "regressions-run.png"), full_page=True)

    page.locator("[data-testid=items] a", has_text="candidate").first.click()
    page.wait_for_load_state("networkidle")
    assert "/traces/" in page.url
    lanes = page.locator(".waterfall .lane")
    assert lanes.count() >= 3 and "llm-regression" in page.locator(".waterfall").inner_text()
    page.screenshot(path=str(shots / "regressions-trace.png"), full_page=True)

    page.goto(url + "/regressions/")
    page.wait_for_load_state("networkidle")
    row = page.locator("[data-testid=runs] tbody tr").first
    assert "browser-set" in row.inner_text() and re.search(r"pass|fail|inconclusive", row.inner_text(), re.I)
    page.screenshot(path=str(shots / "regressions.png"), full_page=True)
    # A narrow window: the list, the run form (its paired-arms choice) and the run page still fit its width.
    narrow = context.new_page()
    narrow.set_viewport_size({"width": 420, "height": 900})
    for path, name in (("/regressions/", "regressions-narrow.png"), (run_path, "regressions-run-narrow.png")):
        narrow.goto(url + path)
        narrow.wait_for_load_state("networkidle")
        narrow.screenshot(path=str(shots / name), full_page=True)
        assert narrow.evaluate("document.documentElement.scrollWidth") <= 420, path
    assert errors == [], errors
    context.close()


def test_a_viewer_sees_no_forms_and_cannot_start_a_run(browser, live, passwords):
    context, page, errors = logged_in_page(browser, live.process.url, "reg-viewer", passwords["viewer"])
    page.goto(live.process.url + "/regressions/")
    page.wait_for_load_state("networkidle")
    assert page.locator("form.run-form").count() == 0 and page.locator("form.import-form").count() == 0
    token = page.locator("input[name=csrfmiddlewaretoken]").first.get_attribute("value")
    response = page.request.post(live.process.url + "/regressions/new",
                                 form={"csrfmiddlewaretoken": token, "dataset": "browser-set",
                                       "target": "group:base"},
                                 headers={"Referer": live.process.url + "/regressions/"})
    assert response.status == 403
    assert errors == [], errors
    context.close()
