"""The replicas' own vLLM metrics, read from their /metrics (Prometheus text): the engine page's live figures and
the diagnosis's speculative-decoding acceptance. Best effort: a replica that does not answer reads as nothing."""
from __future__ import annotations

import concurrent.futures
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 1.0
MAX_METRICS_BYTES = 4 * 1024 * 1024

# vLLM's metric names, as real vLLM 0.32 exports them (checked by tests/engine/test_real_vllm.py).
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
SPEC_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
LIVE_FIGURES = (RUNNING, WAITING, KV_CACHE_USAGE, SPEC_ACCEPTED_TOKENS, SPEC_DRAFT_TOKENS)


def scrape(url: str, names: tuple[str, ...], timeout: float = TIMEOUT_S) -> dict[str, float] | None:
    """Each named series summed over its label sets in one replica's /metrics (a name it does not export is left
    out); None when the replica does not answer or its text cannot be read."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:  # noqa: S310
            text = response.read(MAX_METRICS_BYTES).decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    totals: dict[str, float] = {}
    wanted = set(names)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    except ValueError:
        return None
    return totals


def summed(urls: list[str], names: tuple[str, ...], timeout: float = TIMEOUT_S) -> dict[str, float] | None:
    """Each named counter summed over the replicas (all label sets); None when no replica answered."""
    answered = [found for found in (scrape(url, names, timeout) for url in urls) if found is not None]
    if not answered:
        return None
    return {name: sum(found.get(name, 0.0) for found in answered) for name in names}


def acceptance_rate(totals: dict[str, float]) -> float | None:
    """Accepted / draft tokens of speculative decoding (counters since each replica started)."""
    drafted = totals.get(SPEC_DRAFT_TOKENS)
    accepted = totals.get(SPEC_ACCEPTED_TOKENS)
    return accepted / drafted if drafted and accepted is not None else None


def speculative_acceptance(urls: list[str], timeout: float = TIMEOUT_S) -> float | None:
    """The acceptance rate over these replicas together; None when none answered or none drafted."""
    return acceptance_rate(summed(urls, (SPEC_ACCEPTED_TOKENS, SPEC_DRAFT_TOKENS), timeout) or {})


def prefix_hit_rate(urls: list[str], timeout: float = TIMEOUT_S) -> float | None:
    """Prefix-cache hits / queries (tokens) summed over vLLM replicas; None when no replica answers or none has
    counted a query (the simulator's replicas export no prefix-cache counters)."""
    totals = summed(urls, (PREFIX_HITS, PREFIX_QUERIES), timeout)
    if totals is None or totals[PREFIX_QUERIES] <= 0:
        return None
    return totals[PREFIX_HITS] / totals[PREFIX_QUERIES]


def live_figures(url: str) -> dict:
    """Running, waiting, KV cache usage and the speculative acceptance rate of one replica; {} when it cannot be
    read."""
    totals = scrape(url, LIVE_FIGURES)
    if totals is None:
        return {}
    return {"running": totals.get(RUNNING), "waiting": totals.get(WAITING), "kv_cache": totals.get(KV_CACHE_USAGE),
            "acceptance": acceptance_rate(totals)}


def live_figures_of(replicas: list[tuple[str, str]]) -> dict[str, dict]:
    """live_figures of each (name, url), read side by side."""
    if not replicas:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(replicas))) as pool:
        return dict(zip((name for name, _ in replicas), pool.map(lambda item: live_figures(item[1]), replicas)))
