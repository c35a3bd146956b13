"""Fit the simulator's constants to the traffic a replica group served: no benchmark run, no traffic of its own.

The platform decomposes every request into queue, prefill and decode on the engine's own clock. Replaying the
group's requests (their arrival times, prompt, cached-prefix and output lengths) through the simulator with the
group's engine config predicts those figures for each request; the fit moves the hardware profile's constants until
the prediction matches what was observed:

- residuals: log(predicted / observed) of the engine core's prefill time (its TTFT less its queue) and of its TPOT,
  and the queue time's error relative to max(observed, a floor) at half weight (a queue of nearly nothing would
  otherwise weigh most). Prefill rather than TTFT: where requests queue, TTFT is mostly queue, which the decode
  costs set (how long the requests ahead hold their sequences); matched as TTFT, a queue the replay under-predicts
  was made up by a slower prefill, and the median TTFT came out high (real vLLM, two sequences at a time: +44 % on
  the fitting slice itself);
- residuals over bins of BIN consecutive requests (their mean figures), not each request: which of two requests the
  scheduler takes first flips on the smallest change of a constant, and per request that noise is as large as the
  signal; soft-L1 loss, so a few outliers do not steer the fit;
- and the mean prefill time of up to LENGTH_CLASSES classes of requests by prompt length, over the whole slice:
  bins of consecutive requests mix short and long prompts, and where nearly every step mixes a prefill chunk with
  decodes, a faster MFU and slower reads explain the same bins (a saturated L4 group's 320 requests through the live
  gateway: MFU +28 %, bandwidth -20 % without the classes, +3 % and -3 % with them);
- a global pass (a scrambled Sobol sample of the constants, each within a factor of four of the starting
  profile's, sixteen on the CPU build), then a local one (SciPy's Nelder-Mead from each of the LOCAL_STARTS best
  points, the lowest end kept: from the best alone, one of three windows of a known truth ended in another basin,
  its MFU 7 % off), in log space;
- the window's last fifth is never fitted: the model's ``held_out_error`` is its prediction error there, per
  figure (TTFT, TPOT, queue) and quantile (p50, p95): (predicted - observed) / observed, the queue's over the floor.

Which constants are fitted: ``fitted_names`` (MFU and bandwidth efficiency on a GPU host; with the step's fixed and
per-sequence costs on the CPU build), from the start profile's values.

A long window is fitted on a sample of it: whole stretches of consecutive requests (queues build across
neighbours), each replayed after a lead-in of the requests before it that is replayed but not scored.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.sim.options import SimOptions
from engine.sim.profiles import HardwareProfile, hardware_profile
from engine.sim.request import SimRequest
from engine.sim.virtual import percentile, simulate

# Constants a traffic fit moves (fitted_names says why these).
GPU_FITTED = ("mfu", "bandwidth_efficiency")
CPU_FITTED = GPU_FITTED + ("step_overhead", "sequence_overhead")
BOUNDS = {"mfu": (0.005, 1.0), "bandwidth_efficiency": (0.01, 1.0), "step_overhead": (1e-5, 0.2),
          "sequence_overhead": (1e-7, 0.02)}
SPAN = 4.0  # the global pass searches each constant within [start / SPAN, start · SPAN] (and BOUNDS)
# On the CPU build the search spans further: hosts of one kind differ 2.5-5x under load (docs/engine-simulator.md),
# and one shared with other work more; real vLLM on a busy 2-core host had its MFU and bandwidth pinned at a quarter
# of the published values, the bound of SPAN (tuning/bench_vllm.py).
CPU_SPAN = 16.0
FIGURES = ("ttft_ms", "tpot_ms", "queue_ms")
QUANTILES = (50, 95)
CURVE_QUANTILES = (5, 10, 25, 50, 75, 90, 95, 99)  # the predicted-vs-observed curves the engine page draws
MOVED_AT = 0.10  # a cost whose replay at the same batches is off by this much or more is named as moved
HELD_OUT_SHARE = 0.2
MIN_REQUESTS = 200  # requests with engine timings in the window (fewer: refused), as the platform counts them
SAMPLE_REQUESTS = 1600  # scored requests replayed per objective evaluation (a longer slice is sampled)
LEAD_SECONDS = 20.0  # replayed before each sampled stretch, not scored: the queue it finds
BIN = 16  # consecutive requests whose mean figures are one residual each
LENGTH_CLASSES = 32  # classes of requests by prompt length (of BIN at least) whose mean prefill times are one residual each
LOCAL_STARTS = 3  # the global pass's best points the local pass starts from
XATOL, FATOL = 0.03, 0.05  # a local pass ends when its simplex spans under XATOL (log: 3 %) and its costs FATOL


class FitError(ValueError):
    """The traffic cannot be fitted (too little, no engine timings); the message says what is missing."""


@dataclasses.dataclass(frozen=True, slots=True)
class Observed:
    """One engine-served request as the platform decomposed it; timings in ms on the engine's clock (None: not
    reported)."""

    arrival: float  # seconds, any origin (only differences matter)
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    # The engine core's TTFT: from entering its queue to its first token (vLLM's time in queue + time in model
    # prefill, both on the core's clock). Not the frontend's time_to_first_token, which adds the API server's
    # admission and the moment its handler got to the token: on a loaded host that lag is noise the constants
    # cannot explain, and it pulled the fit 10-20 % off a known truth.
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    queue_ms: float | None = None


@dataclasses.dataclass
class Fit:
    """A fitted model: the constants, the profile they replace, and its errors on the fitting and held-out slices."""

    base_profile: str
    constants: dict[str, float]
    start_constants: dict[str, float]
    fit_error: dict[str, float]
    held_out_error: dict[str, float]
    fit_requests: int
    held_out_requests: int
    evaluations: int
    seconds: float
    cost: float
    queue_floor_ms: float
    held_out_curves: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)

    def profile(self) -> HardwareProfile:
        return hardware_profile(self.base_profile).with_constants(**self.constants)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fitted_names(profile: HardwareProfile) -> list[str]:
    """The constants a fit moves. On a GPU host: MFU (prefill is compute-bound) and bandwidth efficiency (decode is
    memory-bound). The step's fixed cost stays as published: a decode step costs the weights' read plus that fixed
    cost, both the same at every step, and only the KV cache's share (small at a chat load's contexts) tells them
    apart; fitted too, it drifted anywhere between -78 % and +73 % of a known truth while the predictions stayed
    within 5 %, and it doubled the fit's time. Holding it, bandwidth efficiency absorbs the difference (a few per
    cent). On the CPU build (its API server shares the engine's cores) the step's fixed cost and the per-sequence
    cost of a step weigh as much as the model's passes and are fitted as well. The API server's own costs are
    not: the engine core's figures the fit reads do not include them. Only those the profile holds above zero."""
    return [name for name in (CPU_FITTED if profile.api_server_serial else GPU_FITTED) if getattr(profile, name) > 0]


def _request_of(index: int, row: Observed, ids: tuple[int, ...] | None) -> SimRequest:
    return SimRequest(f"o{index}", row.prompt_tokens, max(1, row.output_tokens), row.arrival, prompt_token_ids=ids)


def prompt_ids(index: int, row: Observed) -> tuple[int, ...] | None:
    """The token ids a replay gives the ``index``-th row (None: a unique prompt, nothing cached): a shared prefix of
    the cached length (the simulator hashes whole blocks of token ids), then tokens of this request alone, so the
    replay's prefix cache hits about where the engine's did."""
    if row.cached_tokens <= 0:
        return None
    own = 1_000_000 + index * 65_536
    return tuple(range(row.cached_tokens)) + tuple(range(own, own + row.prompt_tokens - row.cached_tokens))


def replay(config: EngineConfig, profile: HardwareProfile, rows: Sequence[Observed], *, seed: int = 0,
           options: SimOptions | None = None,
           ids: Sequence[tuple[int, ...] | None] | None = None) -> list[tuple[float, float | None, float] | None]:
    """(engine TTFT ms, TPOT ms or None, queue ms) the simulator predicts for each row (None: it did not finish).
    ``ids``: each row's ``prompt_ids``, built once by a caller that replays the same rows many times."""
    if ids is None:
        ids = [prompt_ids(i, row) for i, row in enumerate(rows)]
    requests = [_request_of(i, row, row_ids) for i, (row, row_ids) in enumerate(zip(rows, ids))]
    result = simulate(config, requests, hardware=profile, options=options or SimOptions(), seed=seed,
                      figures=False)
    out: list[tuple[float, float | None, float] | None] = []
    for request in requests:
        if request.first_token_time is None or request.scheduled_time is None:
            out.append(None)
            continue
        tpot = None
        if request.num_generated > 1 and request.last_token_time is not None:
            tpot = (request.last_token_time - request.first_token_time) / (request.num_generated - 1) * 1e3
        queued = request.queued_time if request.queued_time is not None else request.arrival_time
        out.append(((request.first_token_time - queued) * 1e3, tpot, (request.scheduled_time - queued) * 1e3))
    del result
    return out


def _stretches(rows: Sequence[Observed], budget: int) -> list[tuple[int, int, int]]:
    """(lead start, scored start, end) index ranges: all of ``rows`` up to twice the budget (stretches and their
    lead-ins would replay nearly as many), else evenly spaced stretches of consecutive requests adding up to about
    ``budget``, each after a lead-in."""
    n = len(rows)
    if n <= 2 * budget:
        return [(0, 0, n)]
    count = max(2, min(8, budget // 400))
    size = budget // count
    out = []
    for k in range(count):
        start = (n - size) * k // (count - 1)
        lead = start
        while lead > 0 and rows[start].arrival - rows[lead - 1].arrival <= LEAD_SECONDS:
            lead -= 1
        out.append((lead, start, start + size))
    return out


class _Problem:
    def __init__(self, config: EngineConfig, base: HardwareProfile, names: list[str], rows: Sequence[Observed],
                 budget: int, queue_floor_ms: float, seed: int):
        self.config, self.base, self.names, self.seed = config, base, names, seed
        self.queue_floor = queue_floor_ms
        self.parts = [(rows[lead:end], start - lead) for lead, start, end in _stretches(rows, budget)]
        # Each part's prompt ids, built once: a fit replays its parts a few hundred times.
        self.ids = [[prompt_ids(i, row) for i, row in enumerate(part)] for part, _ in self.parts]
        self.scored = sum(len(part) - skip for part, skip in self.parts)
        self.evaluations = 0

    def profile(self, x: Sequence[float]) -> HardwareProfile:
        values = {}
        for name, value in zip(self.names, x):
            low, high = BOUNDS[name]
            values[name] = min(high, max(low, getattr(self.base, name) * math.exp(value)))
        return self.base.with_constants(**values)

    def residuals(self, x: Sequence[float]) -> list[float]:
        self.evaluations += 1
        profile = self.profile(x)
        out: list[float] = []
        scored: list[tuple[Observed, tuple | None]] = []
        for (part, skip), ids in zip(self.parts, self.ids):
            predicted = replay(self.config, profile, part, seed=self.seed, ids=ids)
            rows, guesses = part[skip:], predicted[skip:]
            scored.extend(zip(rows, guesses))
            for start in range(0, len(rows), BIN):
                out.extend(_bin_residuals(rows[start:start + BIN], guesses[start:start + BIN], self.queue_floor))
        out.extend(_length_class_residuals(scored))
        return out


_MISS = 3.0  # the residual of a figure the replay did not produce (the request did not finish)


def _bin_residuals(rows: Sequence[Observed], guesses: Sequence, floor: float) -> tuple[float, float, float]:
    """One bin of consecutive requests: log(predicted / observed) of their mean prefill time (TTFT less queue) and
    mean TPOT, and half their mean queue's error relative to max(observed, floor). Means over a few neighbours, not
    each request: which of two requests the scheduler takes first turns on the smallest change of a constant, and
    per request that reordering is noise as large as the signal (the fit then stops anywhere within it)."""
    sums = [0.0] * 6
    counts = [0] * 3
    missed = 0
    for row, guess in zip(rows, guesses):
        if guess is None:
            missed += 1
            continue
        for i, (observed, predicted) in enumerate(((_prefill(row.ttft_ms, row.queue_ms), _prefill(guess[0], guess[2])),
                                                   (row.tpot_ms, guess[1]), (row.queue_ms, guess[2]))):
            if observed is not None and predicted is not None:
                sums[2 * i] += observed
                sums[2 * i + 1] += predicted
                counts[i] += 1
    out = []
    for i in range(3):
        observed, predicted = sums[2 * i], sums[2 * i + 1]
        if not counts[i]:
            out.append(0.0)
        elif i == 2:
            out.append(max(-_MISS, min(_MISS, 0.5 * (predicted - observed) / max(observed, floor * counts[i]))))
        elif observed > 0 and predicted > 0:
            out.append(math.log(predicted / observed))
        else:
            out.append(_MISS)
    if missed:
        out = [r + _MISS * missed / len(rows) for r in out]
    return out[0], out[1], out[2]


def _length_class_residuals(scored: Sequence[tuple[Observed, tuple | None]]) -> list[float]:
    """log(predicted / observed) of the mean prefill time of each of up to LENGTH_CLASSES classes of requests by the
    prompt tokens they computed (less the cached ones), over the whole slice. A bin of consecutive requests mixes
    short and long prompts, so its mean prefill time says how long a step takes, not what a prompt token costs:
    compute (MFU) and the step's reads (bandwidth) trade off along a valley. Across the window, the classes hold
    that slope."""
    pairs = sorted(((row.prompt_tokens - row.cached_tokens, _prefill(row.ttft_ms, row.queue_ms),
                     _prefill(guess[0], guess[2])) for row, guess in scored
                    if guess is not None and row.ttft_ms is not None), key=lambda item: item[0])
    out = []
    classes = min(LENGTH_CLASSES, len(pairs) // BIN)
    for k in range(classes):
        members = pairs[k * len(pairs) // classes:(k + 1) * len(pairs) // classes]
        observed = sum(o for _, o, _ in members)
        predicted = sum(p for _, _, p in members)
        out.append(math.log(predicted / observed) if observed > 0 and predicted > 0 else _MISS)
    return out


def _prefill(ttft_ms: float | None, queue_ms: float | None) -> float | None:
    """The engine core's prefill time: its TTFT less its queue (the TTFT itself when the queue is not reported)."""
    if ttft_ms is None:
        return None
    return ttft_ms if queue_ms is None else max(0.0, ttft_ms - queue_ms)


def _sorted_figure(rows: Sequence[Observed], predicted: Sequence, index: int) -> tuple[list[float], list[float]]:
    """(observed, predicted) values of FIGURES[index], each sorted, over the rows where both exist."""
    figure = FIGURES[index]
    pairs = [(getattr(row, figure), p[index]) for row, p in zip(rows, predicted)
             if p is not None and getattr(row, figure) is not None and p[index] is not None]
    return sorted(o for o, _ in pairs), sorted(p for _, p in pairs)


def prediction_error(rows: Sequence[Observed], predicted: Sequence, queue_floor_ms: float) -> dict[str, float]:
    """{"ttft_ms_p50": (predicted - observed) / observed, ...}: each figure's quantiles, predicted against observed,
    over the rows that report the figure (the queue's relative to max(observed, floor)). A figure no row reports
    is left out."""
    out: dict[str, float] = {}
    for index, figure in enumerate(FIGURES):
        obs, pred = _sorted_figure(rows, predicted, index)
        out.update(_quantile_errors(figure, obs, pred, floor=queue_floor_ms if figure == "queue_ms" else 0.0))
    return out


def _quantile_errors(figure: str, obs: Sequence[float], pred: Sequence[float], floor: float = 0.0) -> dict[str, float]:
    """{"<figure>_p50": (predicted - observed) / max(observed, floor), ...} over sorted values; empty without any."""
    out: dict[str, float] = {}
    for q in QUANTILES if obs else ():
        o, p = percentile(obs, q), percentile(pred, q)
        scale = max(o, floor)
        if scale > 0:
            out[f"{figure}_p{q}"] = (p - o) / scale
    return out


def prefill_error(rows: Sequence[Observed], predicted: Sequence) -> dict[str, float]:
    """{"prefill_ms_p50": (predicted - observed) / observed, "prefill_ms_p95": ...}: the quantiles of the engine's
    prefill time (its TTFT less its queue), predicted against observed, over the rows that report a TTFT. Unlike
    TTFT, it leaves out the queue: on traffic the group cannot keep up with, the queue grows by the minute, and a
    few per cent of capacity either way moves it, and the TTFT with it, several-fold."""
    pairs = [(_prefill(row.ttft_ms, row.queue_ms), _prefill(p[0], p[2])) for row, p in zip(rows, predicted)
             if p is not None and row.ttft_ms is not None and p[0] is not None]
    return _quantile_errors("prefill_ms", sorted(o for o, _ in pairs), sorted(p for _, p in pairs))


def curves(rows: Sequence[Observed], predicted: Sequence) -> dict[str, dict[str, list[float]]]:
    """{"ttft_ms": {"q": [5, 10, ...], "observed": [ms, ...], "predicted": [ms, ...]}, ...}: each figure's quantiles
    at CURVE_QUANTILES, observed and predicted, over the rows that report it (the engine page's charts). A figure no
    row reports is left out."""
    out: dict[str, dict[str, list[float]]] = {}
    for index, figure in enumerate(FIGURES):
        obs, pred = _sorted_figure(rows, predicted, index)
        if obs:
            out[figure] = {"q": list(CURVE_QUANTILES),
                           "observed": [round(percentile(obs, q), 3) for q in CURVE_QUANTILES],
                           "predicted": [round(percentile(pred, q), 3) for q in CURVE_QUANTILES]}
    return out


# The costs a drift can move, as the replay tells them apart: requests replayed at their observed arrivals run
# in about the batches they ran in, so a decode step that takes longer than the model's at the same batch sizes
# shows as TPOT above the replay's, and a slower prefill as the engine's TTFT less its queue above the replay's. The
# two figures share steps, so attribute() tells which cost a change of both comes from.
COSTS = {"decode": "decode step time", "prefill": "prefill time"}


def moved_costs(rows: Sequence[Observed], predicted: Sequence) -> dict[str, float]:
    """{"decode": observed / predicted - 1 of the mean TPOT, "prefill": the same of the mean (engine TTFT - queue)}
    over the rows that report them; a cost no row reports is left out."""
    sums = {"decode": [0.0, 0.0], "prefill": [0.0, 0.0]}
    for row, guess in zip(rows, predicted):
        if guess is None:
            continue
        if row.tpot_ms is not None and guess[1] is not None:
            sums["decode"][0] += row.tpot_ms
            sums["decode"][1] += guess[1]
        if row.ttft_ms is not None and row.queue_ms is not None:
            sums["prefill"][0] += _prefill(row.ttft_ms, row.queue_ms)
            sums["prefill"][1] += _prefill(guess[0], guess[2])
    return {cost: round(observed / predicted - 1.0, 4) for cost, (observed, predicted) in sums.items()
            if observed > 0 and predicted > 0}


# The constant that stands for each cost when a replay asks whether that cost alone explains both figures: a decode
# step's per-sequence work (output processing on the host) or its reads (the weights and KV from memory); a prefill's
# compute.
EXPLAINED_BY = {"decode": ("sequence_overhead", "bandwidth_efficiency"), "prefill": ("mfu",)}
ATTRIBUTE_MAX_ROWS = 4000  # the latest requests the attribution replays (three times; once more for a longer window)
_OTHER = {"decode": "prefill", "prefill": "decode"}


def _knob_value(profile: HardwareProfile, name: str, change: float, tpot_ms: float) -> float | None:
    """A first value of ``name`` that moves its cost by about ``change`` (linear: the attribution scales what it does)
    or None when it cannot move that way."""
    value = getattr(profile, name)
    if name == "sequence_overhead":  # additive: a step of n sequences costs n · it more; n of about four
        moved = max(0.0, value + change * tpot_ms * 1e-3 / 4.0)
    elif value <= 0.0:
        return None
    else:  # an efficiency: the cost it bounds takes 1 / it
        low, high = BOUNDS[name]
        moved = min(high, max(low, value / (1.0 + change)))
    return moved if abs(moved - value) > 1e-12 else None


def attribute(config: EngineConfig, profile: HardwareProfile, rows: Sequence[Observed], predicted: Sequence,
              moved: dict[str, float], *, seed: int = 0, at: float = MOVED_AT) -> dict[str, float]:
    """Each cost's own change, where moved_costs gives each figure's. The figures are not independent: a request's
    prefill runs in steps that carry the running sequences' decodes, and a decode step sharing its batch with a
    prefill chunk waits for it; so one cost that moved moves both figures (3 ms more per running sequence read as
    decode +55 %, prefill +56 %). When either moved by ``at`` or more, the replay is rerun with each cost's constant
    (EXPLAINED_BY) changed alone, and its effect scaled to match that cost's own figure; the explanation that leaves
    the other figure least unexplained names the cost that moved, and the other keeps only the change that is left
    (observed / what the explanation predicts - 1). Otherwise, or when no explanation leaves less, ``moved`` as is.
    Rows in time order; ``predicted`` is their replay with ``profile``."""
    if len(moved) < 2 or all(abs(change) < at for change in moved.values()):
        return moved
    rows = list(rows)
    if len(rows) > ATTRIBUTE_MAX_ROWS:
        rows = rows[-ATTRIBUTE_MAX_ROWS:]
        predicted = replay(config, profile, rows, seed=seed)
        moved = moved_costs(rows, predicted)
        if len(moved) < 2 or all(abs(change) < at for change in moved.values()):
            return moved
    ids = [prompt_ids(i, row) for i, row in enumerate(rows)]
    timed = [guess[1] for guess in predicted if guess is not None and guess[1] is not None]
    tpot_ms = sum(timed) / len(timed) if timed else 0.0
    best: tuple[float, str, float] | None = None  # (|what is left of the other|, the cost, what is left)
    for cost in moved:
        other = _OTHER[cost]
        if other not in moved:
            continue
        for name in EXPLAINED_BY[cost]:
            value = _knob_value(profile, name, moved[cost], tpot_ms)
            if value is None:
                continue
            # With the constant changed, the observed figures' change from the new replay: r' = (1 + r) / (1 + e) - 1
            # for the effect e on the prediction, so e = (1 + r) / (1 + r') - 1.
            shifted = moved_costs(rows, replay(config, profile.with_constants(**{name: value}), rows, seed=seed,
                                               ids=ids))
            if cost not in shifted or other not in shifted:
                continue
            own = (1.0 + moved[cost]) / (1.0 + shifted[cost]) - 1.0
            side = (1.0 + moved[other]) / (1.0 + shifted[other]) - 1.0
            # The constant has to move its own cost the way it moved, and enough that scaling it up is fair.
            if own * moved[cost] <= 0 or abs(own) < 0.3 * abs(moved[cost]):
                continue
            scale = moved[cost] / own
            if 1.0 + side * scale <= 0:
                continue
            left = (1.0 + moved[other]) / (1.0 + side * scale) - 1.0
            if best is None or abs(left) < best[0]:
                best = (abs(left), cost, left)
    if best is None or best[0] >= abs(moved[_OTHER[best[1]]]):
        return moved
    _, cost, left = best
    return {cost: moved[cost], _OTHER[cost]: round(left, 4)}


def diagnosis(moved: dict[str, float], *, at: float = MOVED_AT) -> str:
    """What moved, as a sentence: "decode step time +35 % at the same batch sizes" (the costs off by `at` or more,
    the largest first), or that none did."""
    named = sorted(((abs(v), cost, v) for cost, v in moved.items() if abs(v) >= at), reverse=True)
    if not named:
        return f"no cost moved by {at:.0%} or more from the model's at the same batch sizes"
    parts = [f"{COSTS[cost]} {v * 100:+.0f} %" for _, cost, v in named]
    return ", ".join(parts) + " at the same batch sizes"


@dataclasses.dataclass
class Comparison:
    """A model against traffic it did not fit: its relative errors (prediction_error's; prefill_error's apart), the
    quantile curves, the costs that moved."""

    error: dict[str, float]
    curves: dict[str, dict[str, list[float]]]
    moved: dict[str, float]
    requests: int
    prefill: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def diagnosis(self) -> str:
        return diagnosis(self.moved)


def compare(config: EngineConfig, profile: HardwareProfile, rows: Sequence[Observed], *, queue_floor_ms: float,
            seed: int = 0) -> Comparison:
    """Replay ``rows`` (the latest traffic) with the model's profile and compare: errors, curves, moved costs."""
    ordered = sorted(rows, key=lambda r: r.arrival)
    predicted = replay(config, profile, ordered, seed=seed)
    moved = attribute(config, profile, ordered, predicted, moved_costs(ordered, predicted), seed=seed)
    return Comparison(error=prediction_error(ordered, predicted, queue_floor_ms), curves=curves(ordered, predicted),
                      moved=moved, requests=len(ordered),
                      prefill=prefill_error(ordered, predicted))


def split(rows: Sequence[Observed]) -> tuple[list[Observed], list[Observed]]:
    """(fitting slice, held-out slice): the window's first four fifths by time, and its last fifth."""
    ordered = sorted(rows, key=lambda r: r.arrival)
    cut = ordered[0].arrival + (ordered[-1].arrival - ordered[0].arrival) * (1 - HELD_OUT_SHARE) if ordered else 0
    return [r for r in ordered if r.arrival < cut], [r for r in ordered if r.arrival >= cut]


def check(rows: Sequence[Observed], min_requests: int = MIN_REQUESTS) -> None:
    """Raise FitError naming what is missing: requests, engine timings."""
    timed = [r for r in rows if r.ttft_ms is not None and r.tpot_ms is not None]
    if len(rows) < min_requests:
        raise FitError(f"too little traffic: {len(rows)} engine-served requests in the window, at least "
                       f"{min_requests} needed")
    if len(timed) < min_requests:
        raise FitError(f"only {len(timed)} of {len(rows)} requests carry the engine's timings (queue, TTFT and "
                       f"TPOT from an engine span; rows from client or gateway spans alone cannot be replayed): at "
                       f"least {min_requests} needed")


def fit(config: EngineConfig, rows: Sequence[Observed], *, base: HardwareProfile | None = None,
        names: Sequence[str] | None = None, seed: int = 0, global_points: int = 16, local_starts: int = LOCAL_STARTS,
        max_evaluations: int = 100,
        budget: int = SAMPLE_REQUESTS, min_requests: int = MIN_REQUESTS,
        progress: Callable[[str], None] | None = None) -> Fit:
    """Fit ``base`` (the config's GPU profile when None) to ``rows``; raises FitError when they cannot be fitted."""
    from scipy.optimize import minimize
    from scipy.stats import qmc

    started = time.monotonic()
    base = base or hardware_profile(config.gpu_type)
    check(rows, min_requests)  # the window's count, as calibration.check_traffic refuses a window before it is queued
    fitting, held_out = split(rows)
    if not held_out:
        raise FitError("the window has no held-out slice (its last fifth holds no request)")
    names = list(names or fitted_names(base))
    ttfts = sorted(r.ttft_ms for r in fitting if r.ttft_ms is not None)
    # A queue below a tenth of the median TTFT is "no queue" for the fit: its error counts relative to that.
    queue_floor = max(1.0, 0.1 * percentile(ttfts, 50))
    problem = _Problem(config, base, names, fitting, budget, queue_floor, seed)

    def cost(x) -> float:
        return float(sum(_soft_l1(r) for r in problem.residuals(x)))

    # Global pass: Sobol points over ±log(span) around the start (the start itself included), clipped to BOUNDS.
    span = CPU_SPAN if base.api_server_serial else SPAN
    low = [max(-math.log(span), math.log(BOUNDS[n][0] / getattr(base, n))) for n in names]
    high = [min(math.log(span), math.log(BOUNDS[n][1] / getattr(base, n))) for n in names]
    sobol = qmc.Sobol(len(names), scramble=True, seed=seed)
    sample = qmc.scale(sobol.random_base2(max(1, math.ceil(math.log2(global_points)))), low, high)
    candidates = [[0.0] * len(names)] + [list(p) for p in sample]
    scored = sorted(((cost(x), x) for x in candidates), key=lambda item: item[0])
    if progress:
        progress(f"global pass: {len(candidates)} points, best cost {scored[0][0]:.4g}")
    # Local pass: Nelder-Mead from the best points (a gradient method stalls on the replay's small steps: a
    # scheduling order that flips makes the objective piecewise flat at the finest scale).
    best_x, best_cost = scored[0][1], scored[0][0]
    for start_cost, x0 in scored[:local_starts]:
        simplex = [list(x0)] + [[v + (0.2 if i == j else 0.0) for i, v in enumerate(x0)] for j in range(len(x0))]
        result = minimize(cost, x0, method="Nelder-Mead", bounds=list(zip(low, high)),
                          options={"initial_simplex": simplex, "maxfev": max_evaluations, "xatol": XATOL,
                                   "fatol": FATOL})
        if progress:
            progress(f"local pass from cost {start_cost:.4g}: {result.nfev} evaluations, cost {result.fun:.4g}")
        if result.fun < best_cost:
            best_x, best_cost = list(result.x), float(result.fun)
    profile = problem.profile(best_x)
    constants = {name: getattr(profile, name) for name in names}
    # One replay of the whole window scores both slices: the held-out slice finds the queue the window left it.
    predicted = replay(config, profile, fitting + held_out, seed=seed)
    return Fit(base_profile=base.name, constants=constants,
               start_constants={name: getattr(base, name) for name in names},
               fit_error=prediction_error(fitting, predicted[:len(fitting)], queue_floor),
               held_out_error=prediction_error(held_out, predicted[len(fitting):], queue_floor),
               fit_requests=len(fitting), held_out_requests=len(held_out), evaluations=problem.evaluations,
               seconds=time.monotonic() - started, cost=best_cost, queue_floor_ms=queue_floor,
               held_out_curves=curves(held_out, predicted[len(fitting):]))


def _soft_l1(r: float) -> float:
    return 2.0 * (math.sqrt(1.0 + r * r) - 1.0)


def predict(config: EngineConfig, profile: HardwareProfile, rows: Sequence[Observed], *, queue_floor_ms: float,
            seed: int = 0) -> dict[str, float]:
    """A model's prediction error on ``rows`` (the latest traffic): ``prediction_error`` of its replay."""
    return compare(config, profile, rows, queue_floor_ms=queue_floor_ms, seed=seed).error
