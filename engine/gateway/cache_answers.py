"""Stored answers: a streamed answer assembled into its JSON form, and a stored answer served as JSON or as a stream.

The cache keeps one form of every answer, the JSON body of a non-streamed completion, so
a hit serves a streamed and a non-streamed request alike. A streamed answer is assembled
from its chunks after the stream ended: per choice, the text (or the message's content,
reasoning, refusal and tool calls) concatenated, its logprobs concatenated, its finish
reason, and the usage chunk. A chunk the assembly does not understand (an unknown
``delta`` field, an error event) leaves the answer unstored rather than stored wrong.

A hit is served under a new id (``chatcmpl-cache-…``/``cmpl-cache-…``) and the current
``created`` time: the platform joins hops by response id, and an old id would tie the hit
to the engine request that first produced the answer. Its usage leaves out
``prompt_tokens_details`` (the engine's prefix-cache count of that first request). As a stream it is one chunk per
choice holding its whole delta and finish reason, the usage chunk when the client asked
for it (``stream_options.include_usage``), then ``data: [DONE]``.
"""
from __future__ import annotations

import time
import uuid

import orjson

from engine.gateway.sse import EVENT_END, event_data

# Finish reasons of an answer worth keeping; "abort", "error" or none at all mean it is incomplete.
FINISHED = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
_TEXT_DELTAS = ("content", "reasoning_content", "reasoning", "refusal")
_CHAT_DELTAS = frozenset(_TEXT_DELTAS + ("role", "tool_calls", "function_call"))
_COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class Unassemblable(Exception):
    """A stream whose final answer cannot be built faithfully."""


def finished_cleanly(document: object) -> bool:
    """Whether a completion document is a whole answer: choices, each with a finishing reason."""
    if not isinstance(document, dict):
        return False
    choices = document.get("choices")
    return isinstance(choices, list) and bool(choices) and all(
        isinstance(choice, dict) and choice.get("finish_reason") in FINISHED for choice in choices)


def _events(raw: bytes):
    for event in EVENT_END.split(raw):
        data = event_data(event)
        if data is None:
            continue
        if data.strip() == b"[DONE]":
            return
        try:
            document = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise Unassemblable("a chunk is not JSON") from None
        if not isinstance(document, dict) or "error" in document:
            raise Unassemblable("an error event")
        yield document


def _concat(target: dict, key: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise Unassemblable(f"{key} is not text")
    target[key] = (target.get(key) or "") + value


def _merge_tool_calls(message: dict, deltas: object) -> None:
    if not isinstance(deltas, list):
        raise Unassemblable("tool_calls is not a list")
    calls = message.setdefault("tool_calls", [])
    for delta in deltas:
        if not isinstance(delta, dict) or not isinstance(delta.get("index", 0), int):
            raise Unassemblable("a tool call delta without an index")
        position = delta.get("index", 0)
        while len(calls) <= position:
            calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[position]
        for key in ("id", "type"):
            if isinstance(delta.get(key), str):
                call[key] = delta[key]
        function = delta.get("function") or {}
        if not isinstance(function, dict):
            raise Unassemblable("a tool call's function is not an object")
        for key in ("name", "arguments"):
            _concat(call["function"], key, function.get(key))


def _merge_chat(choice: dict, delta: object) -> None:
    if not isinstance(delta, dict):
        raise Unassemblable("a delta is not an object")
    unknown = set(delta) - _CHAT_DELTAS
    if unknown:
        raise Unassemblable(f"unknown delta field(s) {sorted(unknown)}")
    message = choice.setdefault("message", {"role": "assistant", "content": None})
    if isinstance(delta.get("role"), str):
        message["role"] = delta["role"]
    for key in _TEXT_DELTAS:
        _concat(message, key, delta.get(key))
    if delta.get("tool_calls") is not None:
        _merge_tool_calls(message, delta["tool_calls"])
    if delta.get("function_call") is not None:
        function = message.setdefault("function_call", {"name": "", "arguments": ""})
        for key in ("name", "arguments"):
            _concat(function, key, (delta["function_call"] or {}).get(key))


def _merge_logprobs(choice: dict, logprobs: object, chat: bool) -> None:
    if logprobs is None:
        return
    if not isinstance(logprobs, dict):
        raise Unassemblable("logprobs is not an object")
    merged = choice.get("logprobs") or {}
    for key in (("content", "refusal") if chat else _COMPLETION_LOGPROBS):
        part = logprobs.get(key)
        if part is None:
            continue
        if not isinstance(part, list):
            raise Unassemblable(f"logprobs.{key} is not a list")
        merged[key] = (merged.get(key) or []) + part
    choice["logprobs"] = merged


def assemble_stream(raw: bytes, operation: str) -> dict:
    """The JSON answer a stream of chunks amounts to; Unassemblable when it cannot be built faithfully."""
    chat = operation == "chat"
    answer: dict = {}
    choices: dict[int, dict] = {}
    for chunk in _events(raw):
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in chunk and key not in answer:
                answer[key] = chunk[key]
        if isinstance(chunk.get("usage"), dict):
            answer["usage"] = chunk["usage"]
        parts = chunk.get("choices") or []
        if not isinstance(parts, list):
            raise Unassemblable("choices is not a list")
        for part in parts:
            if not isinstance(part, dict) or not isinstance(part.get("index", 0), int):
                raise Unassemblable("a choice without an index")
            choice = choices.setdefault(part.get("index", 0), {"index": part.get("index", 0)})
            if chat:
                _merge_chat(choice, part.get("delta") or {})
            else:
                _concat(choice, "text", part.get("text"))
            _merge_logprobs(choice, part.get("logprobs"), chat)
            for key in ("finish_reason", "stop_reason"):
                if part.get(key) is not None:
                    choice[key] = part[key]
    if not choices:
        raise Unassemblable("no choices")
    ordered = []
    for index in sorted(choices):
        choice = choices[index]
        if not chat:
            choice.setdefault("text", "")
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
        ordered.append(choice)
    answer["object"] = "chat.completion" if chat else "text_completion"
    answer["choices"] = ordered
    return answer


def _fresh(document: dict, operation: str) -> dict:
    prefix = "chatcmpl" if operation == "chat" else "cmpl"
    return dict(document, id=f"{prefix}-cache-{uuid.uuid4().hex}", created=int(time.time()))


def hit_document(stored: bytes, operation: str) -> dict:
    """The stored answer under a new id and the current time, its usage without ``prompt_tokens_details``: the
    engine's prefix-cache figures there were the original request's, not this one's."""
    document = _fresh(orjson.loads(stored), operation)
    usage = document.get("usage")
    if isinstance(usage, dict) and "prompt_tokens_details" in usage:
        document["usage"] = {key: value for key, value in usage.items() if key != "prompt_tokens_details"}
    return document


def _chunk_choice(choice: dict, chat: bool) -> dict:
    out = {"index": choice.get("index", 0)}
    if chat:
        message = choice.get("message") or {}
        delta = {key: value for key, value in message.items() if value is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [dict(call, index=position) for position, call in enumerate(delta["tool_calls"])]
        out["delta"] = delta
    else:
        out["text"] = choice.get("text", "")
    out["logprobs"] = choice.get("logprobs")
    out["finish_reason"] = choice.get("finish_reason")
    if "stop_reason" in choice:
        out["stop_reason"] = choice["stop_reason"]
    return out


def render_stream(document: dict, operation: str, include_usage: bool) -> bytes:
    """A hit's answer as an OpenAI chunk stream (SSE bytes, ``[DONE]`` included)."""
    chat = operation == "chat"
    base = {key: document[key] for key in ("id", "created", "model", "system_fingerprint") if key in document}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    events = [b"data: " + orjson.dumps(dict(base, choices=[_chunk_choice(choice, chat)])) + b"\n\n"
              for choice in document.get("choices") or ()]
    if include_usage and isinstance(document.get("usage"), dict):
        events.append(b"data: " + orjson.dumps(dict(base, choices=[], usage=document["usage"])) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)
