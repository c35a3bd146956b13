"""The simulated V1 scheduler step by step: budgets, FCFS order, conservation, preemption, prefix hits, aborts."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.sim.core import EngineCore
from engine.sim.memory import SimulationConfigError
from engine.sim.options import SimOptions
from engine.sim.request import RequestRejected, SimRequest


def _engine(*, blocks=None, fast=True, **knobs) -> EngineCore:
    knobs.setdefault("max_model_len", 4096)
    return EngineCore(EngineConfig(**knobs), options=SimOptions(num_gpu_blocks_override=blocks, fast_path=fast))


def _random_requests(count, seed, *, prompt=(1, 1500), output=(1, 300), rate=50.0, ids=False):
    rng = random.Random(seed)
    shared = [rng.randrange(5000) for _ in range(2000)]
    now = 0.0
    requests = []
    for i in range(count):
        now += rng.expovariate(rate)
        length = rng.randint(*prompt)
        token_ids = None
        if ids:
            common = rng.randint(0, length)
            token_ids = shared[:common] + [rng.randrange(5000) for _ in range(length - common)]
        requests.append(SimRequest(f"r{i}", length, rng.randint(*output), now, prompt_token_ids=token_ids,
                                   priority=rng.randint(0, 2)))
    return requests


def _drive(engine: EngineCore, requests, *, on_step=None, max_steps=200_000):
    """Step the engine like a replica would: arrivals join before the step that starts after them."""
    pending = sorted(requests, key=lambda r: r.arrival_time)
    now, index, steps = 0.0, 0, 0
    while index < len(pending) or engine.has_unfinished_requests():
        while index < len(pending) and pending[index].arrival_time <= now:
            engine.add_request(pending[index], pending[index].arrival_time)
            index += 1
        if not engine.has_unfinished_requests():
            now = pending[index].arrival_time
            continue
        before = (engine.pool.num_free, engine.running_block_demand()) if on_step else None
        out = engine.step(now)
        if on_step:
            on_step(engine, out, before)
        engine.pool.check()
        assert engine.blocks_in_use() <= engine.pool.num_usable
        if out.num_scheduled_tokens == 0:
            assert index < len(pending), "engine stuck with nothing schedulable"
            now = pending[index].arrival_time
        else:
            now = out.end_time
        steps += 1
        assert steps < max_steps
    return pending


@pytest.mark.parametrize("fast", [True, False])
def test_every_request_gets_its_prefill_and_all_its_tokens(fast):
    engine = _engine(fast=fast)
    emitted: dict[str, int] = {}
    scheduled = [0]

    def record(_engine, out, _before):
        scheduled[0] += out.num_scheduled_tokens
        for request_id, count in out.new_tokens.items():
            emitted[request_id] = emitted.get(request_id, 0) + count

    requests = _drive(engine, _random_requests(120, 1), on_step=record)
    for request in requests:
        assert request.finish_reason == "length"
        assert request.num_generated == request.output_tokens == emitted[request.request_id]
        assert request.queued_time <= request.scheduled_time <= request.first_token_time
        assert request.first_token_time <= request.last_token_time == request.finished_time
    # Without preemption or prefix hits every prompt token is computed once and every output token
    # but the last is fed back once.
    assert engine.num_preemptions_total == 0
    assert scheduled[0] == sum(r.prompt_tokens + r.output_tokens - 1 for r in requests)
    assert engine.generation_tokens_total == sum(r.output_tokens for r in requests)
    assert engine.prompt_tokens_total == sum(r.prompt_tokens for r in requests)
    assert engine.pool.num_free == engine.pool.num_usable


@pytest.mark.parametrize("budget", [256, 1000, 2048])
def test_chunked_prefill_never_exceeds_the_token_budget(budget):
    engine = _engine(max_num_batched_tokens=budget, max_num_seqs=64, fast=True)
    steps = []
    _drive(engine, _random_requests(60, 2, prompt=(100, 3000), rate=200.0),
           on_step=lambda _e, out, _b: steps.append(out.num_scheduled_tokens))
    assert max(steps) <= budget
    assert max(steps) == budget  # long prompts fill the budget exactly with chunks


def test_waiting_requests_are_first_scheduled_in_arrival_order():
    engine = _engine(max_num_seqs=8, max_num_batched_tokens=512)
    requests = _drive(engine, _random_requests(80, 3, rate=400.0))
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    times = [r.scheduled_time for r in ordered]
    assert times == sorted(times)
    assert len(set(times)) < len(times)  # several per step: the check is not vacuous


def test_running_requests_never_exceed_max_num_seqs():
    engine = _engine(max_num_seqs=5)
    _drive(engine, _random_requests(40, 4, rate=500.0),
           on_step=lambda e, _out, _b: pytest.fail("too many running") if e.num_running > 5 else None)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_happens_exactly_when_blocks_run_out(fast, policy):
    engine = _engine(blocks=400, fast=fast, scheduling_policy=policy, max_model_len=2048)
    seen = {"pressure": 0, "preempted": 0}

    def check(_engine, out, before):
        free, demand = before
        if demand > free:
            seen["pressure"] += 1
        if out.num_preempted:
            seen["preempted"] += out.num_preempted
            assert demand > free, "preempted although the running requests' blocks fitted"
        else:
            assert demand <= free, "blocks ran out but nothing was preempted"

    requests = _drive(engine, _random_requests(150, 5, prompt=(50, 900), output=(50, 400), rate=100.0),
                      on_step=check)
    assert seen["preempted"] > 0 and seen["pressure"] > 0
    assert engine.num_preemptions_total == seen["preempted"] == sum(r.num_preemptions for r in requests)
    assert all(r.num_generated == r.output_tokens for r in requests)


def test_no_preemption_with_plenty_of_blocks():
    engine = _engine()
    _drive(engine, _random_requests(100, 6, rate=100.0))
    assert engine.num_preemptions_total == 0


def test_fcfs_preempts_the_last_admitted_request():
    engine = _engine(blocks=8, max_model_len=112, max_num_batched_tokens=256, max_num_seqs=8)  # 7 usable blocks of 16
    first = SimRequest("first", 40, 70, 0.0)
    second = SimRequest("second", 40, 70, 0.0)
    engine.add_request(first, 0.0)
    engine.add_request(second, 0.0)
    now = 0.0
    while not second.num_preemptions and engine.has_unfinished_requests():
        out = engine.step(now)
        now = out.end_time
    assert second.num_preemptions == 1 and first.num_preemptions == 0
    assert [r.request_id for r in engine.waiting_requests()] == ["second"]


def test_priority_policy_serves_lower_values_first_and_preempts_the_highest():
    engine = _engine(scheduling_policy="priority", max_num_seqs=1)
    low = SimRequest("low", 20, 5, 0.0, priority=5)
    high = SimRequest("high", 20, 5, 0.1, priority=0)
    engine.add_request(low, 0.0)
    engine.add_request(high, 0.1)
    now = 0.2
    while engine.has_unfinished_requests():
        now = engine.step(now).end_time
    assert high.scheduled_time < low.scheduled_time


def test_shared_prefixes_hit_the_prefix_cache():
    engine = _engine()
    system = list(range(1000, 1640))  # a 640-token system prompt: 40 full blocks
    first = SimRequest("a", 700, 10, 0.0, prompt_token_ids=system + list(range(60)))
    second = SimRequest("b", 700, 10, 5.0, prompt_token_ids=system + list(range(100, 160)))
    _drive(engine, [first, second])
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 640
    assert engine.prefix_cache_hits == 640
    assert engine.prefix_cache_queries == 1400
    # The hit saves prefill time: the second request's time to first token is shorter.
    assert (second.first_token_time - second.scheduled_time) < (first.first_token_time - first.scheduled_time)


def test_disabled_prefix_caching_never_hits():
    engine = _engine(enable_prefix_caching=False)
    ids = list(range(700))
    requests = [SimRequest(f"r{i}", 700, 5, float(i), prompt_token_ids=ids) for i in range(3)]
    _drive(engine, requests)
    assert engine.prefix_cache_hits == 0 and all(r.num_cached_tokens == 0 for r in requests)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    engine = _engine(enable_chunked_prefill=False, max_num_batched_tokens=4096, max_model_len=4096)
    small = SimRequest("small", 3000, 50, 0.0)
    big = SimRequest("big", 3000, 5, 0.0)
    engine.add_request(small, 0.0)
    engine.add_request(big, 0.0)
    out = engine.step(0.0)
    assert out.num_scheduled_tokens == 3000  # the second prompt does not fit the rest of the budget
    assert big.scheduled_time is None
    out = engine.step(out.end_time)
    assert big.scheduled_time == out.start_time


def test_partial_prefill_limits_let_short_prompts_pass_long_ones():
    engine = _engine(max_num_partial_prefills=2, max_long_partial_prefills=1, long_prefill_token_threshold=256,
                     max_num_batched_tokens=512, max_num_seqs=64, max_model_len=8192)
    long_a = SimRequest("long_a", 4000, 2, 0.0)
    long_b = SimRequest("long_b", 4000, 2, 0.0)
    short = SimRequest("short", 200, 2, 0.0)
    for request in (long_a, long_b, short):
        engine.add_request(request, 0.0)
    out = engine.step(0.0)
    # long_a takes a 256-token chunk; long_b would be a second long partial prefill: it waits and
    # the short prompt behind it goes ahead.
    assert long_a.scheduled_time == 0.0 and short.scheduled_time == 0.0 and long_b.scheduled_time is None
    assert out.num_scheduled_tokens == 456


def test_abort_frees_blocks_and_reports_the_request():
    engine = _engine()
    request = SimRequest("gone", 500, 100, 0.0)
    engine.add_request(request, 0.0)
    now = engine.step(0.0).end_time
    now = engine.step(now).end_time
    assert engine.blocks_in_use() > 0
    aborted = engine.abort_request("gone", now)
    assert aborted is request and request.finish_reason == "abort" and request.finished_time == now
    assert engine.blocks_in_use() == 0 and not engine.has_unfinished_requests()
    assert engine.abort_request("gone", now) is None
    waiting = SimRequest("waiting", 10, 1, now)
    engine.add_request(waiting, now)
    assert engine.abort_request("waiting", now) is waiting and engine.num_waiting == 0


def test_requests_vllm_would_refuse_are_rejected():
    engine = _engine(max_model_len=1000)
    with pytest.raises(RequestRejected, match="maximum context length is 1000"):
        engine.add_request(SimRequest("long", 900, 101, 0.0), 0.0)
    with pytest.raises(RequestRejected, match="output_tokens"):
        engine.add_request(SimRequest("zero", 10, 0, 0.0), 0.0)
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        engine.add_request(SimRequest("ids", 10, 1, 0.0, prompt_token_ids=[1, 2]), 0.0)
    engine.add_request(SimRequest("dup", 10, 1, 0.0), 0.0)
    with pytest.raises(RequestRejected, match="already"):
        engine.add_request(SimRequest("dup", 10, 1, 0.0), 0.0)


def test_a_context_that_cannot_fit_the_kv_cache_refuses_to_start():
    with pytest.raises(SimulationConfigError, match="max_model_len"):
        EngineCore(EngineConfig(gpu_type="L4"))  # 8B weights leave ~3 GiB: far less than 128k tokens
    EngineCore(EngineConfig(gpu_type="L4", max_model_len=8192))


def test_step_reports_tokens_and_usage_like_vllm_metrics():
    engine = _engine()
    engine.add_request(SimRequest("a", 100, 3, 0.0), 0.0)
    out = engine.step(0.0)
    assert out.new_tokens == {"a": 1} and out.duration > 0 and out.end_time == out.start_time + out.duration
    assert engine.num_running == 1 and engine.num_waiting == 0 and 0 < engine.kv_cache_usage < 1
    out = engine.step(out.end_time)
    out = engine.step(out.end_time)
    assert out.new_tokens == {"a": 1} and [r.request_id for r in out.finished] == ["a"]
    assert engine.kv_cache_usage == 0.0


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([80, 256]), st.booleans())
def test_fast_and_exact_paths_agree(seed, blocks, ids):
    results = []
    for fast in (True, False):
        engine = _engine(blocks=blocks, fast=fast, max_model_len=1024, max_num_batched_tokens=768, max_num_seqs=64)
        requests = _random_requests(25, seed, prompt=(1, 600), output=(1, 120), rate=80.0, ids=ids)
        _drive(engine, requests)
        results.append(requests)
    for a, b in zip(*results):
        assert a.num_preemptions == b.num_preemptions and a.num_cached_tokens == b.num_cached_tokens
        for name in ("scheduled_time", "first_token_time", "last_token_time"):
            assert getattr(a, name) == pytest.approx(getattr(b, name), abs=1e-9)
