"""What each request asks: its prompt (text or chat messages) and how many tokens it must generate.

Default, ``--dataset sharegpt``: synthetic prompts whose lengths follow the ShareGPT_V3
workload that vLLM's ``benchmark_serving.py --dataset-name sharegpt`` sends. The dataset
itself is not shipped (and not downloaded); its lengths are modelled by two truncated
lognormals, both expressed in tokens:

====================  ======  =====  ==============  =========================
length                median  sigma  bounds          resulting mean (sampled)
====================  ======  =====  ==============  =========================
prompt (input)          170    1.2   [4, 1024]       ≈ 230 tokens
output (max_tokens)     129    1.0   [4, 2044]       ≈ 203 tokens
====================  ======  =====  ==============  =========================

and a pair is redrawn when prompt + output > 2048. The bounds are vLLM's own ShareGPT
filter (``sample_sharegpt_requests`` drops prompts or outputs under 4 tokens, prompts
over 1024 and pairs over 2048), applied the same way: by rejection, not by clipping.
The medians are fitted so that the means after that filter match a published
``vllm bench serve`` run on ShareGPT_V3 (vllm-project/vllm PR #18566: 1000 prompts,
229,711 input and 203,068 generated tokens with the Llama-3.1 tokenizer, i.e. 230 and
203 per request). The sigmas are our choice: ShareGPT's length histograms (vLLM paper,
Kwon et al., SOSP 2023, Fig. 11) are right-skewed with long tails, and these values
give p90 ≈ 560 / 450 and p99 ≈ 940 / 1150 tokens. The joint filter only applies when
neither length is overridden.

``--input-len N`` / ``--output-len N`` fix a length, ``LO:HI`` draws it uniformly. A
JSONL dataset gives real prompts (``prompt`` text or ``messages``), optionally each
with ``output_tokens`` (or ``max_tokens``); lines are used in file order, wrapping
around. Prompt text comes from ``engine.tokens.synthetic_text``, which the simulator
counts with the same rule, so the replica sees exactly the asked prompt length.
Everything is a pure function of ``(seed, request index)``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from collections.abc import Sequence
from typing import Any

from engine.loadgen.spec import SHAREGPT, LengthRange
from engine.tokens import count_tokens, synthetic_text, token_ends

MAX_LINE_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class LogNormalLength:
    """A token length drawn from a lognormal (``median`` = e^mu) truncated to [low, high] by rejection."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        mu = math.log(self.median)
        while True:
            value = round(rng.lognormvariate(mu, self.sigma))
            if self.low <= value <= self.high:
                return value


SHAREGPT_INPUT = LogNormalLength(median=170.0, sigma=1.2, low=4, high=1024)
SHAREGPT_OUTPUT = LogNormalLength(median=129.0, sigma=1.0, low=4, high=2044)
SHAREGPT_MAX_TOTAL = 2048


def _sample_range(length: LengthRange, rng: random.Random) -> int:
    return length.low if length.low == length.high else rng.randint(length.low, length.high)


class WorkloadFileError(ValueError):
    """A dataset or trace file that cannot be used; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class RequestContent:
    """The body-independent part of one request: prompt or messages, its token count, the tokens to generate."""

    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    input_tokens: int  # under engine.tokens' rule; for messages, the sum over their contents
    max_tokens: int

    def for_endpoint(self, endpoint: str) -> RequestContent:
        """The same request shaped for ``completions`` (a prompt) or ``chat`` (messages)."""
        if endpoint == "chat" and self.messages is None:
            return dataclasses.replace(self, prompt=None, messages=({"role": "user", "content": self.prompt or ""},))
        if endpoint != "chat" and self.prompt is None:
            # A completions endpoint has no chat template: render the transcript as plain text.
            text = "\n\n".join(f"{m['role']}: {m['content']}" for m in self.messages or ())
            return dataclasses.replace(self, prompt=text, messages=None, input_tokens=count_tokens(text))
        return self


def messages_of(value: Any, where: str) -> tuple[dict[str, str], ...]:
    """Validated chat messages (each a string role and a string content)."""
    if not isinstance(value, list) or not value:
        raise WorkloadFileError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for message in value:
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not message["role"]
            or not isinstance(message.get("content"), str)
        ):
            raise WorkloadFileError(f"{where}: each message needs a non-empty string 'role' and a string 'content'")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def count_field(obj: dict, keys: Sequence[str], where: str, minimum: int = 1) -> int | None:
    """The first of ``keys`` present in ``obj`` as a whole number >= ``minimum`` (bools refused)."""
    for key in keys:
        if obj.get(key) is not None:
            value = obj[key]
            if value.__class__ is not int or value < minimum:
                raise WorkloadFileError(f"{where}: {key!r} must be a whole number >= {minimum} (got {value!r})")
            return value
    return None


OUTPUT_FIELDS = ("output_tokens", "max_tokens", "output_length")


def text_fields(obj: dict, where: str) -> dict[str, Any]:
    """``prompt`` and/or ``messages`` of a JSONL line (at most one of them), validated."""
    out: dict[str, Any] = {}
    if obj.get("prompt") is not None:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise WorkloadFileError(f"{where}: 'prompt' must be a non-empty string")
        out["prompt"] = obj["prompt"]
    if obj.get("messages") is not None:
        if "prompt" in out:
            raise WorkloadFileError(f"{where}: give 'prompt' or 'messages', not both")
        out["messages"] = messages_of(obj["messages"], where)
    return out


def read_jsonl(path: str):
    """(line number, object) for each non-blank, non-comment line; raises WorkloadFileError on bad JSON."""
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise WorkloadFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            where = f"{path}:{number}"
            if len(line) > MAX_LINE_BYTES:
                raise WorkloadFileError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
            text = line.strip()
            if not text or text.startswith(b"#"):
                continue
            try:
                obj = json.loads(text)
            except (ValueError, UnicodeDecodeError) as exc:
                raise WorkloadFileError(f"{where}: not valid JSON ({exc})") from None
            if not isinstance(obj, dict):
                raise WorkloadFileError(f"{where}: each line must be a JSON object")
            yield number, obj


def synthetic_prompt(num_tokens: int, seed: int, index: int) -> str:
    """A prompt of exactly ``num_tokens`` tokens, different for every request (so no prefix cache hits by accident)."""
    return synthetic_text(num_tokens, random.Random(f"loadgen-prompt:{seed}:{index}"))


@functools.lru_cache(maxsize=8)
def shared_prefix(num_tokens: int) -> str:
    """The same text of ``num_tokens`` tokens in every run and process (independent of the seed)."""
    return synthetic_text(num_tokens, random.Random("loadgen-shared-prefix"))


class Workload:
    """Request contents by index: synthetic (ShareGPT-like or fixed/uniform lengths) or from a JSONL dataset."""

    def __init__(
        self,
        dataset: str = SHAREGPT,
        *,
        input_len: LengthRange | None = None,
        output_len: LengthRange | None = None,
        seed: int = 0,
        shared_prefix_len: int = 0,
    ):
        self.dataset = dataset
        self.shared_prefix_len = shared_prefix_len
        self.input_len = input_len
        self.output_len = output_len
        self.seed = seed
        self.entries: list[dict[str, Any]] = []
        if dataset != SHAREGPT:
            self.entries = self._load(dataset)

    @staticmethod
    def _load(path: str) -> list[dict[str, Any]]:
        entries = []
        for number, obj in read_jsonl(path):
            where = f"{path}:{number}"
            fields = text_fields(obj, where)
            if not fields:
                raise WorkloadFileError(f"{where}: each line needs 'prompt' (text) or 'messages'")
            fields["output_tokens"] = count_field(obj, OUTPUT_FIELDS, where)
            entries.append(fields)
        if not entries:
            raise WorkloadFileError(f"{path}: the dataset has no entries")
        return entries

    def _rng(self, index: int) -> random.Random:
        return random.Random(f"loadgen-lengths:{self.seed}:{index}")

    def lengths(self, index: int) -> tuple[int, int]:
        """(prompt tokens, output tokens) of synthetic request ``index``."""
        rng = self._rng(index)
        if self.input_len is None and self.output_len is None:
            while True:  # vLLM's ShareGPT filter, by rejection of the pair
                prompt, output = SHAREGPT_INPUT.sample(rng), SHAREGPT_OUTPUT.sample(rng)
                if prompt + output <= SHAREGPT_MAX_TOTAL:
                    return prompt, output
        prompt = _sample_range(self.input_len, rng) if self.input_len else SHAREGPT_INPUT.sample(rng)
        output = _sample_range(self.output_len, rng) if self.output_len else SHAREGPT_OUTPUT.sample(rng)
        return prompt, output

    def output_tokens(self, index: int) -> int:
        """Tokens to generate when only the prompt is given (dataset lines, traces)."""
        rng = self._rng(index)
        return _sample_range(self.output_len, rng) if self.output_len else SHAREGPT_OUTPUT.sample(rng)

    def _synthetic(self, input_tokens: int, index: int) -> str:
        """A synthetic prompt of ``input_tokens`` tokens: the shared prefix's first tokens, then unique text."""
        shared = min(self.shared_prefix_len, input_tokens)
        if not shared:
            return synthetic_prompt(input_tokens, self.seed, index)
        prefix = shared_prefix(self.shared_prefix_len)
        if shared < self.shared_prefix_len:
            prefix = prefix[:token_ends(prefix)[shared - 1]]
        rest = input_tokens - shared
        return prefix + " " + synthetic_prompt(rest, self.seed, index) if rest else prefix

    def content(
        self,
        index: int,
        *,
        prompt: str | None = None,
        messages: tuple[dict[str, str], ...] | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
    ) -> RequestContent:
        """Request ``index``; the keyword arguments (from a replayed trace line) override what the workload gives."""
        if prompt is None and messages is None and input_tokens is None and self.entries:
            entry = self.entries[index % len(self.entries)]
            prompt, messages = entry.get("prompt"), entry.get("messages")
            output_tokens = output_tokens or entry["output_tokens"]
        if prompt is not None or messages is not None:
            counted = count_tokens(prompt) if prompt is not None else sum(count_tokens(m["content"]) for m in messages)
            if output_tokens is None:
                output_tokens = self.output_tokens(index)
            return RequestContent(prompt=prompt, messages=messages, input_tokens=counted, max_tokens=output_tokens)
        if input_tokens is None:
            input_tokens, drawn_output = self.lengths(index)
            output_tokens = output_tokens or drawn_output
        elif output_tokens is None:
            output_tokens = self.output_tokens(index)
        return RequestContent(
            prompt=self._synthetic(input_tokens, index),
            messages=None,
            input_tokens=input_tokens,
            max_tokens=output_tokens,
        )
