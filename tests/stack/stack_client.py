"""One chat completion with the official `openai` client under a real instrumentation, spans to the platform.

Runs in the stack virtualenv (`make stack`: openai, LiteLLM and the instrumentations from PyPI), started by
tests/stack/test_litellm_chain.py:

    python stack_client.py --instrumentation openllmetry|openinference|genai --base-url URL --model NAME
        --otlp-endpoint URL/v1/traces --ingest-key KEY [--stream] [--api-key KEY]

The httpx instrumentation is on in every case: it is what puts `traceparent` on the request (OpenInference's
OpenAI instrumentor does not inject it; OpenLLMetry's does). Prints one JSON line: the trace id, the response id, the text length.
"""
from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--instrumentation", choices=("openllmetry", "openinference", "genai"), required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--otlp-endpoint", required=True)
    parser.add_argument("--ingest-key", required=True)
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()

    # openai 3 sends its requests with httpx2, a fork of httpx; opentelemetry-instrumentation-httpx patches httpx.
    # httpx2's alias makes `httpx` name httpx2, so the instrumentation patches what openai uses (it must run
    # before anything imports httpx). Without it no traceparent leaves the client under OpenInference.
    try:
        import httpx2
    except ImportError:  # openai < 3 uses httpx itself
        pass
    else:
        httpx2.alias_httpx()

    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"app-{args.instrumentation}"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
        endpoint=args.otlp_endpoint, headers={"authorization": f"Bearer {args.ingest_key}"})))
    trace.set_tracer_provider(provider)
    if args.instrumentation == "openllmetry":
        from opentelemetry.instrumentation.openai import OpenAIInstrumentor
        OpenAIInstrumentor().instrument(tracer_provider=provider)
    elif args.instrumentation == "openinference":
        from openinference.instrumentation.openai import OpenAIInstrumentor
        OpenAIInstrumentor().instrument(tracer_provider=provider)
    else:
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
        OpenAIInstrumentor().instrument(tracer_provider=provider)
    HTTPXClientInstrumentor().instrument(tracer_provider=provider)

    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    tracer = trace.get_tracer("stack-client")
    with tracer.start_as_current_span("handle user question") as root:
        trace_id = format(root.get_span_context().trace_id, "032x")
        messages = [{"role": "user", "content": "Say something about latency."}]
        if args.stream:
            response_id, text = None, ""
            stream = client.chat.completions.create(model=args.model, messages=messages, max_tokens=24,
                                                    stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                response_id = response_id or chunk.id
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        else:
            answer = client.chat.completions.create(model=args.model, messages=messages, max_tokens=24)
            response_id, text = answer.id, answer.choices[0].message.content or ""
    provider.force_flush()
    provider.shutdown()
    print(json.dumps({"trace_id": trace_id, "response_id": response_id, "chars": len(text)}))


if __name__ == "__main__":
    main()
