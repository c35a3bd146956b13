"""Calls to a running fleet controller's control API with the run directory's token, from another process
(``python -m engine status|down``, the platform's fleet link)."""
from __future__ import annotations

import json
from urllib import error as urlerror
from urllib import request as urlrequest

from engine.launcher.fleet_spec import FleetSpec
from engine.launcher.run_dir import CONTROL_TOKEN_FILE


class ControlUnavailable(RuntimeError):
    """No fleet controller answers at the spec's control address (the reason says why)."""


def control_request(spec: FleetSpec, method: str, path: str, body: dict | None = None, *,
                    timeout: float = 5.0) -> tuple[int, dict]:
    """One call to the running controller's control API with the run directory's token: (HTTP status, JSON
    object; a body that is not one is returned as {"error": its start}). Raises ControlUnavailable when no
    controller has run there (no token) or none answers."""
    try:
        token = (spec.run_dir / CONTROL_TOKEN_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        raise ControlUnavailable(f"no fleet controller has run in {spec.run_dir} (no control token)") from None
    data = json.dumps(body).encode() if body is not None else (b"" if method != "GET" else None)
    request = urlrequest.Request(spec.control_url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urlrequest.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urlerror.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urlerror.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ControlUnavailable(f"the fleet controller at {spec.control_url} does not answer ({reason})") from None
    try:
        payload = json.loads(raw or b"{}")
    except ValueError:
        payload = {"error": raw[:300].decode("utf-8", "replace")}
    return status, payload if isinstance(payload, dict) else {"value": payload}
