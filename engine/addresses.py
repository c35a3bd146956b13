"""``HOST:PORT`` bind addresses as the engine's processes take them, and the URL that reaches one."""
from __future__ import annotations


def parse_bind(text: str, *, lowest_port: int = 1) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port); ValueError with the reason otherwise.

    ``lowest_port=0`` also accepts port 0 (the kernel picks one), for a server that reports where it listens.
    """
    if not isinstance(text, str):
        raise ValueError(f"an address must be HOST:PORT, not {text!r}")
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"an address must be HOST:PORT, not {text!r}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"an address must be HOST:PORT or [IPv6]:PORT, not {text!r}")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 address needs brackets, e.g. [::1]:8100, not {text!r}")
    port = int(port_text)
    if not lowest_port <= port <= 65535:
        raise ValueError(f"port must be in {lowest_port}..65535, not {port}")
    return host, port


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:8100``): what parse_bind reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def http_url(host: str, port: int) -> str:
    """The ``http://`` URL of a server bound to (host, port); a wildcard bind is reached through loopback."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host_port(host, port)}"
