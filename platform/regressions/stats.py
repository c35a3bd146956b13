"""The statistics of a regression comparison: rank tests, the Hodges–Lehmann shift, bootstrap intervals,
McNemar's test and the power of a gate.

Conventions: `x` is the baseline sample, `y` the candidate's; a shift is candidate − baseline (positive = the
candidate is slower / larger). Paired samples are aligned (x[i] and y[i] are the same item and repetition).

- Rank tests: Wilcoxon signed-rank on paired differences, Mann–Whitney U on independent samples (SciPy's, two
  sided; the p-value of a sample whose differences are all zero is 1).
- Hodges–Lehmann: paired, the median of the Walsh averages (d_i + d_j)/2, i ≤ j, of the differences; two
  samples, the median of all differences y_j − x_i. Exact up to `EXACT_PAIRS` pairs, else the median of that
  many pairs drawn at random (seeded), whose error is far below the bootstrap interval's width.
- Bootstrap intervals: percentile intervals from SciPy's `bootstrap` (resampling items jointly when paired).
  A gate's one-sided bound at confidence c is an end of the two-sided interval at 1 − 2(1 − c).
- Power: the normal approximation with the bootstrap standard error: the probability that a one-sided test at
  level α detects a true shift δ is Φ(δ/se − z₁₋α); the sample size for power π scales n by
  ((z₁₋α + z_π)·se/δ)², since the standard error of a quantile or a median falls as 1/√n.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np


class _LazyScipyStats:
    """scipy.stats, imported on first use: it costs ~0.7 s, and this module is imported by every process that
    loads the URLs (each `manage.py` command's system checks), most of which never compare anything."""

    def __getattr__(self, name):
        from scipy import stats

        return getattr(stats, name)


sps = _LazyScipyStats()

EXACT_PAIRS = 2_000_000
SAMPLED_PAIRS = 2_000  # per bootstrap resample of a Hodges–Lehmann estimate


def as_array(values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=float)


def quantile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (linear interpolation, as numpy and the load generator), None for no values."""
    arr = as_array(values)
    return float(np.quantile(arr, q)) if arr.size else None


def _walsh_median(d: np.ndarray, rng: np.random.Generator) -> float:
    n = d.size
    if n * (n + 1) // 2 <= EXACT_PAIRS:
        i, j = np.triu_indices(n)
        return float(np.median((d[i] + d[j]) / 2.0))
    i = rng.integers(0, n, EXACT_PAIRS)
    j = rng.integers(0, n, EXACT_PAIRS)
    return float(np.median((d[i] + d[j]) / 2.0))


def hodges_lehmann(x: Sequence[float], y: Sequence[float], *, paired: bool, seed: int = 0) -> float | None:
    """The Hodges–Lehmann estimate of the shift y − x (None when a sample is empty)."""
    x, y = as_array(x), as_array(y)
    if not x.size or not y.size:
        return None
    rng = np.random.default_rng(seed)
    if paired:
        return _walsh_median(y - x, rng)
    if x.size * y.size <= EXACT_PAIRS:
        return float(np.median(np.subtract.outer(y, x)))
    i = rng.integers(0, x.size, EXACT_PAIRS)
    j = rng.integers(0, y.size, EXACT_PAIRS)
    return float(np.median(y[j] - x[i]))


def _hl_statistic(paired: bool, seed: int) -> Callable:
    """A vectorised Hodges–Lehmann statistic for `scipy.stats.bootstrap` (median of sampled pairs)."""
    rng = np.random.default_rng(seed + 7919)

    if paired:
        def statistic(x, y, axis=-1):
            d = np.moveaxis(y - x, axis, -1)
            n = d.shape[-1]
            i = rng.integers(0, n, SAMPLED_PAIRS)
            j = rng.integers(0, n, SAMPLED_PAIRS)
            return np.median((d[..., i] + d[..., j]) / 2.0, axis=-1)
    else:
        def statistic(x, y, axis=-1):
            x = np.moveaxis(x, axis, -1)
            y = np.moveaxis(y, axis, -1)
            i = rng.integers(0, x.shape[-1], SAMPLED_PAIRS)
            j = rng.integers(0, y.shape[-1], SAMPLED_PAIRS)
            return np.median(y[..., j] - x[..., i], axis=-1)
    return statistic


def statistic_of(name: str) -> Callable[[np.ndarray, int], np.ndarray]:
    """A gate statistic by name (p50, p90, p95, p99, mean), vectorised along `axis`."""
    if name == "mean":
        return lambda values, axis=-1: np.mean(values, axis=axis)
    q = float(name[1:]) / 100.0
    return lambda values, axis=-1: np.quantile(values, q, axis=axis)


@dataclasses.dataclass(frozen=True)
class Interval:
    low: float
    high: float
    standard_error: float

    def as_list(self) -> list[float]:
        return [self.low, self.high]


def bootstrap_interval(x: Sequence[float], y: Sequence[float], statistic: Callable, *, paired: bool,
                       confidence: float, n_resamples: int = 2000, seed: int = 0) -> Interval | None:
    """Percentile bootstrap interval (two-sided, at `confidence`) of statistic(x, y); None below 2 values."""
    x, y = as_array(x), as_array(y)
    if x.size < 2 or y.size < 2:
        return None
    if np.ptp(x) == 0 and np.ptp(y) == 0 and not paired:
        value = float(statistic(x, y))
        return Interval(value, value, 0.0)
    result = sps.bootstrap((x, y), statistic, paired=paired, vectorized=True, confidence_level=confidence,
                           n_resamples=n_resamples, method="percentile", rng=np.random.default_rng(seed))
    low, high = result.confidence_interval
    se = float(result.standard_error)
    if not math.isfinite(low) or not math.isfinite(high):  # a degenerate resample distribution (all equal)
        value = float(statistic(x, y))
        return Interval(value, value, 0.0 if not math.isfinite(se) else se)
    return Interval(float(low), float(high), se)


def shift_statistic(name: str) -> Callable:
    """statistic(candidate) − statistic(baseline), for the bootstrap."""
    of = statistic_of(name)
    return lambda x, y, axis=-1: of(y, axis) - of(x, axis)


def hodges_lehmann_interval(x: Sequence[float], y: Sequence[float], *, paired: bool, confidence: float,
                            n_resamples: int = 400, seed: int = 0) -> Interval | None:
    return bootstrap_interval(x, y, _hl_statistic(paired, seed), paired=paired, confidence=confidence,
                              n_resamples=n_resamples, seed=seed)


def rank_test(x: Sequence[float], y: Sequence[float], *, paired: bool) -> tuple[str, float | None]:
    """(test name, two-sided p-value): Wilcoxon signed-rank when paired, else Mann–Whitney U."""
    x, y = as_array(x), as_array(y)
    if paired:
        d = y - x
        if d.size == 0:
            return "wilcoxon", None
        if not np.any(d != 0):
            return "wilcoxon", 1.0
        return "wilcoxon", float(sps.wilcoxon(y, x).pvalue)
    if x.size == 0 or y.size == 0:
        return "mann-whitney", None
    return "mann-whitney", float(sps.mannwhitneyu(y, x, alternative="two-sided").pvalue)


def mcnemar(b: int, c: int) -> float:
    """Exact (binomial) McNemar test on the discordant pairs: b = passed before and failed after, c = the
    reverse. Two-sided p-value; 1 when no pair changed."""
    if b + c == 0:
        return 1.0
    return float(sps.binomtest(min(b, c), b + c, 0.5).pvalue)


def fisher(pass_x: int, n_x: int, pass_y: int, n_y: int) -> float:
    """Fisher's exact test (two-sided) on pass counts of two independent samples."""
    if n_x == 0 or n_y == 0:
        return 1.0
    return float(sps.fisher_exact([[pass_x, n_x - pass_x], [pass_y, n_y - pass_y]]).pvalue)


def z_of(p: float) -> float:
    return float(sps.norm.ppf(p))


def power(effect: float, standard_error: float, *, alpha: float) -> float:
    """Power of a one-sided test at level alpha to detect a true shift `effect` (normal approximation)."""
    if effect <= 0:
        return alpha
    if standard_error <= 0:
        return 1.0
    return float(sps.norm.cdf(effect / standard_error - z_of(1.0 - alpha)))


def required_sample(n: int, effect: float, standard_error: float, *, alpha: float, target: float) -> int | None:
    """Items needed for `target` power against `effect`, given the standard error seen with n items."""
    if effect <= 0 or n <= 0:
        return None
    if standard_error <= 0:
        return n
    factor = (z_of(1.0 - alpha) + z_of(target)) * standard_error / effect
    return max(2, math.ceil(n * factor * factor))


def detectable_shift(standard_error: float, *, alpha: float, target: float) -> float:
    """The smallest true shift detected with `target` power at one-sided level alpha."""
    return (z_of(1.0 - alpha) + z_of(target)) * standard_error
