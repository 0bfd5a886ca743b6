"""kit/stats.py: the experiments' statistics by hand and against scipy and the textbook tables (no model, no run).

OMP_NUM_THREADS=1 python -m pytest -q tests/test_stats.py
"""

import numpy as np
import pytest

from kit import stats


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
    """mean 1, sd 1 over 3 seeds (unresolved): N80 at the observed difference is seeds_for_power(1, 1) = 10; with a
    noise floor of 1 the effect is 2 (N80 5); a resolved difference prints none, one resolved only before Holm does."""
    m, lo, hi, n = stats.mean_ci([0.0, 1.0, 2.0])
    assert stats.fmt_ci(m, lo, hi, n).endswith(" sd 1.0000 p 0.23 N80 10")
    assert stats.fmt_ci(m, lo, hi, n, floor=1.0).endswith(" N80 5")
    assert stats.fmt_ci(m, lo, hi, n, family=5).endswith(f" N80 {stats.seeds_for_power(1.0, 1.0, alpha=0.01)}")
    clear = stats.mean_ci([1.0, 1.1, 0.9])
    assert "N80" not in stats.fmt_ci(*clear) and " Holm 0.06 N80 " in stats.fmt_ci(*clear, p_holm=0.06)


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
    r, lo, hi, n, p = stats.censored_speedup(base, other)
    assert r == 0 and n == 4 and 0 <= lo <= hi and np.isfinite(p)
    assert stats.fmt_speedup(r, lo, hi, n, p).startswith("0.00x [")
    faster = {s: (5.0, True) for s in range(4)}
    r, lo, hi, n, p = stats.censored_speedup(base, faster)
    assert r == 2.0 and lo == hi == 2.0 and p < 0.01
    assert stats.censored_speedup(faster, other)[0] == 0 and stats.censored_speedup(other, base)[0] == np.inf
    assert stats.censored_speedup(base, faster) == stats.censored_speedup(base, faster)  # a fixed generator


def test_the_statistics_and_the_math_toy_import_no_experiment_code():
    """kit/stats.py needs numpy and scipy only; toy_gaussian.py (the math checks) takes its statistics from it, not
    from the experiment runner: importing it loads nothing of experiments/."""
    import subprocess
    import sys
    from pathlib import Path

    check = "import sys, {0}; bad = sorted(m for m in sys.modules if m.split('.')[0] in {1}); assert not bad, bad"
    root = Path(__file__).resolve().parents[1]
    for module, never in (
        ("kit.stats", ("experiments", "bench", "world", "recast", "rvge", "torch")),
        ("toy_gaussian", ("experiments", "bench")),
    ):
        command = [sys.executable, "-c", check.format(module, never)]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, f"{module}: {done.stderr[-500:]}"
