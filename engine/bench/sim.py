"""Benchmark of the simulator: how fast virtual time runs, and how far it is from published vLLM figures.

    python -m engine.bench.sim [--duration 3600] [--rate 50] [--seed 0] [--no-calibration]

Simulates ``--duration`` seconds of Poisson traffic at ``--rate`` requests/s with
ShareGPT-like lengths on Llama-3.1-8B-Instruct / 1x H100 (default engine config) in
virtual time, single-threaded, and runs every calibration point. Prints:

    BENCH sim_hour_50rps_seconds=… s           (wall time of the simulation, workload generation excluded)
    BENCH sim_speedup_x=… x                    (simulated seconds per wall second)
    BENCH calibration_error_max_pct=… %        (worst |error| over the calibration points)
    BENCH calibration_<point>_error_pct=… %    (signed error of each point)

plus ``#`` lines describing the simulated run (it is a simulation, not a measurement).
The metric names keep ``hour_50rps`` whatever the arguments, so runs stay comparable
only at the defaults.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from engine.cli_args import non_negative_int, positive_float
from engine.config import EngineConfig
from engine.sim.calibration import run_calibration
from engine.sim.virtual import simulate
from engine.sim.workload import poisson_sharegpt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=positive_float, default=3600.0, help="seconds of simulated traffic")
    parser.add_argument("--rate", type=positive_float, default=50.0, help="requests per second (Poisson)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--no-calibration", action="store_true", help="skip the calibration points")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    requests = poisson_sharegpt(args.rate, duration=args.duration, seed=args.seed)
    generated = time.perf_counter() - started

    started = time.perf_counter()
    result = simulate(EngineConfig(), requests, seed=args.seed)
    elapsed = time.perf_counter() - started
    summary = result.summary
    print(f"# simulated {len(requests)} requests ({args.duration:g} s at {args.rate:g} req/s, ShareGPT-like) on "
          f"{summary.model} / {summary.gpu_type} ({summary.config_version}); workload built in {generated:.1f} s")
    print(f"# simulated: {summary.output_throughput:.0f} output tok/s, TTFT p50 {summary.ttft_ms.p50:.0f} ms, "
          f"TPOT p50 {summary.tpot_ms.p50:.1f} ms, queue mean {summary.mean_queue_ms:.0f} ms, "
          f"{summary.num_preemptions} preemptions, KV usage max {summary.max_kv_cache_usage:.0%}, "
          f"{summary.num_steps} engine steps")
    print(f"BENCH sim_hour_50rps_seconds={elapsed:.2f} s")
    print(f"BENCH sim_speedup_x={args.duration / elapsed:.0f} x")

    if not args.no_calibration:
        results = run_calibration()
        worst = max(abs(r.error_pct) for r in results)
        print(f"BENCH calibration_error_max_pct={worst:.1f} %")
        for r in results:
            print(f"BENCH calibration_{r.point.name}_error_pct={r.error_pct:+.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
