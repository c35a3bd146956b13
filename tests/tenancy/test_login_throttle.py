"""Logins are throttled per user and address (django-axes): wrong passwords lock the user out from that address
after LOGIN_FAILURE_LIMIT tries, even the right password is then refused (429) until the cool-off ends or an
admin unlocks (`manage.py axes_reset_username`), and another address is not affected."""
from __future__ import annotations

import http.cookiejar
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from benchkit.harness import ROOT


class Browser:
    """A client with cookies, coming from `address` (X-Forwarded-For, with one trusted proxy)."""

    def __init__(self, base: str, address: str):
        self.base = base
        self.address = address
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()),
                                                  _NoRedirect())

    def login(self, username: str, password: str) -> int:
        page = self._open(urllib.request.Request(self.base + "/admin/login/"))
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.read().decode()).group(1)
        form = urllib.parse.urlencode({"csrfmiddlewaretoken": token, "username": username, "password": password,
                                       "next": "/admin/"}).encode()
        request = urllib.request.Request(self.base + "/admin/login/", data=form,
                                         headers={"Referer": self.base + "/admin/login/"})
        return self._open(request).status

    def _open(self, request):
        request.add_header("X-Forwarded-For", self.address)
        try:
            return self.opener.open(request, timeout=30)
        except urllib.error.HTTPError as exc:
            return exc


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


@pytest.fixture(scope="module")
def platform(module_platform_factory):
    # One platform for the module: each test attacks from an address of its own.
    platform = module_platform_factory(extra_env={"LOGIN_FAILURE_LIMIT": "5", "LOGIN_COOLOFF_MINUTES": "0.05",
                                                 "OBSERVATORY_TRUSTED_PROXIES": "1"})
    env = {**platform.process.env, "DJANGO_SUPERUSER_PASSWORD": "correct horse battery staple"}
    subprocess.run([sys.executable, str(ROOT / "manage.py"), "createsuperuser", "--noinput", "--username", "root",
                    "--email", "root@example.com"], env=env, check=True, capture_output=True)
    return platform


def test_wrong_passwords_lock_the_user_out_from_that_address_until_unlocked(platform):
    attacker = Browser(platform.url, "203.0.113.7")
    statuses = [attacker.login("root", f"guess-{i}") for i in range(8)]
    assert statuses[:4] == [200] * 4, statuses  # the form again, with an error
    assert statuses[4:] == [429] * 4, statuses  # locked out at the 5th failure
    assert attacker.login("root", "correct horse battery staple") == 429  # the right password too
    # Another address is not locked out.
    assert Browser(platform.url, "198.51.100.2").login("root", "correct horse battery staple") == 302
    # An admin unlocks at once.
    out = platform.process.manage("axes_reset_username", "root")
    assert "1 attempt" in out or "attempts" in out, out
    assert attacker.login("root", "correct horse battery staple") == 302
    assert "AXES" in platform.process.log_tail(50_000)  # the lockout is logged


def test_the_lockout_ends_after_the_cooloff(platform):
    attacker = Browser(platform.url, "203.0.113.8")
    for i in range(5):
        attacker.login("root", f"guess-{i}")
    assert attacker.login("root", "correct horse battery staple") == 429
    time.sleep(3.5)  # LOGIN_COOLOFF_MINUTES=0.05
    assert attacker.login("root", "correct horse battery staple") == 302
