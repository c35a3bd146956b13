"""The registry hands each span to exactly the convention that owns it; no span is claimed twice."""
import pytest
from collectors_samples import catalogue
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collectors import registry
from collectors.base import SPAN_KIND_CLIENT, SPAN_KIND_INTERNAL, SPAN_KIND_SERVER, SpanEvent, SpanView

SAMPLES = catalogue()


def claims(span):
    calls = {module.CONVENTION: module.normalise(span) for module in registry.CONVENTIONS}
    return {convention: call for convention, call in calls.items() if call is not None}


@pytest.mark.parametrize("sample", SAMPLES, ids=[sample.label for sample in SAMPLES])
def test_each_span_is_claimed_by_the_expected_convention_only(sample):
    claimed = claims(sample.span)
    expected = [sample.convention] if sample.convention else []
    assert list(claimed) == expected
    result = registry.normalise_span(sample.span)
    if sample.convention is None:
        assert result is None
    else:
        assert result == claimed[sample.convention]
        assert result.convention == sample.convention


def test_roles_per_convention():
    by_label = {sample.label: registry.normalise_span(sample.span) for sample in SAMPLES}
    assert by_label["vllm llm_request"].role.value == "engine"
    assert by_label["litellm proxy span with call attributes"].role.value == "gateway"
    assert by_label["litellm v2 llm call"].role.value == "gateway"
    assert by_label["genai server span"].role.value == "gateway"
    for label in ("genai chat client", "openinference LLM", "openllmetry legacy chat"):
        assert by_label[label].role.value == "client"


def test_one_gateway_call_per_proxied_request_in_every_litellm_layout(make_span, payloads):
    attrs = payloads.LITELLM_CALL_ATTRIBUTES
    layouts = {
        # releases that annotate only litellm_request (2024, and since May 2026)
        "child annotated": [({}, "Received Proxy Server Request"), (attrs, "litellm_request")],
        # "shallow hierarchy" releases, default settings
        "parent annotated": [(attrs, "Received Proxy Server Request")],
        # USE_OTEL_LITELLM_REQUEST_SPAN=true on releases that also annotate the parent
        "both annotated": [(attrs, "Received Proxy Server Request"), (attrs, "litellm_request")],
    }
    for layout, spans in layouts.items():
        calls = [
            registry.normalise_span(make_span(
                name, attributes=a, scope_name="litellm",
                kind=SPAN_KIND_SERVER if name.startswith("Received") else SPAN_KIND_INTERNAL))
            for a, name in spans
        ]
        calls.append(registry.normalise_span(make_span("raw_gen_ai_request", scope_name="litellm",
                                                       attributes={"llm.hosted_vllm.stream": True})))
        gateway = [c for c in calls if c is not None]
        assert len(gateway) == 1, layout
        assert gateway[0].name == "Received Proxy Server Request"


KNOWN_KEYS = sorted({
    key
    for sample in SAMPLES
    for key in sample.span.attributes
} | {
    "gen_ai.request.stream", "gen_ai.server.time_to_first_token", "llm.response.model_name",
    "llm.request.model_name", "error.type", "litellm.request.purpose", "gen_ai.output.type",
    "llm_observatory.engine_config", "llm_observatory.replica_group",
    "gen_ai.usage.cache_read.input_tokens", "gen_ai.usage.cache_read_input_tokens", "gen_ai.usage.cached_tokens",
    "llm.token_count.prompt_details.cache_read", "observatory.cache.served_from", "observatory.cache.lookup_ms",
})
NAMES = sorted({sample.span.name for sample in SAMPLES})
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=10**300, max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["chat", "LLM", "True", "acompletion", "workflow", "embeddings", "-1", "1e400", "nan",
                     ""]),
)
VALUES = st.one_of(
    SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=4), SCALARS, max_size=2)
)
EVENT_NAMES = ["First Token Stream Event", "llm.content.completion.chunk", "gen_ai.content.completion.chunk",
               "exception"]
TIMES = st.integers(min_value=0, max_value=2**63)


@st.composite
def arbitrary_spans(draw):
    attributes = draw(st.dictionaries(st.sampled_from(KNOWN_KEYS), VALUES, max_size=12))
    resource = draw(st.dictionaries(
        st.sampled_from(["service.name", "vllm.instrumenting_module_name", "llm_observatory.simulated",
                         "llm_observatory.engine_config", "llm_observatory.replica_group"]), VALUES,
        max_size=3))
    events = [SpanEvent(time_ns=draw(TIMES), name=name, attributes={})
              for name in draw(st.lists(st.sampled_from(EVENT_NAMES), max_size=3))]
    return SpanView(
        trace_id="ab" * 16, span_id="cd" * 8, parent_span_id="",
        name=draw(st.one_of(st.sampled_from(NAMES), st.text(max_size=10))),
        kind=draw(st.sampled_from([0, SPAN_KIND_INTERNAL, SPAN_KIND_SERVER, SPAN_KIND_CLIENT, 4, 5, 99])),
        start_ns=draw(TIMES), end_ns=draw(TIMES),
        status_code=draw(st.sampled_from([0, 1, 2, 7])), status_message="",
        attributes=attributes, events=events, resource=resource,
        scope_name=draw(st.sampled_from(["", "litellm", "openinference.instrumentation.openai"])),
    )


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arbitrary_spans())
def test_arbitrary_spans_never_raise_and_are_claimed_at_most_once(span):
    claimed = claims(span)
    assert len(claimed) <= 1
    result = registry.normalise_span(span)
    assert result == (next(iter(claimed.values())) if claimed else None)
    if result is not None:
        for field in ("ttft_ms", "engine_e2e_ms", "queue_ms", "prefill_ms", "decode_ms", "inference_ms"):
            value = getattr(result, field)
            assert value is None or value >= 0
        for field in ("prompt_tokens", "completion_tokens", "cached_prompt_tokens"):
            value = getattr(result, field)
            assert value is None or (isinstance(value, int) and value >= 0)
        if result.cached_prompt_tokens is not None and result.prompt_tokens is not None:
            assert result.cached_prompt_tokens <= result.prompt_tokens
        assert result.served_from in (None, "engine", "exact_cache", "semantic_cache")
        assert result.lookup_ms is None or result.lookup_ms >= 0
