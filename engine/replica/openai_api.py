"""vLLM's OpenAI-compatible request validation and response shapes, for the simulated replica.

Every body a client sends is checked here before anything reaches the simulator: wrong
types, impossible values and prompts that do not fit the context are refused with the
message and status vLLM would give (``{"object": "error", "message": ..., "type":
"BadRequestError", "code": 400}``). The response builders produce the same JSON vLLM's
``serving_completion.py`` / ``serving_chat.py`` produce, field for field where it matters
to clients (ids ``cmpl-…`` / ``chatcmpl-…``, ``object``, ``created``, ``model``,
``choices`` with ``finish_reason`` and ``stop_reason``, ``usage``).

Chat prompts are "rendered" the way Llama-3's chat template frames messages: a begin
token, then per message a header (role) and an end-of-turn token, then the assistant
header that asks for the answer. The simulator counts those framing tokens, so a chat
prompt costs a few tokens more than its text, as it does on vLLM.
"""
from __future__ import annotations

import dataclasses
import math
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from engine.tokens import token_ids

COMPLETION = "completion"
CHAT = "chat"

# Roles vLLM's chat path accepts in ``messages``.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Stand-in ids for the chat template's special tokens (Llama-3 numbering), so identical
# conversations hash to identical blocks in the simulator's prefix cache.
_BEGIN_OF_TEXT = 128000
_START_HEADER = 128006
_END_HEADER = 128007
_END_OF_TURN = 128009
_ROLE_IDS = {role: 882 + index for index, role in enumerate(CHAT_ROLES)}
_NEWLINES = 271  # "\n\n" after each header
# Framing tokens per message: start header, role, end header, blank line ... end of turn.
CHAT_TOKENS_PER_MESSAGE = 5
# Begin-of-text plus the assistant header that prompts the answer (add_generation_prompt).
CHAT_TOKENS_PER_PROMPT = 1 + 4


class ApiError(Exception):
    """A request vLLM would refuse: HTTP status, message and vLLM's error type name."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.err_type, self.param)


def error_body(message: str, status: int, err_type: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse`` as JSON."""
    return {"object": "error", "message": message, "type": err_type, "param": param, "code": status}


@dataclasses.dataclass
class GenerationRequest:
    """A validated completion or chat request, reduced to what the simulator needs."""

    kind: str  # COMPLETION or CHAT
    model: str
    prompt_token_ids: list[int]
    max_tokens: int  # effective: what vLLM puts in SamplingParams.max_tokens
    min_tokens: int
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage_stats: bool
    temperature: float
    top_p: float
    n: int
    priority: int
    seed: int | None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


# ---------------------------------------------------------------------------------------------- field checks
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise ApiError(f"'{key}' must be an integer, not {type(value).__name__}", param=key)
    return value


def _optional_float(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"'{key}' must be a number, not {type(value).__name__}", param=key)
    value = float(value)
    if not math.isfinite(value):
        raise ApiError(f"'{key}' must be a finite number", param=key)
    return value


def _optional_bool(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{key}' must be true or false, not {type(value).__name__}", param=key)
    return value


def _check_prompt_ids(ids: Sequence[Any], key: str) -> list[int]:
    if not all(_is_int(i) and 0 <= i < 2**31 for i in ids):
        raise ApiError(f"'{key}' token ids must be non-negative integers", param=key)
    return list(ids)


# ---------------------------------------------------------------------------------------------- prompts
def completion_prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """Token ids of a completion ``prompt``: a string, a list of one string, or token ids."""
    if "prompt" not in body or body["prompt"] is None:
        raise ApiError("'prompt' is required for /v1/completions", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list):
        if prompt and all(_is_int(item) for item in prompt):
            return _check_prompt_ids(prompt, "prompt")
        if len(prompt) != 1:
            raise ApiError(
                f"'prompt' must be a string or a list of one prompt; the simulator serves one prompt per "
                f"request (got a list of {len(prompt)})",
                param="prompt",
            )
        prompt = prompt[0]
        if isinstance(prompt, list):
            if not prompt:
                raise ApiError("The decoder prompt cannot be empty", param="prompt")
            return _check_prompt_ids(prompt, "prompt")
    if not isinstance(prompt, str):
        raise ApiError(f"'prompt' must be a string or a list of one string, not {type(prompt).__name__}",
                       param="prompt")
    ids = token_ids(prompt)
    if not ids:
        raise ApiError("The decoder prompt cannot be empty", param="prompt")
    return ids


def _message_text(message: Mapping[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ApiError(f"messages[{index}].content parts must be objects with a 'type'", param="messages")
            if part["type"] != "text":
                raise ApiError(
                    f"messages[{index}].content part type {part['type']!r} is not supported: the simulated "
                    "replica serves a text-only model",
                    param="messages",
                )
            if not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{index}].content text parts need a string 'text'", param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(f"messages[{index}].content must be a string, a list of parts or null", param="messages")


def chat_prompt_ids(body: Mapping[str, Any]) -> list[int]:
    """Token ids of ``messages`` rendered through a Llama-3-style chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError("'messages' is required and must be a list of messages", param="messages")
    if not messages:
        raise ApiError("'messages' must contain at least one message", param="messages")
    ids = [_BEGIN_OF_TEXT]
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ApiError(f"messages[{index}] must be an object with 'role' and 'content'", param="messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(
                f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, not {role!r}", param="messages"
            )
        ids += [_START_HEADER, _ROLE_IDS[role], _END_HEADER, _NEWLINES]
        ids += token_ids(_message_text(message, index))
        ids.append(_END_OF_TURN)
    ids += [_START_HEADER, _ROLE_IDS["assistant"], _END_HEADER, _NEWLINES]
    return ids


# ---------------------------------------------------------------------------------------------- the request
def parse_generation_request(
    body: Any,
    *,
    kind: str,
    served_model_name: str,
    max_model_len: int,
    priority_scheduling: bool,
) -> GenerationRequest:
    """Validate a ``/v1/completions`` or ``/v1/chat/completions`` body as vLLM does; raises ``ApiError``."""
    if not isinstance(body, Mapping):
        raise ApiError(f"the request body must be a JSON object, not {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(f"'model' must be a string, not {type(model).__name__}", param="model")
    if model is not None and model != served_model_name:
        raise ApiError(f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model")

    stream = _optional_bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = continuous = False
    if stream_options is not None:
        if not isinstance(stream_options, Mapping):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise ApiError("Stream options can only be defined when `stream=True`.", param="stream_options")
        include_usage = _optional_bool(stream_options, "include_usage")
        continuous = _optional_bool(stream_options, "continuous_usage_stats")

    n = _optional_int(body, "n")
    if n is not None and n != 1:
        raise ApiError(
            f"n={n} is not supported: the simulated replica serves one choice per request (n=1)", param="n"
        )
    temperature = _optional_float(body, "temperature")
    if temperature is not None and temperature < 0:
        raise ApiError(f"temperature must be non-negative, got {temperature}.", param="temperature")
    top_p = _optional_float(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    priority = _optional_int(body, "priority") or 0
    if priority != 0 and not priority_scheduling:
        raise ApiError(
            f"Got priority {priority} but Priority scheduling is not enabled (scheduling_policy is fcfs).",
            param="priority",
        )
    seed = _optional_int(body, "seed")
    ignore_eos = _optional_bool(body, "ignore_eos")

    max_tokens = _optional_int(body, "max_tokens")
    if kind == CHAT:
        # vLLM's chat request: max_completion_tokens wins over the deprecated max_tokens.
        completion_cap = _optional_int(body, "max_completion_tokens")
        if completion_cap is not None:
            max_tokens = completion_cap
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    min_tokens = _optional_int(body, "min_tokens") or 0
    if min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", param="min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            param="min_tokens",
        )

    prompt_ids = chat_prompt_ids(body) if kind == CHAT else completion_prompt_ids(body)
    prompt_len = len(prompt_ids)
    # vLLM's serving layer (_validate_input): the prompt must leave room for one token, and prompt plus
    # max_tokens must fit the context; its messages are kept word for word.
    if prompt_len >= max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len} tokens in the messages, Please reduce the length of the messages.",
            param="messages" if kind == CHAT else "prompt",
        )
    if max_tokens is None:
        # vLLM's default: whatever room the context leaves.
        max_tokens = max_model_len - prompt_len
    elif prompt_len + max_tokens > max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
    min_tokens = min(min_tokens, max_tokens)

    return GenerationRequest(
        kind=kind,
        model=served_model_name,
        prompt_token_ids=prompt_ids,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stream=stream,
        include_usage=include_usage,
        continuous_usage_stats=continuous,
        # vLLM fills unset sampling parameters with the OpenAI defaults before they reach the span.
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        n=1,
        priority=priority,
        seed=seed,
    )


def prompt_fingerprint(ids: Sequence[int]) -> int:
    """A stable 32-bit hash of a prompt (greedy requests with the same prompt get the same output length)."""
    return zlib.crc32(b"".join(i.to_bytes(4, "little", signed=False) for i in ids))


# ---------------------------------------------------------------------------------------------- responses
def new_request_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's ``UsageInfo``. ``cached_tokens``: the prompt tokens served from the prefix cache, reported as
    ``prompt_tokens_details.cached_tokens`` (0 included) when the server runs with ``--enable-prompt-tokens-details``
    (the caller passes None otherwise, and for the per-chunk usage of ``continuous_usage_stats``, which vLLM sends
    without details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
    }


def full_response(
    request: GenerationRequest, request_id: str, created: int, text: str, finish_reason: str, completion_tokens: int,
    cached_tokens: int | None = None,
) -> dict[str, Any]:
    """The non-streaming body of a finished request (``cached_tokens``: see ``usage_body``)."""
    usage = usage_body(request.prompt_tokens, completion_tokens, cached_tokens)
    if request.kind == CHAT:
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": request.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "reasoning_content": None, "content": text, "tool_calls": []},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                }
            ],
            "usage": usage,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": request.model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
                "prompt_logprobs": None,
            }
        ],
        "usage": usage,
        "system_fingerprint": None,
        "kv_transfer_params": None,
    }


def stream_chunk(
    request: GenerationRequest,
    request_id: str,
    created: int,
    *,
    text: str,
    finish_reason: str | None,
    role: bool = False,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One SSE ``data:`` object carrying ``text`` (the role-only opening delta of a chat when ``role``)."""
    if request.kind == CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        chunk: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": request.model,
            "choices": [choice],
        }
    else:
        chunk = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": request.model,
            "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            ],
        }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def usage_chunk(request: GenerationRequest, request_id: str, created: int, completion_tokens: int,
                cached_tokens: int | None = None) -> dict[str, Any]:
    """The final ``choices: []`` chunk sent when ``stream_options.include_usage`` is set (``cached_tokens``: see
    ``usage_body``)."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if request.kind == CHAT else "text_completion",
        "created": created,
        "model": request.model,
        "choices": [],
        "usage": usage_body(request.prompt_tokens, completion_tokens, cached_tokens),
    }
