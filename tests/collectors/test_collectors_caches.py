"""Cached prompt tokens from every convention's own attribute, and the gateway response cache's served_from/lookup."""
import pytest

from collectors import registry
from collectors.base import SPAN_KIND_CLIENT, SPAN_KIND_SERVER

# (label, span name, kind, the convention's attributes, its prompt count, cached-token key, convention)
CASES = [
    ("vllm-simulator", None, None, None, 512, "gen_ai.usage.cache_read.input_tokens", "vllm"),
    ("vllm", None, None, None, 512, "gen_ai.usage.cached_tokens", "vllm"),
    ("genai", "chat gpt-4o", SPAN_KIND_CLIENT, "GENAI_CHAT_ATTRIBUTES", 100,
     "gen_ai.usage.cache_read.input_tokens", "genai"),
    ("gateway", "chat gpt-4o", SPAN_KIND_SERVER, "GENAI_CHAT_ATTRIBUTES", 100,
     "gen_ai.usage.cache_read.input_tokens", "genai"),
    ("openinference", "ChatCompletion", SPAN_KIND_CLIENT, "OPENINFERENCE_LLM_ATTRIBUTES", 12,
     "llm.token_count.prompt_details.cache_read", "openinference"),
    ("openllmetry-0.4", "openai.chat", SPAN_KIND_CLIENT, "OPENLLMETRY_LEGACY_ATTRIBUTES", 10,
     "gen_ai.usage.cache_read_input_tokens", "openllmetry"),
    ("openllmetry-0.5", "chat gpt-4o", SPAN_KIND_CLIENT, "OPENLLMETRY_CURRENT_ATTRIBUTES", 11,
     "gen_ai.usage.cache_read.input_tokens", "openllmetry"),
    ("litellm-v2", "chat llama-3.1-8b", SPAN_KIND_CLIENT, "LITELLM_V2_CALL_ATTRIBUTES", 512,
     "gen_ai.usage.cache_read.input_tokens", "litellm"),
    ("litellm-arize", "Received Proxy Server Request", SPAN_KIND_SERVER, "LITELLM_CALL_ATTRIBUTES", 512,
     "llm.token_count.prompt_details.cache_read", "litellm"),
    ("litellm-legacy", "Received Proxy Server Request", SPAN_KIND_SERVER, "LITELLM_CALL_ATTRIBUTES", 512,
     "gen_ai.usage.cache_read_input_tokens", "litellm"),
]


def _span(payloads, case, extra):
    _label, name, kind, attributes, _prompt, _key, _convention = case
    if name is None:
        return payloads.vllm_span(attributes={**payloads.VLLM_ATTRIBUTES, **extra})
    return payloads.build_span(name, kind=kind, attributes={**getattr(payloads, attributes), **extra})


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_cached_prompt_tokens_per_convention(payloads, case):
    _label, _name, _kind, _attributes, prompt, key, convention = case
    call = registry.normalise_span(_span(payloads, case, {key: prompt - 2}))
    assert call.convention == convention
    assert call.prompt_tokens == prompt
    assert call.cached_prompt_tokens == prompt - 2
    # the whole prompt may be cached; absent, the figure is None, never 0
    assert registry.normalise_span(_span(payloads, case, {key: prompt})).cached_prompt_tokens == prompt
    assert registry.normalise_span(_span(payloads, case, {})).cached_prompt_tokens is None


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
@pytest.mark.parametrize("value", ["lots", -3, 2.5, True, [4], float("nan"), 10**12])
def test_malformed_cached_counts_are_none(payloads, case, value):
    assert registry.normalise_span(_span(payloads, case, {case[5]: value})).cached_prompt_tokens is None


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_cached_count_above_the_prompt_is_dropped(payloads, case):
    call = registry.normalise_span(_span(payloads, case, {case[5]: case[4] + 1}))
    assert call.prompt_tokens == case[4]
    assert call.cached_prompt_tokens is None


def test_a_cached_count_without_a_prompt_count_is_kept(payloads):
    attributes = {k: v for k, v in payloads.GENAI_CHAT_ATTRIBUTES.items() if k != "gen_ai.usage.input_tokens"}
    call = registry.normalise_span(payloads.build_span("chat", attributes={
        **attributes, "gen_ai.usage.cache_read.input_tokens": "40"}))
    assert (call.prompt_tokens, call.cached_prompt_tokens) == (None, 40)


def test_gateway_response_cache_hit(payloads):
    call = registry.normalise_span(payloads.build_span("chat gpt-4o", kind=SPAN_KIND_SERVER, attributes={
        **payloads.GENAI_CHAT_ATTRIBUTES, "observatory.cache.result": "hit",
        "observatory.cache.served_from": "semantic_cache", "observatory.cache.lookup_ms": 7.25,
        "observatory.cache.similarity": 0.97}))
    assert (call.served_from, call.lookup_ms) == ("semantic_cache", 7.25)
    miss = registry.normalise_span(payloads.build_span("chat gpt-4o", kind=SPAN_KIND_SERVER, attributes={
        **payloads.GENAI_CHAT_ATTRIBUTES, "observatory.cache.result": "miss", "observatory.cache.lookup_ms": "0.4",
        "observatory.cache.miss_reason": "absent"}))
    assert (miss.served_from, miss.lookup_ms) == (None, 0.4)
    plain = registry.normalise_span(payloads.build_span("chat gpt-4o", kind=SPAN_KIND_SERVER,
                                                        attributes=payloads.GENAI_CHAT_ATTRIBUTES))
    assert (plain.served_from, plain.lookup_ms) == (None, None)


@pytest.mark.parametrize("served_from, lookup_ms", [
    ("redis", -1.0), (3, float("inf")), ("", "fast"), (["exact_cache"], 10**9), (None, True),
])
def test_malformed_cache_attributes_are_none(payloads, served_from, lookup_ms):
    call = registry.normalise_span(payloads.build_span("chat gpt-4o", kind=SPAN_KIND_SERVER, attributes={
        **payloads.GENAI_CHAT_ATTRIBUTES, "observatory.cache.served_from": served_from,
        "observatory.cache.lookup_ms": lookup_ms}))
    assert (call.served_from, call.lookup_ms) == (None, None)


def test_served_from_is_read_in_any_case(payloads):
    call = registry.normalise_span(payloads.build_span("chat gpt-4o", kind=SPAN_KIND_SERVER, attributes={
        **payloads.GENAI_CHAT_ATTRIBUTES, "observatory.cache.served_from": " Exact_Cache "}))
    assert call.served_from == "exact_cache"
