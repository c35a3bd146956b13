"""Benchmark of the traffic fit (engine/sim/traffic_fit.py) against a known truth.

    python -m engine.bench.traffic_fit [--seed 0] [--no-hour]

A simulated group whose hardware constants are secretly perturbed (MFU x1.4, bandwidth efficiency x0.65, step
overhead x1.5 on the H100 profile, Llama-3.1-8B-Instruct, max_num_seqs 64) serves Poisson and bursty traffic with
shared prefixes; its replayed figures stand in for the rows the platform would decompose. The fit starts from the
published H100 profile and sees only those figures. Prints:

    BENCH traffic_fit_<constant>_error_pct=… %      (fitted vs secret constant, signed; the step overhead is held
                                                    as published, engine/sim/traffic_fit.fitted_names)
    BENCH traffic_fit_held_out_error_max_pct=… %    (worst |error| of p50/p95 TTFT and TPOT, the window's last fifth)
    BENCH traffic_fit_other_workload_error_max_pct=… % (the same on another rate and length mix, never seen)
    BENCH traffic_fit_seconds=… s                   (the fit above, ~2,000 requests)
    BENCH traffic_fit_hour_10rps_seconds=… s        (one hour at 10 req/s, 36,000 requests; --no-hour skips it)

Everything here is simulated, the "observed" side included: it measures whether the fit finds constants it was
not told, not how close the simulator is to a GPU.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence

from engine.cli_args import non_negative_int
from engine.config import EngineConfig
from engine.sim import traffic_fit as F
from engine.sim.profiles import HardwareProfile, hardware_profile

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PERTURBATION = {"mfu": 1.4, "bandwidth_efficiency": 0.65, "step_overhead": 1.5}


def group_config() -> EngineConfig:
    return EngineConfig(model=MODEL, gpu_type="H100", max_num_seqs=64)


def secret_profile(base: HardwareProfile | None = None) -> HardwareProfile:
    base = base or hardware_profile("H100")
    return base.with_constants(**{name: getattr(base, name) * factor for name, factor in PERTURBATION.items()})


def traffic(rng: random.Random, count: int, rate: float, *, bursty: bool, start: float = 0.0,
            prompt_median: float = 500.0, output_median: float = 120.0) -> list[tuple[float, int, int, int]]:
    """(arrival s, prompt, output, cached prefix) of ``count`` requests: Poisson at ``rate``, or bursty (a tenth
    arrive with the one before, the rest slower so the mean rate holds); lognormal lengths; three in ten share a
    prefix of half their prompt (whole 16-token blocks)."""
    out, t = [], start
    for _ in range(count):
        if bursty and rng.random() < 0.1:
            gap = 0.0
        else:
            gap = rng.expovariate(rate * (0.9 if bursty else 1.0))
        t += gap
        prompt = min(3000, int(rng.lognormvariate(0, 0.9) * prompt_median) + 8)
        output = min(800, int(rng.lognormvariate(0, 0.8) * output_median) + 2)
        cached = prompt // 2 // 16 * 16 if rng.random() < 0.3 else 0
        out.append((t, prompt, output, cached))
    return out


def observe(config: EngineConfig, truth: HardwareProfile, requests: Sequence[tuple[float, int, int, int]],
            seed: int = 0) -> list[F.Observed]:
    """What the platform's rows would say of these requests served by ``truth``: the replay's engine figures."""
    rows = [F.Observed(a, p, o, c) for a, p, o, c in requests]
    out = []
    for row, guess in zip(rows, F.replay(config, truth, rows, seed=seed)):
        if guess is not None:
            out.append(F.Observed(row.arrival, row.prompt_tokens, row.output_tokens, row.cached_tokens,
                                  ttft_ms=guess[0], tpot_ms=guess[1], queue_ms=guess[2]))
    return out


def mixed(seed: int, count: int = 1000, rate: float = 15.0) -> list[tuple[float, int, int, int]]:
    """The fitting window: ``count`` Poisson requests, then ``count`` bursty ones, at ``rate``."""
    rng = random.Random(seed)
    first = traffic(rng, count, rate, bursty=False)
    return first + traffic(rng, count, rate, bursty=True, start=first[-1][0])


def other_workload(seed: int) -> list[tuple[float, int, int, int]]:
    """Another rate and length mix: 25 req/s, bursty, shorter prompts and longer outputs."""
    return traffic(random.Random(seed + 1000), 1500, 25.0, bursty=True, prompt_median=300, output_median=200)


def worst(errors: dict[str, float]) -> float:
    return max(abs(v) for k, v in errors.items() if k.startswith(("ttft", "tpot"))) * 100


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.traffic_fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--no-hour", action="store_true", help="skip the one-hour fit-time figure")
    args = parser.parse_args(argv)
    config, base = group_config(), hardware_profile("H100")
    truth = secret_profile(base)
    rows = observe(config, truth, mixed(args.seed))
    started = time.perf_counter()
    fit = F.fit(config, rows, seed=args.seed, progress=lambda line: print(f"# {line}"))
    seconds = time.perf_counter() - started
    for name, value in fit.constants.items():
        print(f"BENCH traffic_fit_{name}_error_pct={(value / getattr(truth, name) - 1) * 100:.2f} %")
    print(f"BENCH traffic_fit_held_out_error_max_pct={worst(fit.held_out_error):.2f} %")
    other = F.predict(config, fit.profile(), observe(config, truth, other_workload(args.seed)),
                      queue_floor_ms=fit.queue_floor_ms)
    print(f"BENCH traffic_fit_other_workload_error_max_pct={worst(other):.2f} %")
    print(f"BENCH traffic_fit_seconds={seconds:.1f} s")
    print(f"# {fit.fit_requests} fitting + {fit.held_out_requests} held-out requests, {fit.evaluations} replays; "
          f"held-out errors " + ", ".join(f"{k} {v * 100:+.1f}%" for k, v in fit.held_out_error.items()))
    if not args.no_hour:
        rng = random.Random(args.seed + 7)
        first = traffic(rng, 18_000, 10.0, bursty=False)
        hour = observe(config, truth, first + traffic(rng, 18_000, 10.0, bursty=True, start=first[-1][0]))
        started = time.perf_counter()
        long_fit = F.fit(config, hour, seed=args.seed)
        print(f"BENCH traffic_fit_hour_10rps_seconds={time.perf_counter() - started:.1f} s")
        print(f"# the hour: {long_fit.fit_requests} fitting requests sampled to {F.SAMPLE_REQUESTS} per replay, "
              f"{long_fit.evaluations} replays, held-out worst {worst(long_fit.held_out_error):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
