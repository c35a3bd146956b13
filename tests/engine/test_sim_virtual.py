"""Virtual-time runs: event skipping equals plain stepping, summaries use vLLM's definitions, knobs move latency."""
from __future__ import annotations

import math

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.sim.cost_model import StepCostModel
from engine.sim.memory import plan_memory
from engine.sim.options import SimOptions
from engine.sim.profiles import hardware_profile, model_profile
from engine.sim.request import SimRequest
from engine.sim.virtual import LatencyStats, percentile, simulate
from engine.sim.workload import fixed_requests, poisson_sharegpt

TIMESTAMPS = ("queued_time", "scheduled_time", "first_token_time", "last_token_time", "finished_time")


def _copy(requests):
    return [SimRequest(r.request_id, r.prompt_tokens, r.output_tokens, r.arrival_time,
                       prompt_token_ids=r.prompt_token_ids, priority=r.priority) for r in requests]


@pytest.mark.parametrize(
    ("knobs", "blocks", "rate"),
    [
        ({}, None, 2.0),  # light load: long runs of identical decode steps
        ({}, None, 30.0),
        ({"max_num_seqs": 16, "max_num_batched_tokens": 512}, None, 20.0),
        ({"scheduling_policy": "priority"}, 600, 15.0),  # KV pressure and preemption
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}, 700, 15.0),
    ],
)
def test_event_skipping_gives_the_same_timestamps_as_single_steps(knobs, blocks, rate):
    config = EngineConfig(max_model_len=4096, **knobs)
    requests = poisson_sharegpt(rate, count=150, seed=7)
    for index, request in enumerate(requests):
        request.priority = index % 3
    options = SimOptions(num_gpu_blocks_override=blocks)
    skipped = simulate(config, _copy(requests), options=options, skip=True)
    stepped = simulate(config, _copy(requests), options=options, skip=False)
    assert skipped.summary.num_steps == stepped.summary.num_steps
    assert skipped.summary.num_preemptions == stepped.summary.num_preemptions
    for a, b in zip(skipped.requests, stepped.requests):
        assert a.request_id == b.request_id and a.num_generated == b.num_generated == a.output_tokens
        for name in TIMESTAMPS:
            assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-12, abs=1e-9), name
    assert skipped.summary.itl_ms.count == stepped.summary.itl_ms.count
    if rate == 2.0:
        # Light load is where skipping pays: far fewer engine calls than steps.
        assert skipped.engine_calls < stepped.engine_calls / 5


def test_summary_follows_vllm_benchmark_definitions():
    options = SimOptions(api_overhead_seconds=0.0, tokenize_seconds_per_token=0.0, detokenize_seconds_per_token=0.0)
    result = simulate(EngineConfig(max_model_len=4096), fixed_requests(3, 200, 50), options=options)
    summary = result.summary
    assert summary.simulated is True and summary.completed == 3 and summary.rejected == 0
    first = result.requests[0]
    ttft = (first.first_token_time - first.arrival_time) * 1e3
    tpot = (first.finished_time - first.first_token_time) / 49 * 1e3
    assert summary.ttft_ms.p50 == pytest.approx(ttft)
    assert summary.tpot_ms.p50 == pytest.approx(tpot)
    assert summary.itl_ms.count == 3 * 49  # every gap between consecutive tokens
    assert summary.itl_ms.mean == pytest.approx(tpot, rel=1e-6)
    assert summary.mean_overhead_ms == pytest.approx(0.0, abs=1e-9)
    assert summary.output_throughput == pytest.approx(150 / summary.duration_s)
    assert 0 < summary.mean_kv_cache_usage <= summary.max_kv_cache_usage <= 1


def test_requests_vllm_refuses_are_counted_not_run():
    requests = [SimRequest("ok", 100, 10, 0.0), SimRequest("too-long", 4000, 200, 0.0)]
    result = simulate(EngineConfig(max_model_len=4096), requests)
    assert [r.request_id for r in result.requests] == ["ok"]
    assert result.summary.rejected == 1 and "maximum context length" in result.rejected[0][1]


def test_api_overhead_model_makes_the_overhead_component_non_zero():
    options = SimOptions(api_overhead_seconds=2e-3, tokenize_seconds_per_token=1e-6, detokenize_seconds_per_token=0)
    result = simulate(EngineConfig(max_model_len=4096), [SimRequest("a", 1000, 10, 0.0)], options=options)
    request = result.requests[0]
    assert request.queued_time == pytest.approx(1e-3 + 1000 * 1e-6)
    assert result.summary.mean_overhead_ms == pytest.approx(2.0 + 1.0)


def test_more_load_means_more_queueing():
    config = EngineConfig(max_model_len=4096, max_num_seqs=32)
    light = simulate(config, poisson_sharegpt(5, count=400, seed=1)).summary
    heavy = simulate(config, poisson_sharegpt(40, count=400, seed=1)).summary
    assert heavy.mean_queue_ms > light.mean_queue_ms
    assert heavy.ttft_ms.p90 > light.ttft_ms.p90


def test_a_larger_token_budget_lowers_ttft_under_prefill_heavy_load():
    requests = fixed_requests(60, 6000, 8, rate=4.0, seed=2)
    small = simulate(EngineConfig(max_model_len=8192, max_num_batched_tokens=512, max_num_seqs=64), _copy(requests))
    large = simulate(EngineConfig(max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=64), _copy(requests))
    assert large.summary.ttft_ms.mean < small.summary.ttft_ms.mean


def test_more_gpu_memory_utilization_means_more_blocks():
    model, hardware = model_profile("meta-llama/Llama-3.1-8B-Instruct"), hardware_profile("H100")
    low = plan_memory(EngineConfig(gpu_memory_utilization=0.7).resolved(), model, hardware)
    high = plan_memory(EngineConfig(gpu_memory_utilization=0.95).resolved(), model, hardware)
    assert high.num_blocks > low.num_blocks > 0
    # fp8 KV halves the bytes per token: about twice the blocks.
    fp8 = plan_memory(EngineConfig(kv_cache_dtype="fp8").resolved(), model, hardware)
    default = plan_memory(EngineConfig().resolved(), model, hardware)
    assert fp8.num_blocks == pytest.approx(2 * default.num_blocks, rel=0.01)
    # vLLM logs ~440-470k tokens of KV cache for this model on an H100 at the defaults.
    assert 400_000 < default.kv_cache_tokens < 500_000


def test_tensor_parallel_4_is_faster_per_step_than_2_for_70b():
    model, hardware = model_profile("meta-llama/Llama-3.1-70B-Instruct"), hardware_profile("H100")
    tp2 = StepCostModel(model, hardware, tensor_parallel_size=2)
    tp4 = StepCostModel(model, hardware, tensor_parallel_size=4)
    for batch, context in ((1, 1000), (64, 64 * 800), (256, 256 * 600)):
        assert tp4.decode_step_time(batch, context) < tp2.decode_step_time(batch, context)
    assert tp4.pass_time(8192, 4, 8192 * 4096, 8192) < tp2.pass_time(8192, 4, 8192 * 4096, 8192)


def test_moe_reads_only_the_experts_its_tokens_touch():
    model, hardware = model_profile("Qwen/Qwen3-30B-A3B"), hardware_profile("H100")
    cost = StepCostModel(model, hardware)
    one, many = cost.weight_bytes(1), cost.weight_bytes(512)
    assert one < many
    assert many == pytest.approx(model.weight_bytes - model.vocab_size * model.hidden_size * 2, rel=0.01)
    dense_equivalent = StepCostModel(model_profile("meta-llama/Llama-3.1-8B-Instruct"), hardware)
    assert cost.decode_step_time(1, 500) < dense_equivalent.decode_step_time(1, 500)


def test_speculative_run_reports_acceptance():
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, model="d")
    result = simulate(EngineConfig(max_model_len=4096, speculative_config=spec), fixed_requests(4, 100, 200))
    summary = result.summary
    assert 0 < summary.spec_acceptance_rate < 1
    assert summary.spec_mean_acceptance_length == pytest.approx(1 + sum((0.78, 0.58, 0.43)), rel=0.1)


def test_percentiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5 and percentile(values, 99) == pytest.approx(3.97)
    weighted = LatencyStats.of_weighted([(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)])
    plain = LatencyStats.of(values)
    assert (weighted.p50, weighted.p90, weighted.p99) == pytest.approx((plain.p50, plain.p90, plain.p99))
    assert LatencyStats.of_weighted([(5.0, 3), (1.0, 1)]).p50 == 5.0
    assert math.isnan(LatencyStats.of([]).mean)


def test_one_api_server_admits_a_burst_in_turn():
    burst = [SimRequest(f"r{i}", 100, 4, 0.0) for i in range(5)]
    api = dict(api_overhead_seconds=4e-3, tokenize_seconds_per_token=0.0, detokenize_seconds_per_token=0.0,
               api_seconds_per_output_token=0.0)
    serial = simulate(EngineConfig(max_model_len=4096), _copy(burst), options=SimOptions(api_server_serial=True, **api))
    apart = simulate(EngineConfig(max_model_len=4096), _copy(burst), options=SimOptions(api_server_serial=False, **api))
    # Half the fixed cost (2 ms) before the engine: one process does it for one request after another, so the
    # i-th request reaches the engine core 2 ms x (i + 1) after the burst (or at the end of the step then running).
    by_id = {r.request_id: r for r in serial.requests}
    assert by_id["r0"].queued_time == pytest.approx(2e-3)
    for i in range(5):
        assert by_id[f"r{i}"].queued_time >= 2e-3 * (i + 1) - 1e-9
    assert {round(r.queued_time, 9) for r in apart.requests} == {0.002}


def test_a_finished_requests_api_work_delays_the_next_admission_on_one_server():
    api = dict(api_overhead_seconds=40e-3, tokenize_seconds_per_token=0.0, detokenize_seconds_per_token=0.0,
               api_seconds_per_output_token=0.0)
    config = EngineConfig(max_model_len=4096)
    alone = simulate(config, [SimRequest("a", 16, 2, 0.0)], options=SimOptions(api_server_serial=True, **api))
    done = alone.requests[0].finished_time
    pair = [SimRequest("a", 16, 2, 0.0), SimRequest("b", 16, 2, done)]
    serial = {r.request_id: r for r in simulate(config, _copy(pair), options=SimOptions(api_server_serial=True,
                                                                                         **api)).requests}
    apart = {r.request_id: r for r in simulate(config, _copy(pair), options=SimOptions(api_server_serial=False,
                                                                                        **api)).requests}
    # b arrives as a's last token is made: one server process first ends a's response (20 ms, the other half of
    # the fixed cost), then admits b (20 ms). A server per request admits b in its own 20 ms.
    assert serial["b"].queued_time == pytest.approx(done + 40e-3)
    assert apart["b"].queued_time == pytest.approx(done + 20e-3)


def test_a_server_slower_than_the_engine_at_streaming_makes_clients_see_tokens_late():
    config = EngineConfig(max_model_len=4096)
    requests = [SimRequest(f"r{i}", 64, 100, 0.0) for i in range(8)]
    base = dict(api_overhead_seconds=0.0, tokenize_seconds_per_token=0.0, detokenize_seconds_per_token=0.0,
                api_server_serial=True)
    fast = simulate(config, _copy(requests), options=SimOptions(api_seconds_per_output_token=0.0, **base))
    slow = simulate(config, _copy(requests), options=SimOptions(api_seconds_per_output_token=5e-3, **base))
    # The engine is the same; only what the clients see changes.
    assert [r.finished_time for r in fast.requests] == pytest.approx([r.finished_time for r in slow.requests])
    assert all(r.stream_lag_first == 0.0 and r.stream_lag_last == 0.0 for r in fast.requests)
    engine_tpot = fast.summary.tpot_ms.p50
    assert engine_tpot < 20.0  # an H100 decodes 8 sequences of an 8B model far faster than 8 x 5 ms per step
    # 8 streams x 5 ms per token: the server, not the engine, sets the pace; the lag grows over the response.
    assert slow.summary.tpot_ms.p50 == pytest.approx(8 * 5.0, rel=0.05)
    assert slow.summary.output_throughput == pytest.approx(1 / 5e-3, rel=0.05)
    assert all(r.stream_lag_last > r.stream_lag_first > 0 for r in slow.requests)


def test_a_lagging_server_merges_a_streams_tokens_into_fewer_events():
    config = EngineConfig(max_model_len=4096)
    requests = [SimRequest(f"r{i}", 64, 100, 0.0) for i in range(8)]
    base = dict(api_overhead_seconds=0.0, tokenize_seconds_per_token=0.0, detokenize_seconds_per_token=0.0,
                api_server_serial=True)
    fast = simulate(config, _copy(requests), options=SimOptions(api_seconds_per_output_token=0.0, **base))
    merged = simulate(config, _copy(requests), options=SimOptions(api_seconds_per_output_token=0.0,
                                                                  api_seconds_per_event=5e-3, **base))
    engine_tpot = fast.summary.tpot_ms.p50
    # 8 events of 5 ms per step is far more than an H100's step: per token, as in the test above, the lag would
    # grow to 8 x 5 ms x 100 tokens. Per event, a lagging stream's tokens join its unsent output, so the server
    # visits each stream about once per lap of 8 x 5 ms: the lag settles there and the clients keep the
    # engine's pace.
    assert [r.finished_time for r in fast.requests] == pytest.approx([r.finished_time for r in merged.requests])
    assert all(0.03 < r.stream_lag_last < 0.05 for r in merged.requests)
    assert merged.summary.tpot_ms.p50 < 1.2 * engine_tpot
    assert merged.summary.output_throughput > 0.8 * fast.summary.output_throughput


@pytest.mark.parametrize("per_token, per_event", [(3e-4, 0.0), (1e-4, 4e-4)])
def test_stream_lag_is_the_same_with_and_without_event_skipping(per_token, per_event):
    config = EngineConfig(max_model_len=4096, max_num_seqs=32)
    requests = poisson_sharegpt(20.0, count=120, seed=3)
    options = SimOptions(api_server_serial=True, api_seconds_per_output_token=per_token,
                         api_seconds_per_event=per_event)
    skipped = simulate(config, _copy(requests), options=options, skip=True)
    stepped = simulate(config, _copy(requests), options=options, skip=False)
    for a, b in zip(skipped.requests, stepped.requests):
        assert a.queued_time == pytest.approx(b.queued_time, rel=1e-9, abs=1e-9)
        # A run of skipped steps gives each step the run's mean duration: exact for per-token work, within half
        # a percent for events, whose count depends on each step's length against the lag.
        tolerance = 1e-6 if not per_event else 5e-3
        assert a.stream_lag_first == pytest.approx(b.stream_lag_first, rel=tolerance, abs=1e-9)
        assert a.stream_lag_last == pytest.approx(b.stream_lag_last, rel=tolerance, abs=1e-9)


def test_a_server_sharing_the_engines_cores_slows_its_steps_by_at_most_its_share():
    config = EngineConfig(max_model_len=4096)
    requests = [SimRequest(f"r{i}", 64, 100, 0.0) for i in range(8)]
    options = SimOptions(api_overhead_seconds=0.0, tokenize_seconds_per_token=0.0, detokenize_seconds_per_token=0.0,
                         api_server_serial=True, api_seconds_per_output_token=5e-3)
    h100 = hardware_profile("H100")
    apart = simulate(config, _copy(requests), options=options, hardware=h100)
    shared = simulate(config, _copy(requests), options=options, hardware=h100.with_constants(api_core_share=0.5))
    engine_apart = max(r.finished_time for r in apart.requests)
    engine_shared = max(r.finished_time for r in shared.requests)
    # The server always has tokens waiting here (8 x 5 ms of work per step), so every step after the first runs at
    # half speed: the engine takes about twice as long, never more.
    assert 1.8 * engine_apart < engine_shared <= 2.0 * engine_apart + 1e-9
    # The clients are paced by the server either way.
    assert shared.summary.tpot_ms.p50 == pytest.approx(apart.summary.tpot_ms.p50, rel=0.1)
