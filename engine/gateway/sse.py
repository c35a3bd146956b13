"""Relays an OpenAI-style server-sent-event stream event by event, noting what the span needs on the way.

Bytes go out as soon as an event is complete (an upstream read that holds whole events
is forwarded as it came, without copying). The gateway needs from the stream: the
response id and model (first chunk), finish reasons, usage and any error. A chunk is
decoded as JSON only when it may hold one of those (the first chunk, or one mentioning
``usage``, ``error`` or a non-null ``finish_reason``), because decoding every token's
chunk would be most of the gateway's CPU per token. The final usage chunk
(``"choices": []`` with ``usage``) is dropped when the gateway asked for it on the
client's behalf (``stream_options.include_usage``) and the client did not.
"""
from __future__ import annotations

import re

import orjson

# What ends one event: a blank line, after LF, CR LF or CR line ends.
EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_FINISH = b'"finish_reason"'
_FINISH_NULL = b'"finish_reason":null'
_FINISH_NULL_SPACED = b'"finish_reason": null'
# An event longer than this without a terminator is passed on uninspected rather than buffered further.
MAX_EVENT_BYTES = 4 * 1024 * 1024


def event_data(event: bytes) -> bytes | None:
    """The data of one event (its ``data:`` lines' values joined by newlines); None for an event without any (a
    comment or a keep-alive)."""
    if event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event:
        return event[6:]  # the usual single-line event
    lines = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class SseRelay:
    def __init__(self, keep_usage_chunk: bool):
        self.keep_usage_chunk = keep_usage_chunk
        self.response_id: str | None = None
        self.model: str | None = None
        self.usage: dict | None = None
        self.error: object = None
        self.finish_reasons: dict[int, str] = {}
        self.done = False
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client for this upstream read (possibly empty)."""
        buffer = self._pending + chunk if self._pending else chunk
        general = b"\r" in buffer  # vLLM ends events with "\n\n"; other servers may use CR LF
        pieces: list[bytes] = []
        start = 0  # first byte not yet emitted or dropped
        position = 0
        while True:
            if general:
                match = EVENT_END.search(buffer, position)
                if match is None:
                    break
                event_end, next_position = match.start(), match.end()
            else:
                event_end = buffer.find(b"\n\n", position)
                if event_end < 0:
                    break
                next_position = event_end + 2
            if not self._inspect(buffer[position:event_end]):
                if start < position:
                    pieces.append(buffer[start:position])
                start = next_position
            position = next_position
        if start < position:
            pieces.append(buffer if start == 0 and position == len(buffer) else buffer[start:position])
        self._pending = buffer[position:] if position < len(buffer) else b""
        if len(self._pending) > MAX_EVENT_BYTES:
            pieces.append(self._pending)
            self._pending = b""
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an event without its closing blank line)."""
        rest, self._pending = self._pending, b""
        if rest.strip() and not self._inspect(rest.strip()):
            return b""
        return rest

    def _inspect(self, event: bytes) -> bool:
        """Note what ``event`` says; False when it must not reach the client."""
        data = event_data(event)
        if data is None:
            return True  # a comment or keep-alive
        if not self._worth_decoding(data):
            return True
        if data.strip() == b"[DONE]":
            self.done = True
            return True
        try:
            document = orjson.loads(data)
        except orjson.JSONDecodeError:
            return True
        if not isinstance(document, dict):
            return True
        return self._note(document)

    def _worth_decoding(self, data: bytes) -> bool:
        if self.response_id is None or self.model is None or data[:1] != b"{":
            return True
        if b'"usage"' in data or b'"error"' in data:
            return True
        finishes = data.count(_FINISH)
        return finishes > 0 and finishes > data.count(_FINISH_NULL) + data.count(_FINISH_NULL_SPACED)

    def _note(self, document: dict) -> bool:
        if self.response_id is None and isinstance(document.get("id"), str):
            self.response_id = document["id"]
        if self.model is None and isinstance(document.get("model"), str):
            self.model = document["model"]
        if "error" in document:
            self.error = document["error"]
        choices = document.get("choices")
        if isinstance(choices, list):
            for position, choice in enumerate(choices):
                if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                    index = choice.get("index")
                    self.finish_reasons[index if isinstance(index, int) else position] = choice["finish_reason"]
        usage = document.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if not self.keep_usage_chunk and not choices:
                return False
        return True
