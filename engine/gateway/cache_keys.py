"""What the response cache knows of a request: its namespace, its canonical key, whether it may be cached at all.

**Canonical key.** The request body minus the fields that cannot change the answer
(``IGNORED_FIELDS``: ``stream``, ``stream_options``, ``user``, ``metadata``, the cache's own
body flag, ...), numbers normalised (an integral float is written as an integer, so
``"temperature": 0.0`` and ``0`` are one key; a non-finite number makes the request not
cacheable), serialised as JSON with sorted keys at every level. Every other field is part
of the key, known or not (``messages``/``prompt``, ``temperature``, ``top_p``,
``max_tokens``, ``stop``, ``n``, ``seed``, ``tools``, ``response_format``, ``logprobs``, vLLM's
extra sampling parameters, ...): an unknown field may change the answer, so it separates
keys. The key also holds its group, namespace and operation. It is kept whole with each
entry and compared on lookup: two requests whose digests collide never share an answer.

**Namespace.** A hash of the request's ``Authorization`` header together with its
``OpenAI-Project`` header: two projects never share answers, nor do two credentials (the
gateway cannot check that a credential belongs to the project it names, so the project
header alone would let anyone read a project's answers). No credential and no project:
the shared ``anonymous`` namespace. The model is part of every key.

**Threshold.** A group whose semantic cache says ``client_threshold: true`` lets a request set
the least similarity of its own semantic hit with ``X-Observatory-Cache-Threshold: 0.85`` (a
number in (0, 1]), for measuring a threshold (a regression run's sweep). It changes what counts
as a hit, never which entries are compared: the namespace, model and context still decide that.
Anywhere else the header is refused (400), so a measurement never silently runs at the
configured threshold.

**Deterministic.** A request is cached when it asks for greedy decoding (``temperature``
0) or names an integer ``seed`` (vLLM's seeded sampling gives the same tokens for the same
request); any other request samples, and is cached only in a group with
``nondeterministic: true``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re

import orjson

from engine.gateway.errors import GatewayError

# Client controls: the body flag (stripped before the request goes upstream) and the header.
BODY_FLAG = "observatory_cache"
HEADER = "X-Observatory-Cache"
THRESHOLD_HEADER = "X-Observatory-Cache-Threshold"
_DECIMAL = re.compile(r"^(?:\d{1,3}(?:\.\d{1,12})?|\.\d{1,12})$")
# Fields that never change the answer: delivery (stream), who asks (user, metadata), OpenAI's stored completions,
# vLLM's request id and scheduling priority, and the cache's own flag.
IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "store", "service_tier", "request_id",
                            "priority", BODY_FLAG})
ANONYMOUS = "anonymous"
# The longest user text the semantic cache embeds (characters); longer queries are looked up exactly only.
MAX_SEMANTIC_TEXT = 16_384


class NotCacheable(Exception):
    """This request cannot be cached; ``reason`` is the miss reason recorded on its span."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class Directives:
    """What the client allows: serve it from the cache (``lookup``), keep its answer (``store``)."""

    lookup: bool = True
    store: bool = True

    @property
    def bypass(self) -> bool:
        return not self.lookup


_BODY_VALUES = {"bypass": Directives(False, False), "refresh": Directives(False, True),
                "default": Directives(True, True)}


def read_directives(headers, payload: dict) -> Directives:
    """The client's cache controls, from ``Cache-Control``, ``X-Observatory-Cache`` and the body flag.

    ``Cache-Control: no-store``, ``X-Observatory-Cache: bypass`` and ``"observatory_cache": "bypass"``
    (or ``false``): neither served from nor stored in the cache. ``Cache-Control: no-cache``,
    ``X-Observatory-Cache: refresh`` and ``"observatory_cache": "refresh"``: a fresh answer that
    then replaces the stored one. Any other value of the gateway's own controls is a 400.
    """
    lookup = store = True
    for value in headers.getall("Cache-Control", ()):
        tokens = {token.strip().lower().partition("=")[0] for token in value.split(",")}
        if "no-store" in tokens:
            lookup = store = False
        elif "no-cache" in tokens:
            lookup = False
    header = headers.get(HEADER)
    if header is not None:
        chosen = _BODY_VALUES.get(header.strip().lower())
        if chosen is None:
            raise GatewayError(400, f"{HEADER} must be bypass, refresh or default, got {header[:64]!r}",
                               "invalid_cache_directive")
        lookup, store = lookup and chosen.lookup, store and chosen.store
    if BODY_FLAG in payload:
        flag = payload[BODY_FLAG]
        chosen = _BODY_VALUES["bypass"] if flag is False else (
            _BODY_VALUES.get(flag) if isinstance(flag, str) else None)
        if chosen is None:
            raise GatewayError(400, f"'{BODY_FLAG}' must be \"bypass\", \"refresh\", \"default\" or false",
                               "invalid_cache_directive", param=BODY_FLAG)
        lookup, store = lookup and chosen.lookup, store and chosen.store
    return Directives(lookup, store)


def read_threshold(headers, allowed: bool) -> float | None:
    """The request's own semantic threshold (``X-Observatory-Cache-Threshold``), None when it sets none; a 400
    when the value is not one number in (0, 1] or the group's semantic cache does not take a client's threshold
    (``allowed``: its ``client_threshold``)."""
    values = headers.getall(THRESHOLD_HEADER, ())
    if not values:
        return None
    if not allowed:
        raise GatewayError(400, f"{THRESHOLD_HEADER}: this replica group's semantic cache does not take a client's "
                                "threshold (its cache.semantic.client_threshold is off, or it has no semantic cache)",
                           "cache_threshold_not_allowed")
    text = values[0].strip()
    value = float(text) if len(values) == 1 and _DECIMAL.match(text) else math.nan
    if not 0 < value <= 1:  # NaN fails too
        shown = text[:32] if len(values) == 1 else f"{len(values)} values"
        raise GatewayError(400, f"{THRESHOLD_HEADER} must be one decimal number in (0, 1] such as 0.85, got "
                                f"{shown!r}", "invalid_cache_threshold")
    return value


def _header_bytes(value: str | None) -> bytes:
    if value is None:
        return b"\xff"  # absent differs from empty
    data = value.encode("utf-8", "surrogateescape")
    return len(data).to_bytes(4, "big") + data


def namespace(headers) -> str:
    """The request's namespace: a hash of its credential and project, or ``anonymous`` with neither."""
    authorization = headers.get("Authorization")
    project = headers.get("OpenAI-Project")
    if authorization is None and project is None:
        return ANONYMOUS
    digest = hashlib.sha256(b"ns1\0" + _header_bytes(authorization) + _header_bytes(project))
    return digest.hexdigest()[:32]


def _normalise(value: object) -> object:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise NotCacheable("invalid_number")
        return int(value) if value.is_integer() and abs(value) < 2 ** 63 else value
    if isinstance(value, dict):
        return {key: _normalise(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_normalise(item) for item in value]
    return value


def canonical_request(payload: dict) -> dict:
    """The request as the key sees it: ignored fields dropped, numbers normalised. Raises NotCacheable."""
    return {key: _normalise(value) for key, value in payload.items() if key not in IGNORED_FIELDS}


def is_deterministic(request: dict) -> bool:
    temperature = request.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature == 0:
        return True
    seed = request.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


def key_bytes(group: str, space: str, operation: str, request: dict) -> bytes:
    """The full key: sorted-key JSON of the group, namespace, operation and canonical request."""
    return orjson.dumps({"v": 1, "group": group, "ns": space, "op": operation, "request": request},
                        option=orjson.OPT_SORT_KEYS)


def _user_text(content: object) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None  # an image or audio part: the text alone does not say what is asked
            parts.append(part["text"])
        return "\n".join(parts)
    return None


def semantic_query(operation: str, request: dict) -> tuple[str, dict]:
    """(the text to embed, the request with that text taken out) or NotCacheable.

    The text is the last ``user`` message of a chat (its text parts joined by newlines) or a
    completion's prompt (one string). Everything else, earlier turns and the system prompt
    included, must match exactly: it stays in the context, which is compared whole.
    """
    if operation == "chat":
        messages = request.get("messages")
        if not isinstance(messages, list):
            raise NotCacheable("not_text")
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if isinstance(message, dict) and message.get("role") == "user":
                text = _user_text(message.get("content"))
                if text is None:
                    raise NotCacheable("not_text")
                context_messages = list(messages)
                context_messages[index] = dict(message, content=None)
                context = dict(request, messages=context_messages)
                break
        else:
            raise NotCacheable("not_text")
    else:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise NotCacheable("not_text")
        text, context = prompt, dict(request, prompt=None)
    if not text.strip():
        raise NotCacheable("not_text")
    if len(text) > MAX_SEMANTIC_TEXT:
        raise NotCacheable("too_large")
    return text, context
