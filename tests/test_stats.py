"""experiments/stats.py: the experiments' statistics by hand, against scipy and the textbook tables (no model, no run).

OMP_NUM_THREADS=1 python -m pytest -q tests/test_stats.py
"""

import numpy as np
import pytest

from experiments import stats


def test_statistics_by_hand():
    x, y = np.array([0.0, 10.0, 20.0]), np.array([0.1, 0.3, 0.5])
    assert stats.first_crossing(x, y, 0.4) == pytest.approx(15.0)
    assert stats.first_crossing(x, y, 0.05) == 0.0 and np.isnan(stats.first_crossing(x, y, 0.6))
    m, lo, hi, n = stats.mean_ci([1.0, 2.0, 3.0])  # sd 1, t(0.975, 2) = 4.3027
    assert (
        (m, n) == (2.0, 3)
        and hi - m == pytest.approx(4.302653 / np.sqrt(3), rel=1e-5)
        and lo == pytest.approx(2 * m - hi)
    )
    assert np.isnan(stats.mean_ci([1.0])[1])


def test_seeds_for_power_matches_the_textbook_paired_t():
    """Two-sided paired (one-sample) t at alpha 0.05, power 0.8: Cohen's d = 0.5 needs 34, d = 0.8 needs 15 (G*Power's
    and Cohen's tables); the N found has power >= 0.8 and N - 1 has less; a stricter level (Holm's first step over 4
    tests) needs more."""
    from scipy import stats as scipy_stats

    assert stats.seeds_for_power(0.5, 1.0) == 34 and stats.seeds_for_power(0.8, 1.0) == 15
    assert stats.seeds_for_power(1.6, 2.0) == 15  # only the ratio effect / sd matters

    def power(n, d=0.5, alpha=0.05):
        crit = scipy_stats.t.ppf(1 - alpha / 2, n - 1)
        return scipy_stats.nct.sf(crit, n - 1, d * np.sqrt(n)) + scipy_stats.nct.cdf(-crit, n - 1, d * np.sqrt(n))

    assert power(34) >= 0.8 > power(33)
    assert stats.seeds_for_power(0.5, 1.0, alpha=0.05 / 4) > 34 and stats.seeds_for_power(0.0, 1.0) is None
    assert stats.effect_of_interest(-0.1, floor=0.2) == 0.4 and stats.effect_of_interest(-0.1) == 0.1


def test_seeds_for_power_at_a_large_effect_is_not_moved_by_a_nan_far_tail():
    """A large effect over a small sd (d ~ 13, level 0.05 / 20: recast-protocol's uniform-budget cell): 3 seeds have
    power ~0.74 (upper tail alone), 4 have ~1. scipy's nct.cdf of the far tail returns NaN there on some CPUs; read
    as NaN the power test failed at N = 4 and N80 became 7 on one machine and 4 on another."""
    from scipy import stats as scipy_stats

    effect, sd, alpha = 0.0143729, 0.0010772, 0.05 / 20
    crit = scipy_stats.t.ppf(1 - alpha / 2, 3)
    assert scipy_stats.nct.sf(crit, 3, effect * np.sqrt(4) / sd) > 0.99
    assert stats.seeds_for_power(effect, sd, alpha=alpha) == 4
    assert stats.seeds_for_power(-effect, sd, alpha=alpha) == 4


def test_p_values_and_holm_by_hand():
    """p from the interval equals scipy's paired t test; Holm's adjusted p-values by hand: sorted 0.005, 0.01, 0.03,
    0.04 -> 4 x 0.005, 3 x 0.01, 2 x 0.03, max(0.06, 1 x 0.04); NaN stays out of the family."""
    from scipy import stats as scipy_stats

    v = [0.3, 1.1, 0.8, 1.9]
    assert stats.p_value(*stats.mean_ci(v)) == pytest.approx(scipy_stats.ttest_1samp(v, 0.0).pvalue, rel=1e-9)
    adjusted = stats.holm([0.01, 0.04, np.nan, 0.03, 0.005])
    assert np.allclose(adjusted[[0, 1, 3, 4]], [0.03, 0.06, 0.06, 0.02]) and np.isnan(adjusted[2])
    assert stats.holm([0.5, 0.9]).tolist() == [1.0, 1.0]


def test_fmt_ci_prints_p_holm_and_N80_only_for_unresolved_differences():
    """mean 1, sd 1 over 3 seeds (unresolved): N80 at the observed difference is seeds_for_power(1, 1) = 10, and
    [5, 312] over the sd's 95% interval; with a noise floor of 1 the effect is 2 (N80 5); a resolved difference prints
    none, one resolved only before Holm does; the exact sign-flip p and its Holm follow the t test's."""
    m, lo, hi, n = stats.mean_ci([0.0, 1.0, 2.0])
    assert stats.fmt_ci(m, lo, hi, n).endswith(" sd 1.0000 p 0.23 N80 10 [5, 312]")
    assert " N80 5 [" in stats.fmt_ci(m, lo, hi, n, floor=1.0)
    assert f" N80 {stats.seeds_for_power(1.0, 1.0, alpha=0.01)} [" in stats.fmt_ci(m, lo, hi, n, family=5)
    assert "N80" not in stats.fmt_ci(m, lo, hi, n, power=False)
    clear = stats.mean_ci([1.0, 1.1, 0.9])
    assert "N80" not in stats.fmt_ci(*clear) and " Holm 0.06, exact p 0.25 Holm 1 N80 " in stats.fmt_ci(
        *clear, p_holm=0.06, exact=0.25, exact_holm=1.0
    )


def test_the_sign_flip_test_by_hand_against_scipy_and_at_zero_variance():
    """Exact sign-flip p: [1, 2, -0.5, 3] has sum 5.5; of the 16 sign patterns of (1, 2, 0.5, 3), |sum| >= 5.5 for
    +all (6.5), the observed one (5.5) and their negatives: 4 / 16 = 0.25, scipy's permutation_test's answer. The
    audit's counter-example: n equal differences (zero variance), where the t test's p was 0 (or 6e-33, round-off),
    get 2 / 2^n (8 seeds: 0.0078; 3 seeds: 0.25, so no family of tests can be resolved at 3 seeds without the normal
    model), and p_value gives the same there, the t test having no answer; all zero: 1."""
    from scipy import stats as scipy_stats

    x = [1.0, 2.0, -0.5, 3.0]
    assert stats.sign_flip_p(x) == 0.25
    exact = scipy_stats.permutation_test(
        (np.array(x),), np.mean, permutation_type="samples", alternative="two-sided", n_resamples=np.inf
    )
    assert stats.sign_flip_p(x) == pytest.approx(exact.pvalue)
    assert stats.sign_flip_p([1.0, 2.0, 3.0], alternative="greater") == 1 / 8
    assert stats.sign_flip_p([1.0, 2.0, 3.0], alternative="less") == 1.0
    for n in (3, 5, 8):
        same = [0.0078] * n
        assert stats.p_value(*stats.mean_ci(same)) == stats.sign_flip_p(same) == 2 / 2**n  # t's: 0 or 6e-33
    assert stats.sign_flip_p([0.0, 0.0, 0.0]) == 1.0 and np.isnan(stats.sign_flip_p([]))
    d = np.random.default_rng(3).normal(0.3, 1.0, 12)  # all 4,096 patterns, against scipy's enumeration of them
    exact = scipy_stats.permutation_test(
        (d,), np.mean, permutation_type="samples", alternative="two-sided", n_resamples=np.inf
    )
    assert stats.sign_flip_p(d) == pytest.approx(exact.pvalue, rel=1e-12)
    many = np.random.default_rng(1).normal(0.4, 1.0, 30)  # past EXACT_UP_TO: fixed Monte Carlo draws, near the t's p
    assert stats.sign_flip_p(many) == stats.sign_flip_p(many)
    assert stats.sign_flip_p(many) == pytest.approx(stats.p_value(*stats.mean_ci(many)), abs=0.02)
    # Monte Carlo never says 0 (issue 62): the observed pattern counts among the draws, p = (k + 1) / (draws + 1)
    assert stats.sign_flip_p([1.0] * 30, draws=1000) == 1 / 1001
    assert stats.sign_flip_p([1.0] * 30, alternative="greater", draws=1000) == 1 / 1001


def test_N80_comes_with_the_range_its_estimated_sd_allows():
    """From n = 3 seeds the sd has 2 dof, whose chi-square quantiles are closed-form: chi2(0.025; 2) = -2 ln 0.975,
    chi2(0.975; 2) = -2 ln 0.025, so the sd's 95% interval is sd x [sqrt(2 / 7.378), sqrt(2 / 0.0506)] = [0.52, 6.28]
    sd and N80's range is seeds_for_power at those two sds: ~0.5x to ~30x the point value here."""
    lo_sd, hi_sd = np.sqrt(2 / (-2 * np.log(0.025))), np.sqrt(2 / (-2 * np.log(0.975)))
    assert (lo_sd, hi_sd) == pytest.approx((0.5207, 6.2847), abs=1e-4)
    rng = stats.seeds_for_power_range(1.0, 1.0, 3)
    assert rng == (stats.seeds_for_power(1.0, lo_sd), stats.seeds_for_power(1.0, hi_sd)) == (5, 312)
    assert stats.seeds_for_power_range(1.0, 1.0, 1) == (None, None)
    narrow = stats.seeds_for_power_range(1.0, 1.0, 64)  # many seeds: the range closes in on the point value
    assert narrow[0] <= stats.seeds_for_power(1.0, 1.0) <= narrow[1] and narrow[1] - narrow[0] < 10


def test_the_non_inferiority_margin_is_a_fraction_of_the_baselines_resolved_gain():
    """NFT's gain over the pretrained model 0.10 [0.06, 0.14]: margin 0.5 x 0.06 = 0.03; a gain whose interval holds
    0 gives no margin (NaN): "matches" cannot be tested where the baseline did not surely gain. A method 0.01 below
    the baseline with sd 0.01 over 8 seeds is non-inferior at that margin (one-sided t), one 0.05 below is not."""
    assert stats.gain_margin((0.10, 0.06, 0.14, 4)) == pytest.approx(0.03)
    assert np.isnan(stats.gain_margin((0.10, -0.01, 0.21, 4))) and np.isnan(stats.gain_margin((0.1, np.nan, np.nan, 1)))
    near = stats.mean_ci(-0.01 + 0.01 * np.array([-1, 1, -1, 1, -1, 1, -1, 1.0]))
    far = stats.mean_ci(-0.05 + 0.01 * np.array([-1, 1, -1, 1, -1, 1, -1, 1.0]))
    assert stats.non_inferiority(near, 0.03) < 0.001 and stats.non_inferiority(far, 0.03) > 0.99


def test_the_difference_at_equal_distance_is_a_regression_intercept_per_cell():
    """One cell: the intercept, its standard error and the slope are scipy's linregress's (a known answer). Two
    cells share the slope: adding 1 to one cell's differences moves its intercept by exactly 1 and nothing else.
    Points on a line: intercept and slope exact, p 0."""
    from scipy import stats as scipy_stats

    x = np.array([0.1, 0.5, 0.9, 1.3, 0.4, 0.8])
    y = np.array([0.012, 0.018, 0.015, 0.027, 0.011, 0.022])
    (a,), b = stats.adjusted_difference(y, x, ["A"] * 6)[0].values(), stats.adjusted_difference(y, x, ["A"] * 6)[1]
    fit = scipy_stats.linregress(x, y)
    half = scipy_stats.t.ppf(0.975, 4) * fit.intercept_stderr
    assert a[:3] == pytest.approx((fit.intercept, fit.intercept - half, fit.intercept + half))
    assert a[4:] == (0.1, 1.3) and b[0] == pytest.approx(fit.slope) and b[3] == pytest.approx(fit.pvalue)
    cells = ["A", "A", "A", "B", "B", "B"]
    one, slope = stats.adjusted_difference(y, x, cells)
    two, slope2 = stats.adjusted_difference(y + np.array([0, 0, 0, 1.0, 1, 1]), x, cells)
    assert two["B"][0] == pytest.approx(one["B"][0] + 1) and two["A"][0] == pytest.approx(one["A"][0])
    assert slope2[0] == pytest.approx(slope[0])
    line, b = stats.adjusted_difference(0.5 + 2 * x, x, cells)
    assert line["A"][0] == pytest.approx(0.5) and b[0] == pytest.approx(2.0) and b[3] < 1e-10
    assert np.isnan(stats.adjusted_difference([1.0, 2.0], [0.0, 1.0], ["A", "A"])[1][0])  # no dof left


def test_the_preference_share_is_a_mean_sigmoid_and_its_interval_stays_inside_0_1():
    """Per seed: mean over images of sigmoid(s_a - s_b) (0.5 and sigmoid(-log 3) = 0.25 -> 0.375); across seeds a t
    interval on the logits, mapped back: inside (0, 1) where the plain interval of the shares leaves [0, 1]."""
    from scipy.special import expit

    assert stats.pref_share([0.0, 0.0], [0.0, np.log(3)]) == pytest.approx(0.375)
    shares = [0.05, 0.95, 0.5]
    assert stats.mean_ci(shares)[1] < 0 and stats.mean_ci(shares)[2] > 1
    m, lo, hi, n = stats.share_logits(shares)
    assert 0 < expit(lo) < expit(m) < expit(hi) < 1 and n == 3
    text = stats.fmt_share(m, lo, hi, n)
    low, high = (float(x) for x in text.split("[")[1].split("]")[0].split(", "))
    assert 0 < low < 0.5 < high < 1 and "N80" in text
    assert (
        stats.fmt_share(*stats.share_logits([0.30, 0.32, 0.31])).split(" p ")[0] == "0.310 [0.286, 0.335]"
    )  # logits -0.847, -0.754, -0.800


def test_times_to_a_level_count_runs_that_never_reach_it_as_censored():
    """Kaplan-Meier: times 1, 2 (censored), 2.5 (censored), 10: survival 0.75 after 1, 0 at 10, so the median is 10,
    where dropping the censored runs would give a median of 1-5.5. A method that reaches the level in 1 of 4 seeds
    (at 5) while the baseline reaches it in all (at 10) has no median: speed-up 0, not the 2x of its one run."""
    assert stats.km_median([1, 2, 2.5, 10], [True, False, False, True]) == 10
    assert stats.km_median([1, 2, 3], [True, True, True]) == 2 and stats.km_median([4, 5], [False, False]) == np.inf
    x, y = np.array([0.0, 10.0, 20.0]), np.array([0.1, 0.3, 0.5])
    assert stats.time_to_reach(x, y, 0.4) == (15.0, True) and stats.time_to_reach(x, y, 0.9) == (20.0, False)
    base = {s: (10.0, True) for s in range(4)}
    other = {0: (5.0, True), 1: (20.0, False), 2: (20.0, False), 3: (20.0, False)}
    r, lo, hi, n = stats.censored_speedup(base, other)
    assert r == 0 and n == 4 and 0 <= lo <= hi
    assert stats.fmt_speedup((r, lo, hi, n)).startswith("KM 0.00x [")
    faster = {s: (5.0, True) for s in range(4)}
    assert stats.censored_speedup(base, faster) == (2.0, 2.0, 2.0, 4)
    assert stats.censored_speedup(faster, other)[0] == 0 and stats.censored_speedup(other, base)[0] == np.inf
    assert stats.censored_speedup(base, faster) == stats.censored_speedup(base, faster)  # a fixed generator


def test_the_bootstrap_keeps_the_resamples_where_neither_median_is_reached():
    """Each method reaches the level in 1 of 4 seeds: neither median is reached (ratio n/a), and most resamples say
    nothing about the ratio; they count as 0 for the lower bound and inf for the upper, so the interval is [0, inf]
    (dropping them, as before, left an interval from the few resamples that happened to reach)."""
    base = {0: (10.0, True), 1: (20.0, False), 2: (20.0, False), 3: (20.0, False)}
    other = {0: (20.0, False), 1: (5.0, True), 2: (20.0, False), 3: (20.0, False)}
    r, lo, hi, n = stats.censored_speedup(base, other)
    assert np.isnan(r) and (lo, hi) == (0.0, np.inf)


def test_the_paired_time_test_sees_a_speed_up_that_log_rank_misses():
    """The audit's counter-example: five seeds with times 10-50, each exactly 1.25x faster with the method. The
    log-rank test ignores the pairing (p 0.45); the paired log ratios are all log 1.25: geometric-mean speed-up 1.25,
    exact sign-flip p 2 / 2^5 = 0.0625, the smallest 5 seeds can give (zero variance: the t test has no answer, and
    p_value gives the exact one). A censored run counts by its bound, clipped at 0: 0.5x below, where the method
    never reaches (by 20) a level the baseline reaches at 10; both never reaching: log ratio 0. The claim "at least
    2.1x" is rejected one-sided at the sign-flip test's floor, 1 / 2^5."""
    from scipy import stats as scipy_stats

    base = {s: (10.0 * (s + 1), True) for s in range(5)}
    other = {s: (8.0 * (s + 1), True) for s in range(5)}
    data = [scipy_stats.CensoredData(uncensored=[d[s][0] for s in range(5)]) for d in (base, other)]
    assert scipy_stats.logrank(*data).pvalue == pytest.approx(0.448, abs=0.001)
    r, lo, hi, n, p, exact = stats.paired_speedup(base, other)
    assert (r, lo, hi, n) == pytest.approx((1.25, 1.25, 1.25, 5)) and p == exact == 2 / 2**5
    assert stats.below_claim(stats.paired_log_ratios(base, other), 2.1) == (1 / 2**5, 1 / 2**5)
    assert stats.below_claim(stats.paired_log_ratios(base, other), 1.0) == (1.0, 1.0)
    never = {s: (20.0, False) for s in range(5)}
    assert stats.paired_log_ratios({s: (10.0, True) for s in range(5)}, never) == pytest.approx([np.log(0.5)] * 5)
    assert stats.paired_log_ratios(never, never) == [0.0] * 5
    # horizons that differ (a distance clock): a method that stops moving at 0.003 without reaching a level the
    # baseline reaches at 0.008 is not 2.7x "faster"; its bound log(0.008 / 0.003) > 0 says nothing, clipped to 0
    stalled = {s: (0.003, False) for s in range(5)}
    assert stats.paired_log_ratios({s: (0.008, True) for s in range(5)}, stalled) == [0.0] * 5
    assert stats.paired_log_ratios(stalled, {s: (0.001, True) for s in range(5)}) == pytest.approx([np.log(3)] * 5)
    assert stats.paired_log_ratios(stalled, {s: (0.006, True) for s in range(5)}) == [0.0] * 5
    # the claim's test counts each seed by the largest ratio its data allow (issue 62): a method that never reaches
    # by its bound, unclipped; a baseline that never reaches makes the ratio unbounded and the level is not tested
    # (its bound clipped, as paired_log_ratios has it, read 2.1x as excluded where the baseline never got there)
    assert stats.log_ratios_at_most(base, other) == pytest.approx([np.log(1.25)] * 5)
    assert stats.log_ratios_at_most({s: (0.008, True) for s in range(5)}, stalled) == pytest.approx([np.log(8 / 3)] * 5)
    assert stats.log_ratios_at_most(never, base) == [np.inf] * 5
    assert stats.below_claim(stats.paired_log_ratios(never, base), 2.1)[0] < 0.05  # anti-conservative: "excluded"
    assert all(np.isnan(stats.below_claim(stats.log_ratios_at_most(never, base), 2.1)))
    half = {s: (10.0 * (s + 1), s < 4) for s in range(5)}  # the baseline reaches in 4 of 5 seeds: not tested
    assert all(np.isnan(stats.below_claim(stats.log_ratios_at_most(half, other), 2.1)))
    assert stats.below_claim(stats.log_ratios_at_most(base, other), 2.1) == (1 / 2**5, 1 / 2**5)
    text = stats.fmt_speedup(stats.censored_speedup(base, other), stats.paired_speedup(base, other), 0.3, 0.3)
    assert text == "KM 1.25x [1.25, 1.25]; paired 1.25x [1.25, 1.25] p 0.062 Holm 0.3, exact p 0.062 Holm 0.3 (n=5)"


def test_the_statistics_and_the_math_toy_import_no_experiment_code():
    """experiments/stats.py needs numpy and scipy only (nothing else of experiments/, no model code); toy_gaussian.py
    (the math checks) uses no statistics and loads nothing of experiments/ (they import it, never the reverse)."""
    import subprocess
    import sys
    from pathlib import Path

    check = (
        "import sys, {0}; bad = sorted(m for m in sys.modules if m.split('.')[0] in {1} and m not in {2}); "
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[1]
    for module, never in (
        ("experiments.stats", ("experiments", "bench", "kit", "world", "nft", "recast", "rvge", "torch")),
        ("toy_gaussian", ("experiments", "bench")),
    ):
        itself = ("experiments", "experiments.stats") if module == "experiments.stats" else ()
        command = [sys.executable, "-c", check.format(module, never, itself)]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, f"{module}: {done.stderr[-500:]}"


def test_rounded_gives_the_same_digits_for_last_digit_differences_and_keeps_structure():
    """stats.rounded, the result files' numbers at 10 significant digits: two floats one ulp apart (another CPU's last
    digit) round alike except in the rare case that straddles a rounding boundary; nesting, ints, NaN and inf kept."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20_000) * 10.0 ** rng.integers(-6, 6, 20_000)
    same = np.mean([stats.rounded(float(a)) == stats.rounded(float(np.nextafter(a, np.inf))) for a in x])
    assert same > 0.999
    assert all(abs(stats.rounded(float(a)) - a) <= 1e-9 * abs(a) for a in x[:1000])
    nested = stats.rounded({"a": [1.23456789012345, (2, float("nan"))], "b": float("inf"), "c": 3, "d": "x"})
    assert nested["a"][0] == 1.234567890 and nested["a"][1][0] == 2 and np.isnan(nested["a"][1][1])
    assert nested["b"] == float("inf") and nested["c"] == 3 and nested["d"] == "x"
