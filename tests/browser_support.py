"""What the browser tests share: a dashboard login made with `manage.py dashboard_login`, and a browser session
(its own context and page) that logs in through the login form and records every JavaScript error and failed
request. The Playwright browser and the screenshot folder are fixtures in tests/conftest.py."""
from __future__ import annotations

import re


def dashboard_password(output: str) -> str:
    """The password in what `manage.py dashboard_login` printed."""
    match = re.search(r"password '([^']+)'", output)
    assert match, output
    return match.group(1)


def dashboard_login(process, user: str, role: str, project: str = "default") -> str:
    """Create (or reset) dashboard user ``user`` with ``role`` in ``project`` on a live platform; its password."""
    return dashboard_password(process.manage("dashboard_login", "--user", user, "--project", project,
                                             "--role", role))


class BrowserSession:
    """A browser context and page of their own that record every JavaScript error and failed request."""

    def __init__(self, browser, url: str, width: int = 1400):
        self.context = browser.new_context(viewport={"width": width, "height": 1000})
        self.page = self.context.new_page()
        self.url = url
        self.errors: list[str] = []
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)

    def login(self, user: str, password: str, expect_ok: bool = True) -> None:
        self.page.goto(self.url + "/accounts/login/")
        self.page.fill("#id_username", user)
        self.page.fill("#id_password", password)
        self.page.click("main button[type=submit]")
        self.page.wait_for_load_state("networkidle")
        if expect_ok:
            assert not self.page.url.endswith("/accounts/login/"), self.page.content()[:2000]

    def goto(self, path: str):
        response = self.page.goto(self.url + path)
        self.page.wait_for_load_state("networkidle")
        return response

    def close(self) -> None:
        self.context.close()


def logged_in_page(browser, url: str, user: str, password: str, width: int = 1400):
    """(context, page, errors) of a new browser session logged in as ``user``."""
    session = BrowserSession(browser, url, width=width)
    session.login(user, password)
    return session.context, session.page, session.errors
