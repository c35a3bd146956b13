"""Tuning studies in the simulator: `python -m tuning.bench [--trials 100] [--workloads chat,rag,code]
[--confirm]`.

The simulator is the testbed (Llama-3.1-8B-Instruct on one simulated H100, vLLM's cost model in virtual time);
every figure says so. Per workload (ShareGPT-like chat, long-prompt RAG, code completion with shared prefixes),
each with SLOs typical of it, a study run as the platform runs it (``tuning.search.settle`` after the search):

- goodput of vLLM's default config and of the study's winner on 5 fresh seeds (the median; median − MAD beside
  it), seeds neither the search nor the choice of the winner used, and their ratio (target ≥ 1.3×) when the
  defaults meet the SLOs at some rate (else both goodputs); the winner's figure on the search's seed beside them;
- the same budget spent as vLLM's `auto_tune.sh` spends it (a grid of max_num_seqs × max_num_batched_tokens): its
  best point, chosen on the search's seed, scored on the same fresh seeds;
- the figures under their earlier names: median − MAD over the 5 selection seeds the winner was chosen on (which
  carries the luck of that choice), and the grid's one-seed maximum;
- wall time of the whole study (search with Optuna's RDB storage in a SQLite file, re-scoring over the selection
  and the fresh seeds; the grid apart) on this machine, run as server mode runs it: two worker processes
  (`--workers`, TUNING_PARALLEL_TRIALS) asking and telling on one storage (target ≤ 10 min for 100 trials);
- on a smaller space (max_num_seqs × max_num_batched_tokens × n-gram speculation) searched exhaustively:
  trials a study needs to reach 95% of the grid's best (target ≤ 1/5 of the grid size).

`--confirm` adds the predicted-vs-confirmed figures: a study through a live platform whose fleet runs the
default config, and its confirmation run on real-time simulated replicas (both arms measured at one rate).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from benchkit.harness import ROOT, PlatformProcess, free_port, free_port_pair

from engine.config import EngineConfig
from engine.launcher.vllm_command import find_vllm_executable

from . import search as S
from .goodput import Slo, goodput
from .space import DEFAULT_SPACE, check, parse_space
from .workload import synthetic

SLOS = {
    "chat": Slo({"ttft_ms": 200.0, "tpot_ms": 20.0}, 0.95, "chat: TTFT ≤ 200 ms, TPOT ≤ 20 ms"),
    "rag": Slo({"ttft_ms": 1000.0, "tpot_ms": 30.0}, 0.95, "RAG: TTFT ≤ 1 s, TPOT ≤ 30 ms"),
    "code": Slo({"ttft_ms": 150.0, "e2e_ms": 1000.0}, 0.95, "code completion: TTFT ≤ 150 ms, e2e ≤ 1 s"),
}
SMALL_SPACE = {"max_num_seqs": [8, 16, 32, 64, 128, 256, 512, 1024],
               "max_num_batched_tokens": [1024, 2048, 4096, 8192, 16384],
               "speculative_method": ["none", "ngram"], "num_speculative_tokens": [2, 4]}


# A team with a trained EAGLE-3 head for its model can let the study use it (--eagle3): the head for
# Llama-3.1-8B-Instruct whose acceptance on MT-Bench vLLM issue #20780 measured (engine/sim/speculative.py).
EAGLE3_HEAD = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
_DRAFT: str | None = None  # set by --eagle3 before the worker processes fork


def _space_data() -> dict | None:
    if _DRAFT is None:
        return None  # the default space: n-gram drafting is the only method that needs no draft model
    return dict(DEFAULT_SPACE, speculative_method=["none", "ngram", "eagle3"], speculative_model=_DRAFT)


def _label(kind: str) -> str:
    return f"{kind}_eagle3" if _DRAFT else kind


def _problem(kind: str) -> S.Problem:
    default = EngineConfig()
    return S.Problem(default, parse_space(_space_data(), default), synthetic(kind), SLOS[kind])


def _storage(url: str) -> optuna.storages.RDBStorage:
    # Two worker processes write one SQLite file: wait for its lock rather than fail.
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})


def _search_worker(kind: str, url: str, trials: int, worker: int) -> None:
    """One worker of the study: ask and tell on the shared storage until it holds ``trials`` valid trials."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=kind, storage=_storage(url), sampler=S.sampler("goodput", worker))
    S.search(_problem(kind), study, trials)


RESCORE_SEEDS = 5
CANDIDATES = 5


def study_figures(kind: str, trials: int, storage_dir: Path, workers: int) -> None:
    """The study as the platform runs it in server mode: the defaults (the current config) scored on the search's
    seed, ``workers`` processes (TUNING_PARALLEL_TRIALS, 2 by default) asking and telling on one Optuna storage,
    then ``S.settle`` spread over the same workers: the top five and the defaults over 5 selection seeds, the
    winner, the defaults and the auto_tune.sh-style grid's best on 5 fresh seeds."""
    default = EngineConfig()
    slo = SLOS[kind]
    problem = _problem(kind)
    started = time.perf_counter()
    now = goodput(default, problem.workload, slo, seed=problem.seed, count=problem.count, precision=problem.precision)
    current = {"config": default.to_dict(), "score": now.goodput, "goodput": now.goodput}
    url = f"sqlite:///{storage_dir / f'{kind}.sqlite3'}"
    study = optuna.create_study(study_name=kind, storage=_storage(url), directions=S.directions("goodput"),
                                sampler=S.sampler("goodput", 0))
    S.seed_start(problem, study)
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for future in [pool.submit(_search_worker, kind, url, trials, worker) for worker in range(workers)]:
            future.result()
        searched = time.perf_counter() - started
        candidates, seen = [], set()
        for t in sorted(S.valid_trials(study), key=lambda t: -t.user_attrs["score"]):
            key = repr(sorted(t.params.items()))
            if key not in seen and len(candidates) < CANDIDATES:
                seen.add(key)
                candidates.append({"trial": t.number, "config": t.user_attrs["config"], "score": t.user_attrs["score"],
                                   "goodput": t.user_attrs["goodput"], "params": t.params})
        grid_started = time.perf_counter()
        grid = S.grid_baseline(problem, trials)
        grid_s = time.perf_counter() - grid_started
        out = S.settle(problem, candidates, current, seeds=RESCORE_SEEDS, grid=grid, pool_map=pool.map)
    wall = time.perf_counter() - started - grid_s
    best, base = out["best"], out["current_fresh"]
    label = _label(kind)
    fresh = f"{len(out['seeds']['fresh'])} fresh seeds"
    print(f"# {label}: {slo.source} for {slo.target:.0%}; winner "
          f"{json.dumps({k: v for k, v in best['config'].items() if k not in ('model', 'gpu_type')})}")
    print(f"# {label}: goodput = the {out['figures']['goodput']}; robust = the {out['figures']['robust']}")
    print(f"BENCH tuning_{label}_default_goodput_fresh_rps={base['goodput']:.2f} req/s (simulated; median over {fresh}; "
          f"robust {base['robust_goodput']:.2f}; {now.goodput:.2f} on the search's seed)")
    print(f"BENCH tuning_{label}_tuned_goodput_fresh_rps={best['goodput']:.2f} req/s (simulated; median over the same "
          f"{fresh}; robust {best['robust_goodput']:.2f})")
    print(f"BENCH tuning_{label}_tuned_goodput_search_rps={best['search_goodput']:.2f} req/s (simulated; the winner's "
          "trial on the search's seed)")
    if out["predicted_gain"] is not None:
        print(f"BENCH tuning_{label}_tuned_over_default_fresh={out['predicted_gain']:.2f} x (simulated; the two "
              f"medians over the same {fresh})")
    else:
        print(f"# {label}: no ratio: the defaults meet the SLOs at no rate ({base['goodput']:.2f} req/s); tuned "
              f"{best['goodput']:.2f} req/s")
    g = (out.get("grid_baseline") or {}).get("best")
    if g:
        print(f"BENCH tuning_{label}_autotune_grid_goodput_fresh_rps={g['goodput']:.2f} req/s (simulated; median over "
              f"the same {fresh}; robust {g['robust_goodput']:.2f}; {grid['points']} points of max_num_seqs x "
              f"max_num_batched_tokens, best {g['max_num_seqs']}/{g['max_num_batched_tokens']} on the search's seed)")
    # The earlier names, with their meanings: figures on the seeds the winner was chosen on, and the grid's one-seed
    # maximum.
    selection = f"median − MAD over the {len(out['seeds']['selection'])} selection seeds"
    print(f"BENCH tuning_{label}_default_goodput_rps={out['current_robust_score']:.2f} req/s (simulated; {selection})")
    print(f"BENCH tuning_{label}_tuned_goodput_rps={best['selection_score']:.2f} req/s (simulated; {selection}, the "
          "winner chosen on them)")
    if out["current_robust_score"] > 0:
        print(f"BENCH tuning_{label}_tuned_over_default={best['selection_score'] / out['current_robust_score']:.2f} x "
              "(simulated; of the two selection figures)")
    if g:
        print(f"BENCH tuning_{label}_autotune_grid_goodput_rps={g['search_goodput']:.2f} req/s (simulated; the grid's "
              "one-seed maximum, on the search's seed)")
    # At the defaults' goodput on the search's seed, as the study explains it (at the workload's own rate when no
    # rate meets the SLOs with the defaults).
    explanation = S.explain(problem, default, EngineConfig.from_dict(best["config"]), now.goodput)
    limits = explanation["limits"]
    if limits:
        where = "the defaults' goodput on the search's seed" if now.goodput > 0 else \
            "the workload's rate (the defaults meet none)"
        print(f"BENCH tuning_{label}_limiting_slo={S.SLO_LABELS[limits[0]['slo']]} (at {where}; the defaults "
              f"are the current config: {S.limit_sentence(slo, limits, explanation['rate'])})")
    print(f"BENCH tuning_{label}_study_wall_s={wall:.1f} s ({len(S.valid_trials(study))} trials on {workers} "
          f"worker processes; search {searched:.1f} s, re-scoring over the selection and the fresh seeds "
          f"{wall - searched:.1f} s; the grid apart, {grid_s:.1f} s)")
    print(f"BENCH tuning_{label}_refused_configs={sum(1 for t in study.trials if t.user_attrs.get('valid') is False)} "
          "(told to Optuna as infeasible, not simulated)")


def grid_figures(kind: str, repeats: int) -> None:
    default = EngineConfig()
    workload = synthetic(kind)
    slo = SLOS[kind]
    space = parse_space(SMALL_SPACE, default)
    problem = S.Problem(default, space, workload, slo, count=200)
    started = time.perf_counter()
    values = []
    for point in space.grid():
        config, _ = check(space, default, point)
        if config is not None:
            values.append(goodput(config, workload, slo, count=200, precision=problem.precision).goodput)
    best = max(values)
    grid_s = time.perf_counter() - started
    needed = []
    for seed in range(repeats):
        study = optuna.create_study(directions=["maximize"], sampler=S.sampler("goodput", seed))
        reached = None
        for budget in range(1, len(values) + 1):
            S.search(problem, study, budget)
            if study.best_value >= 0.95 * best:
                reached = len(S.valid_trials(study))
                break
        needed.append(reached or len(values))
    print(f"BENCH tuning_{kind}_grid_size={len(values)} valid points (exhaustive in {grid_s:.0f} s)")
    print(f"BENCH tuning_{kind}_trials_to_95pct_of_grid_best={statistics.median(needed):.0f} trials (median of "
          f"{repeats} seeds: {needed}; {statistics.median(needed) / len(values):.2f} of the grid)")


SIM_GROUP = ("  - {{name: base, weight: 100, replicas: 1, backend: simulator,\n"
             "     config: {{model: meta-llama/Llama-3.1-8B-Instruct, gpu_type: H100, tensor_parallel_size: 1}}}}\n")
# Real vLLM (its CPU build) serving the study-size tiny Llama with max_num_seqs 4: a poor config for chat traffic
# that a study must beat, confirmed on real `vllm serve` processes. SLOs fit for two shared cores.
VLLM_GROUP = ("  - {{name: base, weight: 100, replicas: 1, backend: vllm, served_model_name: tiny-study,\n"
              "     config: {{model: {model}, gpu_type: CPU, max_num_seqs: 4, kv_cache_memory_bytes: 134217728}}}}\n")
VLLM_SLO = Slo({"ttft_ms": 2000.0, "tpot_ms": 100.0}, 0.9, "CPU chat: TTFT ≤ 2 s, TPOT ≤ 100 ms")
VLLM_SPACE = {"max_num_seqs": [4, 8, 16, 32, 64], "max_num_batched_tokens": [512, 1024, 2048, 4096]}


def confirm_figures(trials: int, real_vllm: bool = False) -> None:
    """A study through a live platform and its confirmation run: on real-time simulated replicas (a simulated H100
    group running vLLM's defaults), or, with ``real_vllm``, on real `vllm serve` processes (vLLM's CPU build, the
    tiny model, a group with max_num_seqs 4)."""
    fleet_text = (
        "name: bench-tuning\nrun_dir: {run_dir}\ngateway: {{bind: 127.0.0.1:{gateway}}}\n"
        "control: {{bind: 127.0.0.1:{control}}}\nreplicas: {{host: 127.0.0.1, base_port: {replicas}}}\n"
        "telemetry: {{otlp_protocol: {protocol}}}\n{vllm}groups:\n" + (VLLM_GROUP if real_vllm else SIM_GROUP))
    slo = VLLM_SLO if real_vllm else SLOS["chat"]
    extra = []
    if real_vllm:
        executable = find_vllm_executable()
        model = ROOT / ".data" / "models" / "tiny-study"
        if executable is None or not (model / "config.json").exists():
            raise SystemExit("real vLLM and the study-size tiny model are needed: make vllm tiny-models")
        space = Path(tempfile.mkdtemp(prefix="bench-tuning-space-")) / "space.json"
        space.write_text(json.dumps(VLLM_SPACE))
        extra = ["--space", str(space)]
    with tempfile.TemporaryDirectory(prefix="bench-tuning-") as tmp:
        root = Path(tmp)
        fleet = root / "fleet.yaml"
        fleet.write_text(fleet_text.format(
            run_dir=root / "engine", gateway=free_port(), control=free_port(), replicas=free_port_pair(),
            protocol="grpc" if real_vllm else "http/protobuf",
            vllm=f"vllm: {{executable: {executable}}}\n" if real_vllm else "",
            model=model if real_vllm else ""))
        process = PlatformProcess(data_dir=str(root / "data"), args=("--with-engine",), grpc=real_vllm,
                                  extra_env={"ENGINE_FLEET": str(fleet), "TUNING_CONFIRM_ITEMS": "200"})
        try:
            process.manage("migrate", "-v0")
            process.manage("create_ingest_key", "--project", "default")
            process.start(timeout=300 if real_vllm else 180)
            out = root / "study.json"
            args = [sys.executable, str(ROOT / "manage.py"), "tune", "--project", "default", "--group", "base",
                    "--workload", "synthetic:chat", "--trials", str(trials), "--json", str(out), *extra,
                    *[f"--slo={k}={v:g}" for k, v in slo.thresholds.items()], "--target", str(slo.target)]
            done = subprocess.run(args, env=process.env, capture_output=True, text=True, timeout=3600)
            if done.returncode not in (0, 1):
                print(done.stdout[-3000:], done.stderr[-3000:])
                raise SystemExit("the study failed")
            result = json.loads(out.read_text())
        finally:
            process.stop()
    confirmation = result.get("confirmation") or {}
    label = "tuning_vllm" if real_vllm else "tuning"
    where = "real vLLM (CPU build, tiny model)" if real_vllm else "real-time simulated replicas"
    print(f"# {label}: {slo.source} for {slo.target:.0%}; current {result['current']['config'].get('max_num_seqs')} "
          f"seqs; winner {json.dumps({k: v for k, v in result['best']['config'].items() if k in VLLM_SPACE})}")
    seeds = len((result.get("seeds") or {}).get("fresh") or [])
    if result.get("predicted_gain") is not None:
        print(f"BENCH {label}_predicted_gain={result['predicted_gain']:.2f} x goodput (simulated, on {seeds} fresh "
              f"seeds: {result['current']['goodput']:.2f} -> {result['best']['goodput']:.2f} req/s)")
    else:
        print(f"# {label}: no ratio: the current config meets the SLOs at no rate; simulated goodput on {seeds} fresh "
              f"seeds {result['current']['goodput']:.2f} -> {result['best']['goodput']:.2f} req/s")
    if confirmation.get("measured"):
        m, p = confirmation["measured"], confirmation["predicted_attainment"]
        print(f"# confirmation run {confirmation['run_id']} at {confirmation['rate']:.2f} req/s on {where}")
        for arm in ("current", "best"):
            print(f"BENCH {label}_confirm_{arm}_attainment_measured={100 * m[arm]['attainment']:.1f} % "
                  f"(predicted {100 * p[arm]:.1f} %, gap {100 * (p[arm] - m[arm]['attainment']):+.1f} points)")
        for step in (confirmation.get("steps") or [])[1:]:
            measured, predicted = 100 * (step["attainment"] or 0), 100 * (step["predicted_attainment"] or 0)
            print(f"# the winner alone at {step['rate']:.2f} req/s (run {step['run_id']}): measured "
                  f"{measured:.1f} %, predicted {predicted:.1f} %")
        rates = ", ".join(format(step["rate"], ".2f") for step in confirmation.get("steps") or [])
        capped = confirmation.get("capped")
        print(f"BENCH {label}_confirmed_goodput_rps={confirmation.get('confirmed_goodput') or 0:.2f} req/s "
              f"(measured on {where}, replayed at {rates} req/s until it met the SLOs"
              + (f"; capped at {capped['rate']:.2f} req/s, TUNING_CONFIRM_MAX_RATE: a lower bound" if capped else "")
              + f"; predicted {result['best']['goodput']:.2f} req/s, simulated)")
        print(f"# confirmation: {confirmation.get('statement')}")
    else:
        print(f"# confirmation: {confirmation}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--workloads", default="chat,rag,code")
    parser.add_argument("--grid-seeds", type=int, default=3)
    parser.add_argument("--confirm", action="store_true", help="also run a study through a live platform")
    parser.add_argument("--confirm-vllm", action="store_true",
                        help="also run a study on a group of real vLLM replicas (CPU build) and confirm it there")
    parser.add_argument("--eagle3", action="store_true",
                        help=f"let the studies also draft with an EAGLE-3 head ({EAGLE3_HEAD}); figures say _eagle3")
    parser.add_argument("--no-grid", action="store_true", help="skip the exhaustive-grid figures")
    parser.add_argument("--workers", type=int, default=2,
                        help="worker processes of a study (server mode's TUNING_PARALLEL_TRIALS default: 2)")
    args = parser.parse_args(argv)
    global _DRAFT
    _DRAFT = EAGLE3_HEAD if args.eagle3 else None
    print("# the simulator is the testbed: Llama-3.1-8B-Instruct on one simulated H100 (no GPU here)")
    with tempfile.TemporaryDirectory(prefix="bench-tuning-") as tmp:
        for kind in [k for k in args.workloads.split(",") if k]:
            study_figures(kind, args.trials, Path(tmp), args.workers)
            if not args.no_grid:
                grid_figures(kind, args.grid_seeds)
    if args.confirm:
        confirm_figures(min(args.trials, 30))
    if args.confirm_vllm:
        confirm_figures(min(args.trials, 20), real_vllm=True)


if __name__ == "__main__":
    main()
