"""Statistics on paired runs: the experiments' intervals and tests, shared by `experiments/` and `toy_gaussian.py`.

Every interval is a t interval at 95% over seeds of paired differences (`mean_ci`) with its paired-t p (`p_value`);
a family of tests read together is corrected by Holm's step-down (`holm`); an unresolved difference is sized by the
seeds a paired t test needs for 80% power (`seeds_for_power`, noncentral t) at `effect_of_interest`. A preference
judge's share is tested on the logit scale (`share_logits`, `fmt_share`); a time to reach a level counts the runs that
never reach it as censored (`time_to_reach`, Kaplan-Meier medians `km_median`, `censored_speedup` with its log-rank p);
"matches" is a one-sided test at a margin (`non_inferiority`), never an unresolved difference.

Imports numpy and scipy only: nothing of the experiments, the scripts or the embedded world.
"""

from __future__ import annotations

import numpy as np


def first_crossing(x, y, level):
    """First x at which y reaches level, linearly interpolated between evaluations; NaN if never."""
    hit = np.flatnonzero(y >= level)
    if not len(hit):
        return np.nan
    i = hit[0]
    if i == 0 or y[i] == y[i - 1]:
        return x[i]
    return x[i - 1] + (level - y[i - 1]) / (y[i] - y[i - 1]) * (x[i] - x[i - 1])


def time_to_reach(x, y, level):
    """(x at which y first reaches level, True), or (the last x, False): a run that never reaches the level is
    censored at its last evaluation, not dropped."""
    t = first_crossing(x, y, level)
    return (t, True) if np.isfinite(t) else ((x[-1] if len(x) else np.nan), False)


def smooth(y, k=3):
    y = np.asarray(y, dtype=float)
    return np.array([y[max(0, i - k + 1) : i + 1].mean() for i in range(len(y))])


def mean_ci(values):
    """(mean, low, high, n) of the finite values; a t interval at 95% (NaN bounds below 2 values)."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return np.nan, np.nan, np.nan, 0
    if len(v) < 2:
        return v.mean(), np.nan, np.nan, 1
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return v.mean(), v.mean() - half, v.mean() + half, len(v)


def paired(a: dict, b: dict):
    """Per-seed values a[s] - b[s] over the seeds both have."""
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def interval_sd(lo, hi, n):
    """The sd of the n paired differences behind a 95% t interval [lo, hi]: (hi - lo) / 2 = t(0.975, n - 1) sd /
    sqrt(n)."""
    return (hi - lo) / 2 * np.sqrt(n) / t_975(n - 1)


def t_975(dof):
    from scipy import stats

    return stats.t.ppf(0.975, dof)


def p_value(m, lo, hi, n):
    """Two-sided p of the paired t test behind `mean_ci`'s (m, lo, hi, n): t = m / (sd / sqrt(n)), n - 1 dof; NaN
    below 2 values; 0 or 1 when the differences do not vary."""
    from scipy import stats

    if not (n > 1 and np.isfinite(lo)):
        return np.nan
    se = interval_sd(lo, hi, n) / np.sqrt(n)
    if se == 0:
        return 1.0 if m == 0 else 0.0
    return float(2 * stats.t.sf(abs(m) / se, n - 1))


def holm(pvalues):
    """Holm's step-down adjusted p-values (family-wise error over the family given): the i-th smallest of m p-values
    becomes max over j <= i of min(1, (m - j + 1) p_(j)); NaN stays NaN and does not count in m."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    running = 0.0
    for rank, i in enumerate(ok[np.argsort(p[ok], kind="stable")]):
        running = max(running, min(1.0, (len(ok) - rank) * p[i]))
        out[i] = running
    return out


POWER, ALPHA = 0.8, 0.05  # the power and two-sided level at which `seeds_for_power` sizes a comparison


def seeds_for_power(effect, sd, alpha=ALPHA, power=POWER, most=10_000):
    """The fewest seeds N >= 2 at which a two-sided paired t test at level alpha detects a true mean difference
    `effect` (paired differences of sd `sd`) with the given power: P(|T| > t(1 - alpha/2, N - 1)) >= power, T
    noncentral t with N - 1 dof and noncentrality effect sqrt(N) / sd. None past `most` (or effect = 0); 2 when sd
    = 0. Cohen's d = 0.5 at alpha 0.05 and power 0.8 gives the textbook 34."""
    from scipy import stats

    if not (np.isfinite(effect) and np.isfinite(sd)) or effect == 0:
        return None
    if sd == 0:
        return 2
    for n in range(2, most + 1):
        crit, nc = stats.t.ppf(1 - alpha / 2, n - 1), abs(effect) * np.sqrt(n) / sd
        # the far tail: scipy's nct.cdf returns NaN there on some CPUs at large noncentrality (seen at nc ~ 27, 4
        # seeds), where it is below 1e-16; read as 0, else a NaN power would skip N and move N80 up by several seeds
        far = np.nan_to_num(stats.nct.cdf(-crit, n - 1, nc), nan=0.0)
        if stats.nct.sf(crit, n - 1, nc) + far >= power:
            return n
    return None


def effect_of_interest(m, floor=None):
    """The difference a power statement is made at: the larger of |the observed mean| and two noise floors of one
    evaluation (`floor`: its sd), or |m| alone where no floor was measured."""
    return max(abs(m), 2 * floor) if floor is not None and np.isfinite(floor) else abs(m)


def resolved(lo, hi, p_holm=None):
    """Whether a difference is resolved: its 95% interval excludes 0 and, under a correction, its Holm-adjusted p is
    below ALPHA."""
    return bool(np.isfinite(lo) and not lo <= 0 <= hi and (p_holm is None or p_holm < ALPHA))


def fmt_ci(m, lo, hi, n, digits=4, floor=None, p_holm=None, family=1):
    """mean [95% t interval] sd (of the paired differences), p (paired t; with `p_holm`, the Holm-adjusted p of its
    family of `family` tests as well). An unresolved difference (`resolved`) adds "N80 k": the seeds a paired t test
    needs for 80% power at `effect_of_interest` (observed |mean|, or two noise floors when larger) and the measured sd,
    at level alpha / family (Holm's first step, so enough for every step; alpha 0.05 uncorrected) (`seeds_for_power`;
    "N80 > 10000" past the search)."""
    if not np.isfinite(m):
        return "n/a"
    if not np.isfinite(lo):
        return f"{m:+.{digits}f} (n={n})"
    sd, p = interval_sd(lo, hi, n), p_value(m, lo, hi, n)
    text = f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] sd {sd:.{digits}f} p {p:.2g}"
    text += f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else ""
    if resolved(lo, hi, p_holm):
        return text
    need = seeds_for_power(effect_of_interest(m, floor), sd, alpha=ALPHA / family)
    return text + (f" N80 {need}" if need else " N80 > 10000")


def non_inferiority(diff, margin, better=1):
    """One-sided paired t test that a method is not worse than the baseline by more than `margin`: H0 better * (mean
    difference) <= -margin. From `mean_ci`'s (m, lo, hi, n); returns its p (NaN below 2 seeds)."""
    from scipy import stats

    m, lo, hi, n = diff
    if not (n > 1 and np.isfinite(lo)):
        return np.nan
    se = interval_sd(lo, hi, n) / np.sqrt(n)
    if se == 0:
        return 0.0 if better * m > -margin else 1.0
    return float(stats.t.sf((better * m + margin) / se, n - 1))


def pref_share(a_scores, b_scores):
    """The preference judge's summary of one pair of image sets (same prompt and noise per position): the mean over
    images of sigmoid(s_a - s_b), the Bradley-Terry probability that it prefers a's image; 0.5 = no preference. Near
    0.5 when the images barely differ, where a win rate (the share with s_a > s_b) swings from 0 to 1."""
    from scipy.special import expit

    return float(np.mean(expit(np.asarray(a_scores, dtype=float) - np.asarray(b_scores, dtype=float))))


def share_logit(share):
    """log(share / (1 - share)), the share clipped to [1e-6, 1 - 1e-6]."""
    from scipy.special import logit

    return float(logit(np.clip(share, 1e-6, 1 - 1e-6)))


def share_logits(shares):
    """(mean, low, high, n) of `mean_ci` over the logits of per-seed shares in (0, 1) (`share_logit`): the scale on
    which a preference share is tested and its interval drawn."""
    return mean_ci([share_logit(s) for s in shares if np.isfinite(s)])


def fmt_share(m, lo, hi, n, floor=None, p_holm=None, family=1):
    """A preference share from `share_logits`: the mean logit and its 95% t interval mapped back through the sigmoid
    (so inside (0, 1)), the p of logit = 0 (share 0.5), and N80 on the logit scale when unresolved (`fmt_ci`)."""
    from scipy.special import expit

    if not n:
        return "n/a"
    if n < 2:
        return f"{expit(m):.3f} (n={n})"
    text = f"{expit(m):.3f} [{expit(lo):.3f}, {expit(hi):.3f}] p {p_value(m, lo, hi, n):.2g}"
    text += f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else ""
    if resolved(lo, hi, p_holm):
        return text
    need = seeds_for_power(effect_of_interest(m, floor), interval_sd(lo, hi, n), alpha=ALPHA / family)
    return text + (f" N80 {need}" if need else " N80 > 10000")


def km_median(times, reached):
    """Kaplan-Meier median time to reach a level: runs that never reach it are censored at their last evaluation
    (they count as "not yet" up to then, never dropped). The first time the KM survival falls to 0.5 or below; inf
    when it never does (too many runs never reach the level)."""
    t, e = np.asarray(times, dtype=float), np.asarray(reached, dtype=bool)
    surv = 1.0
    for x in np.unique(t[e]):
        surv *= 1 - np.sum(e & (t == x)) / np.sum(t >= x)
        if surv <= 0.5:
            return float(x)
    return np.inf


def median_ratio(base, other):
    """base / other of two median times, where inf means "never reached": inf when only `other` reaches it (or
    reaches it at 0), 0 when only `base` does, NaN when neither does (or both at 0)."""
    if np.isinf(base) and np.isinf(other) or base == other == 0:
        return np.nan
    return np.inf if np.isinf(base) or other == 0 else base / other


def censored_speedup(base: dict, other: dict, resamples=2000, seed=0):
    """Speed-up of `other` over `base` at a level both try to reach, from {seed: (time, reached)}: the ratio of their
    Kaplan-Meier median times (base / other; runs that never reach the level censored, `km_median`), a 95% percentile
    interval from resampling seeds in pairs (fixed generator: the same table every rebuild), and the log-rank p
    (scipy.stats.logrank) of the two time-to-reach curves. (ratio, low, high, n, p)."""
    from scipy import stats

    seeds = sorted(set(base) & set(other))
    if not seeds:
        return np.nan, np.nan, np.nan, 0, np.nan
    b, o = (np.array([d[s] for s in seeds], dtype=float) for d in (base, other))

    def ratio(idx):
        return median_ratio(km_median(b[idx, 0], b[idx, 1] > 0), km_median(o[idx, 0], o[idx, 1] > 0))

    rng = np.random.default_rng(seed)
    boot = np.array([ratio(rng.integers(0, len(seeds), len(seeds))) for _ in range(resamples)])
    boot = boot[~np.isnan(boot)]  # resamples where neither median is reached say nothing about the ratio
    lo, hi = np.quantile(boot, [0.025, 0.975], method="inverted_cdf") if len(boot) else (np.nan, np.nan)
    p = np.nan
    if b[:, 1].any() or o[:, 1].any():
        data = [stats.CensoredData(uncensored=x[x[:, 1] > 0, 0], right=x[x[:, 1] == 0, 0]) for x in (b, o)]
        p = float(stats.logrank(*data).pvalue)
    return ratio(np.arange(len(seeds))), float(lo), float(hi), len(seeds), p


def fmt_speedup(r, lo, hi, n, p, p_holm=None):
    """ "1.40x [0.80, inf] log-rank p 0.3": a speed-up from `censored_speedup` (inf: the baseline's median is never
    reached; 0.00x: the method's is not)."""
    if not n:
        return "n/a"

    def fmt(x):
        return "inf" if np.isinf(x) else "n/a" if np.isnan(x) else f"{x:.2f}"

    text = f"{fmt(r)}{'x' if np.isfinite(r) else ''} [{fmt(lo)}, {fmt(hi)}] (n={n})"
    text += f" log-rank p {p:.2g}" if np.isfinite(p) else ""
    return text + (f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else "")


def mean_std(values, digits=4):
    v = np.asarray(values, dtype=float)
    return f"{np.nanmean(v):.{digits}f} ± {np.nanstd(v):.{digits}f}" if np.isfinite(v).any() else "n/a"
