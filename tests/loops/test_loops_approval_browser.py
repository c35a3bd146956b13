"""An approval link followed in a real browser, as the admin who got it in a notification would: the link (as the
webhook carried it, on the project's public URL) opened logged out, the login form, back on the approval page that
changed nothing, the Approve button, and the loop's page showing the rollout started and who approved it; the
same link opened again says it was used. A viewer who follows the link sees no buttons.

Django's live server runs the dashboard in this process against the test database (the loop at its approval is made
as tests/loops/test_loops_db.py makes it: a page on group `base` of a fleet file whose controller is away, and a
finished study). Chromium through Playwright (tests/conftest.py)."""
from __future__ import annotations

import pytest
from alerts_support import installed_store
from browser_support import BrowserSession
from django.contrib.auth import get_user_model
from loops import machine
from loops.models import Loop
from test_loops_db import _awaiting, fleet, world  # noqa: F401 - the fixtures this module shares

pytestmark = pytest.mark.django_db(transaction=True)
PASSWORD = "correct horse battery staple"


@pytest.fixture(scope="module", autouse=True)
def unsafe_sync():
    """Playwright's sync API keeps an event loop in this thread; the test's ORM calls (and the test database's
    creation, when this module is the first to ask for it) are synchronous code that Django would otherwise refuse
    to run beside it. For this module only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        yield


@pytest.fixture(scope="module")
def store():
    """A scratch ClickHouse store for the pages that read traces (the dashboard a login lands on)."""
    with installed_store() as scratch:
        yield scratch


def test_an_admin_approves_through_the_link_in_a_browser(world, store, live_server, browser, shots):  # noqa: F811
    loop, token = _awaiting(world)
    users = get_user_model().objects
    for name in ("ada", "vic"):
        user = users.get(username=name)
        user.set_password(PASSWORD)
        user.save()

    viewer = BrowserSession(browser, live_server.url)
    try:
        viewer.login("vic", PASSWORD)
        viewer.goto(f"/loops/approve/{token}")
        assert "Only an admin of the project can decide" in viewer.page.inner_text("main")
        assert viewer.page.locator("[data-testid=approve]").count() == 0
        assert viewer.errors == []
    finally:
        viewer.close()

    admin = BrowserSession(browser, live_server.url, width=420)
    try:
        admin.goto(f"/loops/approve/{token}")  # logged out: the login form, then back to the link
        assert "/accounts/login/" in admin.page.url
        admin.page.fill("#id_username", "ada")
        admin.page.fill("#id_password", PASSWORD)
        admin.page.click("main button[type=submit]")
        admin.page.wait_for_load_state("networkidle")
        assert admin.page.url.endswith(f"/loops/approve/{token}"), admin.page.url
        proposal = admin.page.locator("[data-testid=proposal] tbody tr").inner_text()
        assert "max_num_seqs" in proposal and "32" in proposal and "64" in proposal, proposal
        assert Loop.objects.get(id=loop.id).state == "awaiting_approval"  # opening the link decided nothing
        admin.page.screenshot(path=str(shots / "loop-approval-420.png"), full_page=True)

        admin.page.fill("#f-reason", "load doubled at night; x2 is within the policy")
        admin.page.click("[data-testid=approve]")
        admin.page.wait_for_load_state("networkidle")
        assert admin.page.url.endswith(f"/loops/{loop.id}/"), admin.page.url
        approved = Loop.objects.get(id=loop.id).steps.get(step="approved")
        assert approved.actor == "ada" and "within the policy" in approved.reason, (approved.actor, approved.reason)
        assert admin.page.locator("[data-testid=state]").inner_text() == "rolling_out"
        assert machine.advance(loop.id) == "rolling_out"  # the loops' sweep: the approved rollout starts
        loop.refresh_from_db()
        assert loop.rollout is not None and loop.rollout.config["max_num_seqs"] == 64, loop.rollout
        admin.goto(f"/loops/{loop.id}/")
        steps = admin.page.locator("[data-testid=timeline] li").evaluate_all("els => els.map(e => e.dataset.step)")
        assert steps[-2:] == ["approved", "rollout_started"], steps
        admin.page.screenshot(path=str(shots / "loop-approved-420.png"), full_page=True)

        admin.goto("/loops/")
        admin.page.screenshot(path=str(shots / "loops-420.png"), full_page=True)
        for table in ("loops", "policies"):  # on a phone each row is a card: nothing to scroll sideways
            assert admin.page.locator(f"[data-testid={table}]").evaluate("t => t.scrollWidth <= t.clientWidth"), table
        assert admin.errors == []
        used = admin.goto(f"/loops/approve/{token}")  # the same link again: used (410 Gone), nothing happens
        assert used.status == 410 and "Nothing was changed" in admin.page.locator("[data-testid=refused]").inner_text()
        assert Loop.objects.get(id=loop.id).state == "rolling_out"
    finally:
        admin.close()
