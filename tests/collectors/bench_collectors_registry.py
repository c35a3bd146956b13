"""Times registry.normalise_span per span shape; not a test, run it by hand.

    .venv/bin/python tests/collectors/bench_collectors_registry.py


Prints one ``BENCH collectors_<shape>=<ns> ns/span`` line per shape (best of 5 runs).
"""
from __future__ import annotations

import pathlib
import sys
import timeit

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import collectors_samples as samples  # noqa: E402

from collectors.base import SPAN_KIND_CLIENT, SPAN_KIND_SERVER  # noqa: E402
from collectors.registry import normalise_span  # noqa: E402


def shapes() -> dict[str, object]:
    build = samples.build_span
    return {
        "reject_http_server_10_attrs": build("POST /v1/chat/completions", kind=SPAN_KIND_SERVER,
                                             attributes=samples.HTTP_SERVER_ATTRIBUTES),
        "reject_db_client": build("SELECT", kind=SPAN_KIND_CLIENT, attributes={
            "db.system.name": "postgresql", "db.operation.name": "SELECT", "db.namespace": "observatory"}),
        "vllm_llm_request": samples.vllm_span(),
        "genai_chat_streaming": build("chat gpt-4o", kind=SPAN_KIND_CLIENT,
                                      attributes=samples.GENAI_CHAT_ATTRIBUTES),
        "openinference_llm": build("ChatCompletion", attributes=samples.OPENINFERENCE_LLM_ATTRIBUTES,
                                   events=[("First Token Stream Event", 230.0)]),
        "openllmetry_chat_100_chunks": build(
            "openai.chat", kind=SPAN_KIND_CLIENT, attributes=samples.OPENLLMETRY_LEGACY_ATTRIBUTES,
            events=[("llm.content.completion.chunk", 180.0 + i) for i in range(100)]),
        "litellm_proxy_span": build("Received Proxy Server Request", kind=SPAN_KIND_SERVER,
                                    scope_name="litellm", attributes=samples.LITELLM_CALL_ATTRIBUTES),
    }


def main() -> None:
    number = 200_000
    for label, span in shapes().items():
        best = min(timeit.repeat(lambda span=span: normalise_span(span), number=number, repeat=5))
        print(f"BENCH collectors_{label}={best / number * 1e9:.0f} ns/span")


if __name__ == "__main__":
    main()
