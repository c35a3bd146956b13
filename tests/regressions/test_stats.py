"""The statistics of regression runs against hand-computed cases and SciPy's reference implementations."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from regressions import stats
from scipy import stats as sps

pytestmark = pytest.mark.mode_independent  # no database, no broker: CI runs it once (tests/conftest.py)


def test_hodges_lehmann_paired_is_the_median_of_walsh_averages():
    # d = y − x = [1, 2, 3]; Walsh averages (i ≤ j): 1, 1.5, 2, 2, 2.5, 3 → median 2.
    assert stats.hodges_lehmann([0, 0, 0], [1, 2, 3], paired=True) == 2.0
    # d = [−1, 0, 4]: averages −1, −0.5, 1.5, 0, 2, 4 → median (0 + 1.5)/2 = 0.75.
    assert stats.hodges_lehmann([1, 1, 1], [0, 1, 5], paired=True) == 0.75


def test_hodges_lehmann_two_samples_is_the_median_of_all_differences():
    # y − x over all pairs: 3−1, 3−2, 5−1, 5−2 = 2, 1, 4, 3 → median 2.5.
    assert stats.hodges_lehmann([1, 2], [3, 5], paired=False) == 2.5
    rng = np.random.default_rng(3)
    x, y = rng.normal(0, 1, 40), rng.normal(0.7, 1, 50)
    brute = np.median([b - a for a, b in itertools.product(x, y)])
    assert stats.hodges_lehmann(x, y, paired=False) == pytest.approx(brute)


def test_hodges_lehmann_of_large_samples_is_estimated_from_drawn_pairs():
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, 3000)
    y = x + 0.5 + rng.normal(0, 0.1, 3000)  # 4.5 M Walsh averages: over EXACT_PAIRS
    assert stats.hodges_lehmann(x, y, paired=True) == pytest.approx(0.5, abs=0.01)


def test_wilcoxon_exact_small_sample_by_hand():
    # Five positive differences: the signed-rank statistic takes its extreme, p = 2 / 2^5 (two-sided, exact).
    name, p = stats.rank_test([0, 0, 0, 0, 0], [1, 2, 3, 4, 5], paired=True)
    assert name == "wilcoxon" and p == pytest.approx(2 / 32)


def test_mann_whitney_exact_small_sample_by_hand():
    # Complete separation of 3 vs 3: U = 9, p = 2 / C(6, 3) = 0.1 (two-sided, exact).
    name, p = stats.rank_test([1, 2, 3], [4, 5, 6], paired=False)
    assert name == "mann-whitney" and p == pytest.approx(0.1)


def test_rank_tests_match_scipy_and_handle_ties_and_no_change():
    rng = np.random.default_rng(5)
    x = rng.lognormal(3, 0.5, 120)
    y = x * rng.normal(1.05, 0.1, 120)
    assert stats.rank_test(x, y, paired=True)[1] == pytest.approx(sps.wilcoxon(y, x).pvalue)
    assert stats.rank_test(x, y, paired=False)[1] == pytest.approx(
        sps.mannwhitneyu(y, x, alternative="two-sided").pvalue)
    assert stats.rank_test([1, 2, 3], [1, 2, 3], paired=True) == ("wilcoxon", 1.0)
    assert stats.rank_test([], [], paired=True) == ("wilcoxon", None)


def test_mcnemar_exact_by_hand():
    # 10 pairs passed before and failed after, 2 the reverse: p = 2·P(X ≤ 2 | n = 12, ½) = 2·79/4096.
    assert stats.mcnemar(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert stats.mcnemar(2, 10) == stats.mcnemar(10, 2)
    assert stats.mcnemar(0, 0) == 1.0
    assert stats.fisher(10, 10, 0, 10) == pytest.approx(sps.fisher_exact([[10, 0], [0, 10]]).pvalue)


def test_bootstrap_interval_of_a_constant_shift_is_that_shift():
    x = np.arange(100.0)
    interval = stats.bootstrap_interval(x, x + 10, stats.shift_statistic("p95"), paired=True, confidence=0.9)
    assert interval.low == pytest.approx(10) and interval.high == pytest.approx(10)


def test_bootstrap_interval_covers_the_true_shift_at_its_level():
    rng = np.random.default_rng(6)
    covered = 0
    trials = 120
    for trial in range(trials):
        x = rng.normal(100, 10, 80)
        y = x + 3 + rng.normal(0, 5, 80)
        interval = stats.bootstrap_interval(x, y, stats.shift_statistic("mean"), paired=True, confidence=0.9,
                                            n_resamples=1000, seed=trial)
        covered += interval.low <= 3 <= interval.high
    assert 0.82 <= covered / trials <= 0.97


def test_hodges_lehmann_interval_brackets_the_estimate():
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, 200)
    y = x + 1 + rng.normal(0, 0.5, 200)
    interval = stats.hodges_lehmann_interval(x, y, paired=True, confidence=0.95)
    estimate = stats.hodges_lehmann(x, y, paired=True)
    assert interval.low < estimate < interval.high
    assert interval.low < 1 < interval.high


def test_power_and_sample_size_by_hand():
    z = sps.norm.ppf(0.95) + sps.norm.ppf(0.8)  # 1.645 + 0.842 = 2.486
    assert stats.power(z * 2.0, 2.0, alpha=0.05) == pytest.approx(0.8)
    assert stats.power(sps.norm.ppf(0.95), 1.0, alpha=0.05) == pytest.approx(0.5)
    assert stats.required_sample(100, z, 1.0, alpha=0.05, target=0.8) == 100
    # Half the effect needs four times the items (the standard error falls as 1/√n).
    assert stats.required_sample(100, z / 2, 1.0, alpha=0.05, target=0.8) == 400
    assert stats.detectable_shift(1.0, alpha=0.05, target=0.8) == pytest.approx(z)


def test_power_estimate_agrees_with_simulated_detection():
    """The normal approximation's power against the observed rate of detections (lower bound above 0)."""
    rng = np.random.default_rng(8)
    n, sigma, shift = 60, 10.0, 2.6  # se of the mean difference ≈ 10/√60 = 1.29: predicted power ≈ 0.52
    predicted = stats.power(shift, sigma / math.sqrt(n), alpha=0.05)
    detected = 0
    trials = 150
    for trial in range(trials):
        x = rng.normal(0, 1, n)
        y = x + shift + rng.normal(0, sigma, n)
        interval = stats.bootstrap_interval(x, y, stats.shift_statistic("mean"), paired=True, confidence=0.9,
                                            n_resamples=600, seed=trial)
        detected += interval.low > 0
    assert abs(detected / trials - predicted) < 0.13, (detected / trials, predicted)
