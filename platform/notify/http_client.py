"""Every outbound request of the notify app: SSRF-checked destinations, pinned IPs, checked redirects, hard timeouts.

A destination URL must be http or https. Its host is resolved here and every address is checked: private,
loopback, link-local, multicast, reserved, unspecified, carrier-grade NAT and cloud-metadata addresses are
refused (IPv4 addresses embedded in IPv6 — mapped, 6to4, Teredo, NAT64 — are judged as the IPv4 address),
unless ``NOTIFY["ALLOW_PRIVATE_DESTINATIONS"]`` lists a matching CIDR, address or host name with the
destination's port (``127.0.0.1:9093``, ``10.0.0.0/8:443``, ``[fd00::/8]:8080-8090``, ``hooks.internal:443``):
an entry opens one port or range, never a whole host, so a channel cannot be pointed at another service of
an allowed host (the platform's own ports included) and have its answer read back. The connection
then goes to the checked address itself (no second DNS lookup that a rebinding attacker could answer
differently), with the original Host header and TLS server name. Redirects are followed by hand, each
target checked the same way, at most ``MAX_REDIRECTS``. Proxies from the environment are never used (plain
``http.client``). No Django here except for reading the settings in ``policy_from_settings``.
"""
from __future__ import annotations

import base64
import dataclasses
import http.client
import ipaddress
import socket
import ssl
import time
from urllib.parse import unquote, urljoin, urlsplit

from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200")
)
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata"})
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_REDIRECTS = {301, 302, 303, 307, 308}
USER_AGENT = "llm-latency-observatory-webhooks/1"


class RequestRefused(Exception):
    """The request was not (or not fully) made because of our own rules: scheme, SSRF, redirects. Permanent."""


class TransportError(Exception):
    """Connecting, TLS, timeouts, a broken response, DNS failure. Transient: worth retrying later."""


class RequestTimeout(TransportError):
    """No (complete) answer within the connect, read or total time limit. Transient."""


class AllowListError(ValueError):
    """An entry of NOTIFY_ALLOW_PRIVATE_DESTINATIONS that cannot be used; the message says how to write it."""


def parse_allow_entry(entry: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network | str, int, int]:
    """`ADDRESS_OR_CIDR_OR_HOST:PORT` or `…:LOW-HIGH` (IPv6 in brackets) → (network or host name, low, high)."""
    text = entry.strip()
    if text.startswith("["):
        target, sep, ports = text[1:].partition("]:")
    else:
        target, sep, ports = text.rpartition(":")
    if not sep or not target or not ports:
        raise AllowListError(
            f"NOTIFY_ALLOW_PRIVATE_DESTINATIONS entry {entry!r} has no port: write it as ADDRESS:PORT, CIDR:PORT or "
            f"HOST:PORT (a range LOW-HIGH is allowed; IPv6 in brackets, e.g. [fd00::/8]:443), so that it opens the "
            f"service meant and not every port of the host")
    low, _, high = ports.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise AllowListError(f"NOTIFY_ALLOW_PRIVATE_DESTINATIONS entry {entry!r}: {ports!r} is not a port or "
                             "a range LOW-HIGH") from None
    if not 1 <= lo <= hi <= 65535:
        raise AllowListError(f"NOTIFY_ALLOW_PRIVATE_DESTINATIONS entry {entry!r}: ports are 1 to 65535, low ≤ high")
    try:
        return ipaddress.ip_network(target, strict=False), lo, hi
    except ValueError:
        host = target.lower().rstrip(".")
        if not host or any(c in host for c in "/ []"):
            raise AllowListError(f"NOTIFY_ALLOW_PRIVATE_DESTINATIONS entry {entry!r}: {target!r} is not an "
                                 "address, a CIDR or a host name") from None
        return host, lo, hi


@dataclasses.dataclass(frozen=True)
class Policy:
    # ((network, low port, high port), ...) and ((host name, low port, high port), ...)
    allow_networks: tuple = ()
    allow_hosts: tuple = ()
    connect_timeout: float = 5.0
    read_timeout: float = 10.0
    total_timeout: float = 30.0
    max_redirects: int = 3
    max_response_bytes: int = 64 * 1024

    @classmethod
    def from_allow_list(cls, entries, **kwargs) -> "Policy":
        """Entries are `CIDR:PORT` ("10.0.0.0/8:443"), `ADDRESS:PORT` ("127.0.0.1:9093", "[::1]:9093") or
        `HOST:PORT` ("hooks.internal:8443"); a port may be a range LOW-HIGH. AllowListError otherwise."""
        networks, hosts = [], []
        for entry in entries or ():
            if not str(entry).strip():
                continue
            target, lo, hi = parse_allow_entry(str(entry))
            (hosts if isinstance(target, str) else networks).append((target, lo, hi))
        return cls(allow_networks=tuple(networks), allow_hosts=tuple(hosts), **kwargs)

    def allows_host(self, host: str, port: int) -> bool:
        return any(name == host and lo <= port <= hi for name, lo, hi in self.allow_hosts)

    def allows_ip(self, ip, port: int, *, exact: bool = False) -> bool:
        return any(ip in net and lo <= port <= hi and (not exact or net.num_addresses == 1)
                   for net, lo, hi in self.allow_networks)


def policy_from_settings() -> Policy:
    cfg = settings.NOTIFY
    return Policy.from_allow_list(
        cfg.get("ALLOW_PRIVATE_DESTINATIONS", ()),
        connect_timeout=float(cfg.get("CONNECT_TIMEOUT_SECONDS", 5.0)),
        read_timeout=float(cfg.get("READ_TIMEOUT_SECONDS", 10.0)),
        total_timeout=float(cfg.get("TOTAL_TIMEOUT_SECONDS", 30.0)),
        max_redirects=int(cfg.get("MAX_REDIRECTS", 3)),
    )


@dataclasses.dataclass
class Response:
    status: int
    headers: dict  # lower-case names
    body: bytes  # at most Policy.max_response_bytes
    url: str  # the URL that answered (after redirects)
    redirects: int


@dataclasses.dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str
    port: int
    addresses: tuple  # checked, in resolver order
    request_path: str
    basic_auth: str | None


def _embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    if ip.version != 6:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _category(ip: IPAddress) -> str | None:
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.version == 4 and ip in _CGNAT:
        return "a carrier-grade NAT address"
    if ip.is_reserved:
        return "a reserved address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:
        return "a non-public address"
    return None


def forbidden_reason(ip: IPAddress, host: str, policy: Policy, port: int) -> str | None:
    """Why connecting to ``ip`` (resolved from ``host``) on ``port`` is refused, or None when it is allowed."""
    embedded = _embedded_ipv4(ip)
    if ip in METADATA_ADDRESSES or (embedded is not None and embedded in METADATA_ADDRESSES):
        # Only an exact entry opens a metadata endpoint: a broad CIDR such as 169.254.0.0/16 does not.
        exact = policy.allows_ip(ip, port, exact=True) or (
            embedded is not None and policy.allows_ip(embedded, port, exact=True))
        return None if exact else "a cloud metadata address"
    if policy.allows_host(host, port) or policy.allows_ip(ip, port):
        return None
    if embedded is not None:
        if policy.allows_ip(embedded, port):
            return None
        reason = _category(embedded)
        return f"{reason} (IPv4 {embedded} inside IPv6)" if reason else None
    reason = _category(ip)
    if reason and (any(ip in net for net, _, _ in policy.allow_networks)
                   or any(name == host for name, _, _ in policy.allow_hosts)):
        return f"{reason} on a port its allow-list entry does not open ({port})"
    return reason


def check_url(url: str, policy: Policy, *, resolve: bool = True) -> Target:
    """Parse and check a destination. Raises RequestRefused (bad URL, forbidden address) or TransportError
    (DNS failure). With ``resolve=False`` only the URL and an IP-literal host are checked (for early
    validation of user input; the full check always runs again before sending)."""
    if not isinstance(url, str) or not url:
        raise RequestRefused("the URL is empty")
    if any(c in url for c in "\r\n\t ") or any(ord(c) < 32 for c in url):
        raise RequestRefused("the URL contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RequestRefused(f"invalid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise RequestRefused(f"only http and https URLs are allowed (got {scheme or 'no'} scheme)")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise RequestRefused("the URL has no host")
    port = port or (443 if scheme == "https" else 80)
    if host in METADATA_HOSTS and not policy.allows_host(host, port):
        raise RequestRefused(f"refused: {host} is a cloud metadata endpoint")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        candidates = [literal]
    elif not resolve:
        candidates = []
    else:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise TransportError(f"could not resolve {host}: {exc}") from None
        candidates = []
        for info in infos:
            ip = ipaddress.ip_address(info[4][0].split("%", 1)[0])
            if ip not in candidates:
                candidates.append(ip)
    allowed, refused = [], []
    for ip in candidates:
        reason = forbidden_reason(ip, host, policy, port)
        (refused if reason else allowed).append((ip, reason))
    if candidates and not allowed:
        ip, reason = refused[0]
        where = f"{host} is" if literal is not None else f"{host} resolves to {ip},"
        raise RequestRefused(
            f"refused: {where} {reason}; private destinations need NOTIFY_ALLOW_PRIVATE_DESTINATIONS"
        )
    request_path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    basic = None
    if parts.username is not None:
        creds = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        basic = "Basic " + base64.b64encode(creds).decode("ascii")
    return Target(url, scheme, host, port, tuple(str(ip) for ip, _ in allowed), request_path, basic)


class _Pinned:
    """A connection (mixed into http.client's) to a checked address, while the Host header, and over TLS the SNI
    and the certificate check, keep the name from the URL."""

    def __init__(self, host, port, address, connect_timeout, **kwargs):
        super().__init__(host, port, **kwargs)
        self._address = address
        self._connect_timeout = connect_timeout

    def _socket(self) -> socket.socket:
        return socket.create_connection((self._address, self.port), self._connect_timeout)


class _PinnedHTTPConnection(_Pinned, http.client.HTTPConnection):
    def connect(self):
        self.sock = self._socket()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(self.timeout)


class _PinnedHTTPSConnection(_Pinned, http.client.HTTPSConnection):
    def connect(self):
        sock = self._socket()
        sock.settimeout(self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # SNI and cert check on the name


def _tls_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    try:
        import certifi

        context.load_verify_locations(certifi.where())
    except (ImportError, OSError):
        pass
    return context


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("total time limit reached")
    return left


def _send_once(target: Target, method: str, body: bytes | None, headers: dict, deadline: float,
               policy: Policy) -> tuple[int, dict, bytes]:
    last_error: Exception | None = None
    for address in target.addresses:
        timeout = min(policy.read_timeout, _remaining(deadline))
        connect_timeout = min(policy.connect_timeout, timeout)
        if target.scheme == "https":
            conn = _PinnedHTTPSConnection(target.host, target.port, address, connect_timeout, timeout=timeout,
                                          context=_tls_context())
        else:
            conn = _PinnedHTTPConnection(target.host, target.port, address, connect_timeout, timeout=timeout)
        try:
            try:
                conn.connect()
            except (ConnectionError, TimeoutError, OSError) as exc:
                if isinstance(exc, ssl.SSLError):
                    raise
                last_error = exc
                continue  # the next address of the same host, if any
            request_headers = dict(headers)
            if target.basic_auth:
                request_headers["Authorization"] = target.basic_auth
            conn.request(method, target.request_path, body=body, headers=request_headers)
            # Keep our own reference: with "Connection: close" (HTTP/1.0 receivers) http.client drops
            # conn.sock once the response starts, while the response still reads from this socket.
            sock = conn.sock
            sock.settimeout(min(policy.read_timeout, _remaining(deadline)))
            response = conn.getresponse()
            chunks, size = [], 0
            try:
                while size < policy.max_response_bytes:
                    sock.settimeout(min(policy.read_timeout, _remaining(deadline)))
                    chunk = response.read1(policy.max_response_bytes - size)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
            except (OSError, http.client.HTTPException):
                pass  # the status has arrived and decides; a body that stalls or breaks off is only for the log
            return response.status, {k.lower(): v for k, v in response.getheaders()}, b"".join(chunks)
        finally:
            conn.close()
    raise last_error or ConnectionError("no address to connect to")


def request(url: str, body: bytes | None, headers: dict, policy: Policy | None = None,
            method: str = "POST") -> Response:
    """Send one request (following up to ``policy.max_redirects`` checked redirects) and return the final
    answer, whatever its status. Raises RequestRefused or TransportError."""
    policy = policy or policy_from_settings()
    deadline = time.monotonic() + policy.total_timeout
    headers = {"User-Agent": USER_AGENT, **headers}
    current, redirects = url, 0
    while True:
        try:
            target = check_url(current, policy)
        except RequestRefused as exc:
            if redirects:
                raise RequestRefused(f"redirect to {current} {exc}") from None
            raise
        try:
            status, response_headers, response_body = _send_once(target, method, body, headers, deadline, policy)
        except TimeoutError as exc:
            waited = policy.total_timeout - max(0.0, deadline - time.monotonic())
            raise RequestTimeout(f"timed out after {waited:.1f} s ({exc or 'no answer'})") from None
        except ssl.SSLError as exc:
            raise TransportError(f"TLS error: {exc}") from None
        except (OSError, http.client.HTTPException) as exc:
            raise TransportError(f"connection error: {type(exc).__name__}: {exc}") from None
        location = response_headers.get("location")
        if status in _REDIRECTS and location:
            if redirects >= policy.max_redirects:
                raise RequestRefused(f"too many redirects (more than {policy.max_redirects})")
            redirects += 1
            following = urljoin(current, location)
            if urlsplit(following).netloc != urlsplit(current).netloc:
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            if status == 303 and method == "POST":
                # 303 See Other: the POST was processed, the answer is elsewhere. 301/302 keep the POST and its
                # body like 307/308 (curl --post301 --post302): a webhook turned into a GET would lose its payload.
                method, body = "GET", None
                headers = {k: v for k, v in headers.items() if k.lower() not in ("content-type", "content-length")}
            current = following
            continue
        return Response(status, response_headers, response_body, current, redirects)
