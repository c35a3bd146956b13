"""SSRF protection of every outbound notification request: schemes, private/loopback/link-local/metadata addresses
(literal, resolved, embedded in IPv6), checked redirects, the allow-list, pinned connections, no env proxies."""
from __future__ import annotations

import ipaddress

import pytest
from notify import http_client
from notify.http_client import Policy, RequestRefused, TransportError
from notify_receivers import Receiver, Reply

ALLOW_LOCAL = Policy.from_allow_list(["127.0.0.1:1024-65535"])
NOBODY = Policy.from_allow_list([])


def refused(url: str, policy: Policy = NOBODY) -> str:
    with pytest.raises(RequestRefused) as info:
        http_client.request(url, b"{}", {"Content-Type": "application/json"}, policy)
    return str(info.value)


@pytest.mark.parametrize("url, reason", [
    ("http://10.0.0.1/hook", "10.0.0.1 is a private address"),
    ("http://192.168.1.20:8080/hook", "private address"),
    ("http://172.16.5.4/", "private address"),
    ("http://127.0.0.1:9/hook", "loopback"),
    ("http://[::1]:9/hook", "loopback"),
    ("http://0.0.0.0:9/", "unspecified"),
    ("http://169.254.1.1/", "link-local"),
    ("http://[fe80::1]/", "link-local"),
    ("http://100.64.3.2/", "carrier-grade NAT"),
    ("http://224.0.0.1/", "multicast"),
    ("http://240.0.0.1/", "reserved"),
    ("http://[fc00::5]/", "private address"),
    ("http://[::ffff:127.0.0.1]/", "loopback address (IPv4 127.0.0.1 inside IPv6)"),
    ("http://[::ffff:10.1.2.3]/", "private address (IPv4 10.1.2.3 inside IPv6)"),
    ("http://[2002:a00:1::1]/", "IPv4 10.0.0.1 inside IPv6"),  # 6to4
    ("http://[64:ff9b::7f00:1]/", "IPv4 127.0.0.1 inside IPv6"),  # NAT64
])
def test_private_literals_are_refused(url, reason):
    message = refused(url)
    assert reason in message and "NOTIFY_ALLOW_PRIVATE_DESTINATIONS" in message


def test_a_name_resolving_to_loopback_is_refused():
    message = refused("http://localhost:9/hook")
    assert message.startswith("refused: localhost resolves to") and "loopback" in message


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",
    "http://[fd00:ec2::254]/latest/meta-data/",
    "http://[::ffff:169.254.169.254]/",
    "http://metadata.google.internal/computeMetadata/v1/",
])
def test_cloud_metadata_is_refused_even_when_link_local_is_allowed(url):
    broad = Policy.from_allow_list(["169.254.0.0/16:1-65535", "[fd00::/8]:1-65535", "[::ffff:0:0/96]:1-65535"])
    assert "metadata" in refused(url, broad)


def test_metadata_needs_an_exact_allow_list_entry():
    exact = Policy.from_allow_list(["169.254.169.254:80"])
    assert http_client.forbidden_reason(ipaddress.ip_address("169.254.169.254"), "x", exact, 80) is None


@pytest.mark.parametrize("url", ["ftp://example.com/x", "file:///etc/passwd", "gopher://example.com:70/",
                                 "javascript:alert(1)", "//example.com/hook", "example.com/hook"])
def test_non_http_schemes_are_refused(url):
    assert "only http and https" in refused(url)


@pytest.mark.parametrize("url, reason", [("http:///nohost", "no host"), ("http://example.com:99999/", "invalid URL"),
                                         ("http://exa mple.com/", "whitespace"), ("", "empty")])
def test_malformed_urls_are_refused(url, reason):
    assert reason in refused(url)


def test_public_addresses_pass_the_check():
    for address in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):
        assert http_client.forbidden_reason(ipaddress.ip_address(address), address, NOBODY, 443) is None


def test_allow_list_admits_the_local_receiver_and_keeps_host_header():
    with Receiver() as receiver:
        response = http_client.request(receiver.url, b'{"a":1}', {"Content-Type": "application/json"}, ALLOW_LOCAL)
        assert response.status == 200
        # localhost resolves to ::1 and 127.0.0.1; only 127.0.0.1 is allowed, the connection is pinned to it
        # and the Host header still carries the name from the URL.
        response = http_client.request(f"http://localhost:{receiver.port}/named", b"{}", {}, ALLOW_LOCAL)
        assert response.status == 200
    assert [r.path for r in receiver.requests] == ["/hook", "/named"]
    assert receiver.requests[0].body == b'{"a":1}'
    assert receiver.requests[1].headers["host"] == f"localhost:{receiver.port}"


def test_allow_list_by_host_name():
    with Receiver() as receiver:
        named = Policy.from_allow_list(["localhost:1024-65535"])
        assert http_client.request(f"http://localhost:{receiver.port}/", b"{}", {}, named).status == 200
        assert "127.0.0.1 is a loopback" in refused(receiver.url, named)


def test_redirect_to_a_private_address_is_refused():
    with Receiver(default=Reply(302, {"Location": "http://10.0.0.1/internal"})) as receiver:
        message = refused(receiver.url, ALLOW_LOCAL)
    assert message.startswith("redirect to http://10.0.0.1/internal refused") and "private address" in message
    assert len(receiver.requests) == 1


def test_redirect_to_loopback_is_refused_when_only_the_first_host_is_allowed():
    with Receiver() as receiver:
        receiver.default = Reply(307, {"Location": f"http://127.0.0.1:{receiver.port}/elsewhere"})
        message = refused(f"http://localhost:{receiver.port}/start", Policy.from_allow_list(["localhost:1024-65535"]))
    assert "redirect to http://127.0.0.1" in message and "loopback" in message


def test_redirect_to_metadata_and_to_other_schemes_is_refused():
    with Receiver(default=Reply(301, {"Location": "http://169.254.169.254/latest/"})) as receiver:
        assert "metadata" in refused(receiver.url, ALLOW_LOCAL)
    with Receiver(default=Reply(302, {"Location": "file:///etc/passwd"})) as receiver:
        assert "only http and https" in refused(receiver.url, ALLOW_LOCAL)


def test_at_most_three_redirects():
    with Receiver(default=Reply(307, {"Location": "/again"})) as receiver:
        assert "too many redirects (more than 3)" in refused(receiver.url, ALLOW_LOCAL)
    assert len(receiver.requests) == 4  # the request and three redirects


def test_allowed_redirects_keep_the_post_except_303():
    with Receiver([Reply(307, {"Location": "/kept"}), Reply(302, {"Location": "/moved"}),
                   Reply(303, {"Location": "/see-other"})]) as receiver:
        response = http_client.request(receiver.url, b'{"x":1}', {"Content-Type": "application/json"}, ALLOW_LOCAL)
    assert response.status == 200 and response.redirects == 3
    assert [(r.method, r.path, r.body) for r in receiver.requests] == [
        ("POST", "/hook", b'{"x":1}'), ("POST", "/kept", b'{"x":1}'), ("POST", "/moved", b'{"x":1}'),
        ("GET", "/see-other", b"")]


def test_a_stalled_body_does_not_undo_the_status():
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")  # then nothing more
        threading.Event().wait(2)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    policy = Policy.from_allow_list(["127.0.0.1:1024-65535"], read_timeout=0.3)
    response = http_client.request(f"http://127.0.0.1:{listener.getsockname()[1]}/", b"{}", {}, policy)
    listener.close()
    assert response.status == 200 and response.body == b"partial"


def test_proxies_from_the_environment_are_ignored(monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://10.9.9.9:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with Receiver() as receiver:
        assert http_client.request(receiver.url, b"{}", {}, ALLOW_LOCAL).status == 200
    assert receiver.requests[0].path == "/hook"  # a proxy would have been sent the absolute URL


def test_read_timeout_and_total_timeout():
    slow = Policy.from_allow_list(["127.0.0.1:1024-65535"], read_timeout=0.3, total_timeout=5)
    with Receiver(default=Reply(200, delay=2.0)) as receiver:
        with pytest.raises(TransportError, match="timed out"):
            http_client.request(receiver.url, b"{}", {}, slow)
    capped = Policy.from_allow_list(["127.0.0.1:1024-65535"], read_timeout=5, total_timeout=0.4)
    with Receiver(default=Reply(200, delay=2.0)) as receiver:
        with pytest.raises(TransportError, match="timed out"):
            http_client.request(receiver.url, b"{}", {}, capped)


def test_connection_refused_is_a_transport_error():
    with Receiver() as receiver:
        port = receiver.port
    with pytest.raises(TransportError, match="connection error"):
        http_client.request(f"http://127.0.0.1:{port}/gone", b"{}", {}, ALLOW_LOCAL)


def test_unresolvable_names_are_transient():
    with pytest.raises(TransportError, match="could not resolve"):
        http_client.request("http://does-not-exist.invalid/hook", b"{}", {}, NOBODY)


@pytest.mark.django_db
def test_a_refused_destination_fails_the_delivery_with_a_clear_error(settings):
    from notify import services
    from notify.models import Channel, Delivery
    from tenancy.models import Project

    settings.NOTIFY = {**settings.NOTIFY, "ALLOW_PRIVATE_DESTINATIONS": []}
    project = Project.objects.create(name="ssrf")
    channel = Channel.objects.create(project=project, name="internal", kind="webhook", url="http://10.0.0.1/hook",
                                     secrets=["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"])
    [delivery_id] = services.enqueue(project.id, {"event_id": "e1", "fingerprint": "f1", "status": "firing",
                                                  "labels": {}}, severity="page")
    assert services.deliver_due() == 1
    delivery = Delivery.objects.get(id=delivery_id)
    assert delivery.status == "failed" and delivery.attempts == 1  # permanent: not retried
    assert "10.0.0.1 is a private address" in delivery.last_error
    assert [a.outcome for a in delivery.attempt_log.all()] == ["refused"]
    channel.refresh_from_db()
    assert "private address" in channel.last_error


def test_an_allow_list_entry_opens_its_port_only():
    """The read-back hole: with a bare `127.0.0.1` allowed, a channel could be pointed at any local port (the
    platform's own API included) and its answer read in the deliveries log. Entries now carry a port."""
    policy = Policy.from_allow_list(["127.0.0.1:9093", "10.0.0.0/8:8080-8090", "[fd00::/8]:443", "hooks.internal:8443"])
    assert http_client.forbidden_reason(ipaddress.ip_address("127.0.0.1"), "127.0.0.1", policy, 9093) is None
    assert "does not open (8000)" in http_client.forbidden_reason(
        ipaddress.ip_address("127.0.0.1"), "127.0.0.1", policy, 8000)
    assert http_client.forbidden_reason(ipaddress.ip_address("10.2.3.4"), "10.2.3.4", policy, 8085) is None
    assert http_client.forbidden_reason(ipaddress.ip_address("10.2.3.4"), "10.2.3.4", policy, 8091)
    assert http_client.forbidden_reason(ipaddress.ip_address("fd00::1"), "fd00::1", policy, 443) is None
    assert http_client.forbidden_reason(ipaddress.ip_address("10.9.9.9"), "hooks.internal", policy, 8443) is None
    assert http_client.forbidden_reason(ipaddress.ip_address("10.9.9.9"), "hooks.internal", policy, 80)
    message = refused("http://127.0.0.1:8000/api/v1/engine", policy)
    assert "loopback address on a port its allow-list entry does not open (8000)" in message


@pytest.mark.parametrize("entry, complaint", [
    ("127.0.0.1", "has no port"),
    ("10.0.0.0/8", "has no port"),
    ("hooks.internal", "has no port"),
    ("[::1]", "has no port"),
    ("127.0.0.1:http", "is not a port"),
    ("127.0.0.1:0", "ports are 1 to 65535"),
    ("127.0.0.1:9000-8000", "low ≤ high"),
    ("127.0.0.1:70000", "ports are 1 to 65535"),
])
def test_allow_list_entries_without_a_valid_port_are_refused_saying_how_to_write_them(entry, complaint):
    with pytest.raises(http_client.AllowListError) as info:
        Policy.from_allow_list([entry])
    assert complaint in str(info.value) and entry in str(info.value)


def test_a_platform_with_an_allow_list_entry_without_port_does_not_start(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OBSERVATORY_DATA_DIR": str(tmp_path), "NOTIFY_ALLOW_PRIVATE_DESTINATIONS": "127.0.0.1"}
    out = subprocess.run([sys.executable, str(root / "manage.py"), "check"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "NOTIFY_ALLOW_PRIVATE_DESTINATIONS entry '127.0.0.1' has no port" in out.stderr
