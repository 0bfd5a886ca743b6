"""Statistics on paired runs: the experiments' intervals and tests (the embedded model's protocol and reports, the
trainable toy `toy_train.py`, the results folders' scripts); the math checks (`toy_gaussian.py`) use none of them.

Every interval is a t interval at 95% over seeds of paired differences (`mean_ci`) with its paired-t p (`p_value`);
beside it, at the seed counts these experiments run (3-20), the exact sign-flip test of the same differences
(`sign_flip_p`: no normal model; its smallest p at n seeds is 2 / 2^n), so that a table says whether a decision rests
on the normal model. A family of tests read together is corrected by Holm's step-down (`holm`); an unresolved
difference is sized by the seeds a paired t test needs for 80% power (`seeds_for_power`, noncentral t) at
`effect_of_interest`, with the range that the sd's own 95% interval gives (`seeds_for_power_range`: from 3 seeds
up to ~0.3x-40x the point value). A preference judge's share is tested on the logit scale (`share_logits`,
`fmt_share`). A time to reach a level counts the runs that never reach it as censored (`time_to_reach`): Kaplan-Meier
medians (`km_median`) and their ratio with a paired bootstrap (`censored_speedup`) describe it; the test is paired
(`paired_speedup`: the per-seed log ratio of the two times, a run that never reaches the level counted by the bound its
censoring gives, clipped at 0). "Matches" is a one-sided test at a margin (`non_inferiority`) set from the effect
that matters (`gain_margin`: a stated fraction of the baseline's own gain), never an unresolved difference.

Imports numpy and scipy only: nothing of the other experiments, the scripts or the embedded world.
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


def no_spread(m, se):
    """Whether paired differences do not vary (their se below 1e-9 of |mean|, or 0): then t = m / se is round-off
    (a 0/1 reward over a few hundred images can give n equal differences, whose t p came out 0 or 1e-28)."""
    return se <= 1e-9 * abs(m) or se == 0


def p_value(m, lo, hi, n):
    """Two-sided p of the paired t test behind `mean_ci`'s (m, lo, hi, n): t = m / (sd / sqrt(n)), n - 1 dof; NaN
    below 2 values. Where the differences do not vary (`no_spread`) the t test has no answer and the exact sign-flip
    test's is given: 2 / 2^n for n equal nonzero differences (`sign_flip_p`), 1 for zeros."""
    from scipy import stats

    if not (n > 1 and np.isfinite(lo)):
        return np.nan
    se = interval_sd(lo, hi, n) / np.sqrt(n)
    if no_spread(m, se):
        return 1.0 if m == 0 else 2.0 / 2**n
    return float(2 * stats.t.sf(abs(m) / se, n - 1))


EXACT_UP_TO = 20  # `sign_flip_p` enumerates all 2^n sign patterns up to this n; Monte Carlo (fixed draws) beyond


def sign_flip_p(values, alternative="two-sided", draws=200_000):
    """Exact sign-flip (permutation) p of "the paired differences are symmetric about 0" against a mean away from
    0: under H0 each difference's sign is + or - with probability 1/2, independently, so the observed sum is one of
    the 2^n sums sum_i e_i |d_i| (e_i = +-1); p = the share of them at least as extreme as the observed one
    ("two-sided": |sum|, "greater": sum, "less": -sum). No normal model: a zero-variance set of n equal differences
    gets 2 / 2^n (n = 3: 0.25, 5: 0.0625, 8: 0.0078), where the t test's p is 0. NaN below 1 finite value.
    Exact up to EXACT_UP_TO values (all patterns), else `draws` random patterns of a fixed generator, with the
    observed pattern counted among them: p = (k + 1) / (draws + 1) for k draws at least as extreme, never 0."""
    v = np.asarray(values, dtype=float)
    v = np.abs(v[np.isfinite(v)]), v[np.isfinite(v)].sum()
    (a, observed), n = v, len(v[0])
    if n == 0:
        return np.nan
    if n <= EXACT_UP_TO:  # every pattern's sum, one value at a time: +-a_i added to each sum of the ones before
        sums = np.zeros(1)
        for x in a:
            sums = np.concatenate([sums + x, sums - x])
        exact = True
    else:
        sums, exact = np.random.default_rng(0).choice([-1, 1], size=(draws, n)) @ a, False
    tol = 1e-9 * max(float(a.sum()), 1e-300)  # ties (equal |d|, zeros) counted as at least as extreme
    if alternative == "greater":
        k = np.sum(sums >= observed - tol)
    elif alternative == "less":
        k = np.sum(sums <= observed + tol)
    else:
        k = np.sum(np.abs(sums) >= abs(observed) - tol)
    return float(k / len(sums)) if exact else float((k + 1) / (len(sums) + 1))


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

    def enough(n):
        crit, nc = stats.t.ppf(1 - alpha / 2, n - 1), abs(effect) * np.sqrt(n) / sd
        # the far tail: scipy's nct.cdf returns NaN there on some CPUs at large noncentrality (seen at nc ~ 27, 4
        # seeds), where it is below 1e-16; read as 0, else a NaN power would skip N and move N80 up by several seeds
        far = np.nan_to_num(stats.nct.cdf(-crit, n - 1, nc), nan=0.0)
        return stats.nct.sf(crit, n - 1, nc) + far >= power

    # the power rises with n (the critical value falls, the noncentrality grows), so the fewest n is found by doubling
    # then bisecting: ~2 log2(N) evaluations instead of N (a search to 10,000 took ~16 s)
    low, high = 1, 2  # enough(low) is False (no test at one seed); enough(high) is tested
    while not enough(high):
        if high >= most:
            return None
        low, high = high, min(2 * high, most)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return high


def seeds_for_power_range(effect, sd, n, alpha=ALPHA, power=POWER):
    """How far `seeds_for_power` can be off when `sd` is estimated from n paired seeds: N80 at the two ends of the
    sd's 95% interval, sd sqrt((n - 1) / chi2(0.975, n - 1)) and sd sqrt((n - 1) / chi2(0.025, n - 1)), the effect
    held fixed. (low, high), None for "more than 10,000"; (None, None) below 2 seeds. From 3 seeds the sd's interval
    is [0.52, 6.28] x sd, so N80's range reaches ~0.3x to ~40x its point value (N80 grows as sd^2 when large)."""
    from scipy import stats

    if n < 2 or not np.isfinite(sd):
        return None, None
    lo_sd, hi_sd = (sd * np.sqrt((n - 1) / stats.chi2.ppf(q, n - 1)) for q in (0.975, 0.025))
    return seeds_for_power(effect, lo_sd, alpha, power), seeds_for_power(effect, hi_sd, alpha, power)


def fmt_n80(effect, sd, n, alpha):
    """ "N80 k [low, high]": `seeds_for_power` at the measured sd, and its range over the sd's 95% interval
    (`seeds_for_power_range`); "> 10000" past the search."""
    show = lambda k: str(k) if k else "> 10000"  # noqa: E731
    lo, hi = seeds_for_power_range(effect, sd, n, alpha)
    span = f" [{show(lo)}, {show(hi)}]" if n >= 2 else ""
    return f" N80 {show(seeds_for_power(effect, sd, alpha=alpha))}{span}"


def effect_of_interest(m, floor=None):
    """The difference a power statement is made at: the larger of |the observed mean| and two noise floors of one
    evaluation (`floor`: its sd), or |m| alone where no floor was measured."""
    return max(abs(m), 2 * floor) if floor is not None and np.isfinite(floor) else abs(m)


def resolved(lo, hi, p_holm=None):
    """Whether a difference is resolved: its 95% interval excludes 0 and, under a correction, its Holm-adjusted p is
    below ALPHA."""
    return bool(np.isfinite(lo) and not lo <= 0 <= hi and (p_holm is None or p_holm < ALPHA))


def fmt_exact(exact, exact_holm=None):
    """ ", exact p X Holm Y": the sign-flip test beside the t test (`sign_flip_p`), its Holm p over the same family."""
    if exact is None or not np.isfinite(exact):
        return ""
    return f", exact p {exact:.2g}" + (
        f" Holm {exact_holm:.2g}" if exact_holm is not None and np.isfinite(exact_holm) else ""
    )


def fmt_ci(m, lo, hi, n, digits=4, floor=None, p_holm=None, family=1, exact=None, exact_holm=None, power=True):
    """mean [95% t interval] sd (of the paired differences), p (paired t; with `p_holm`, the Holm-adjusted p of its
    family of `family` tests as well); with `exact`, the sign-flip test's p of the same differences and its Holm p
    (`sign_flip_p`: where the t test resolves a difference and this does not, the decision rests on the normal
    model). An unresolved difference (`resolved`) adds "N80 k [low, high]": the seeds a paired t test needs for 80%
    power at `effect_of_interest` (observed |mean|, or two noise floors when larger) and the measured sd, at level
    alpha / family (Holm's first step, so enough for every step; alpha 0.05 uncorrected), and its range over the sd's
    95% interval (`fmt_n80`); `power=False` leaves N80 out (a secondary reading that sizes no experiment)."""
    if not np.isfinite(m):
        return "n/a"
    if not np.isfinite(lo):
        return f"{m:+.{digits}f} (n={n})"
    sd, p = interval_sd(lo, hi, n), p_value(m, lo, hi, n)
    text = f"{m:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] sd {sd:.{digits}f} p {p:.2g}"
    text += f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else ""
    text += fmt_exact(exact, exact_holm)
    if resolved(lo, hi, p_holm) or not power:
        return text
    return text + fmt_n80(effect_of_interest(m, floor), sd, n, ALPHA / family)


def gain_margin(gain, fraction=0.5):
    """The non-inferiority margin from the effect that matters: `fraction` of the lower 95% bound of the baseline's
    own gain over the pretrained model (`gain`: mean_ci's (m, lo, hi, n) of baseline − pretrained, on the better-is-
    positive scale). "Not worse by more than half of what the baseline surely gained." NaN where that bound is <= 0
    (the baseline's gain is not resolved, so "matches it" cannot be tested)."""
    m, lo, hi, n = gain
    return float(fraction * lo) if n > 1 and np.isfinite(lo) and lo > 0 else np.nan


def non_inferiority(diff, margin, better=1):
    """One-sided paired t test that a method is not worse than the baseline by more than `margin`: H0 better * (mean
    difference) <= -margin. From `mean_ci`'s (m, lo, hi, n); returns its p (NaN below 2 seeds)."""
    from scipy import stats

    m, lo, hi, n = diff
    if not (n > 1 and np.isfinite(lo)):
        return np.nan
    se = interval_sd(lo, hi, n) / np.sqrt(n)
    if no_spread(better * m + margin, se):  # n equal differences: the exact one-sided test's answer
        return 1.0 / 2**n if better * m > -margin else 1.0
    return float(stats.t.sf((better * m + margin) / se, n - 1))


def adjusted_difference(y, x, cell):
    """Paired differences adjusted for a paired covariate: y_i = a_c(i) + b x_i + e_i, one intercept per cell c and
    one slope b (ordinary least squares, one error variance). a_c is cell c's difference at x = 0: with x the log
    ratio of two methods' distances to the base model, their difference at equal distance. y, x, cell: one entry per
    seed x cell. Returns ({cell: (a, low, high, p, x min, x max)}, (b, low, high, p)), 95% t intervals and two-sided
    t p on N - cells - 1 dof (NaN below 1 dof). An intercept whose cell's x range does not hold 0 is an
    extrapolation along the common slope: the x range says so."""
    from scipy import stats

    y, x, cell = np.asarray(y, dtype=float), np.asarray(x, dtype=float), np.asarray(cell)
    ok = np.isfinite(y) & np.isfinite(x)
    y, x, cell = y[ok], x[ok], cell[ok]
    names = list(dict.fromkeys(cell.tolist()))
    X = np.column_stack([(cell == c).astype(float) for c in names] + [x])  # (N, cells + 1)
    dof = len(y) - X.shape[1]
    nan = (np.nan,) * 4
    if dof < 1 or np.linalg.matrix_rank(X) < X.shape[1]:
        return {c: (*nan, np.nan, np.nan) for c in names}, nan
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    s2 = float(np.sum((y - X @ coef) ** 2)) / dof
    se = np.sqrt(np.diag(s2 * np.linalg.inv(X.T @ X)))
    half = stats.t.ppf(0.975, dof) * se
    p = [float(2 * stats.t.sf(abs(c) / e, dof)) if e > 0 else float(c == 0) for c, e in zip(coef, se)]
    out = {
        c: (
            float(coef[i]),
            float(coef[i] - half[i]),
            float(coef[i] + half[i]),
            p[i],
            x[cell == c].min(),
            x[cell == c].max(),
        )
        for i, c in enumerate(names)
    }
    return out, (float(coef[-1]), float(coef[-1] - half[-1]), float(coef[-1] + half[-1]), p[-1])


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


def fmt_share(m, lo, hi, n, floor=None, p_holm=None, family=1, exact=None, exact_holm=None):
    """A preference share from `share_logits`: the mean logit and its 95% t interval mapped back through the sigmoid
    (so inside (0, 1)), the p of logit = 0 (share 0.5), the sign-flip test of the logits with `exact` (`fmt_ci`),
    and N80 on the logit scale when unresolved (`fmt_ci`)."""
    from scipy.special import expit

    if not n:
        return "n/a"
    if n < 2:
        return f"{expit(m):.3f} (n={n})"
    text = f"{expit(m):.3f} [{expit(lo):.3f}, {expit(hi):.3f}] p {p_value(m, lo, hi, n):.2g}"
    text += f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else ""
    text += fmt_exact(exact, exact_holm)
    if resolved(lo, hi, p_holm):
        return text
    return text + fmt_n80(effect_of_interest(m, floor), interval_sd(lo, hi, n), n, ALPHA / family)


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
    Kaplan-Meier median times (base / other; runs that never reach the level censored, `km_median`) and a 95%
    percentile interval from resampling seeds in pairs (fixed generator: the same table every rebuild). A resample in
    which neither median is reached says the ratio could be anything: it counts as 0 for the lower bound and as inf
    for the upper one (dropping it, as until 2026-12-04, kept only the resamples that reach the level and narrowed the
    interval). (ratio, low, high, n). Descriptive: the test is `paired_speedup`'s."""
    seeds = sorted(set(base) & set(other))
    if not seeds:
        return np.nan, np.nan, np.nan, 0
    b, o = (np.array([d[s] for s in seeds], dtype=float) for d in (base, other))

    known = {}  # a resample's ratio depends only on how often it draws each seed: computed once per such count

    def ratio(idx):
        key = np.bincount(idx, minlength=len(seeds)).tobytes()
        if key not in known:
            known[key] = median_ratio(km_median(b[idx, 0], b[idx, 1] > 0), km_median(o[idx, 0], o[idx, 1] > 0))
        return known[key]

    rng = np.random.default_rng(seed)
    boot = np.array([ratio(rng.integers(0, len(seeds), len(seeds))) for _ in range(resamples)])
    lo = np.quantile(np.nan_to_num(boot, nan=0.0, posinf=np.inf), 0.025, method="inverted_cdf")
    hi = np.quantile(np.where(np.isnan(boot), np.inf, boot), 0.975, method="inverted_cdf")
    return ratio(np.arange(len(seeds))), float(lo), float(hi), len(seeds)


def paired_log_ratios(base: dict, other: dict) -> list:
    """Per seed (both have it), log(base's time / other's time) to a level, from {seed: (time, reached)}: > 0 where
    `other` is faster. A run that never reaches the level has a time of at least its censoring point (its last
    evaluation's clock), so the log ratio is bounded on one side only; it counts as that bound clipped at 0 (`other`
    censored: min(log(t_base / c_other), 0); `base` censored: max(log(c_base / t_other), 0)), a value between 0 and
    the true one whatever the two runs' horizons (on the iteration clock they share one and nothing is clipped; on a
    distance clock a run that stops moving early would otherwise look fast); both never reaching: 0. A time <= 0
    (reached before training) gives no ratio (dropped)."""
    out = []
    for s in sorted(set(base) & set(other)):
        (tb, rb), (to, ro) = base[s], other[s]
        if not (rb or ro):
            out.append(0.0)
        elif tb > 0 and to > 0:
            v = float(np.log(tb / to))
            out.append(v if rb and ro else min(v, 0.0) if rb else max(v, 0.0))
    return out


def paired_speedup(base: dict, other: dict):
    """The paired test of a time to reach a level (issue 45: log-rank ignores the pairing, so every seed exactly 1.25x
    faster gave log-rank p 0.45): the per-seed log ratios of `paired_log_ratios`, their mean mapped back (the
    geometric-mean speed-up base / other) with its 95% t interval, the paired t p and the exact sign-flip p
    (`sign_flip_p`). (ratio, low, high, n, p, exact p)."""
    logs = paired_log_ratios(base, other)
    m, lo, hi, n = mean_ci(logs)
    return float(np.exp(m)), float(np.exp(lo)), float(np.exp(hi)), n, p_value(m, lo, hi, n), sign_flip_p(logs)


def log_ratios_at_most(base: dict, other: dict) -> list:
    """Per seed (both have it), the largest log(base's time / other's time) to a level that the data allow, from
    {seed: (time, reached)}: the log ratio where both reach the level; where only `other` never reaches it, the bound
    log(t_base / c_other) its censoring point gives, unclipped; where `base` never reaches it, +inf (its time is
    anything beyond its bound). The values to test "below a claim" with (`below_claim`): `paired_log_ratios` clips a
    censored seed's bound towards 0, which is conservative for "faster than 1x" but not for "slower than 2.1x" (issue
    62: the baseline censored at its bound made the claim look excluded at levels it never reached). A time <= 0
    (reached before training) gives no ratio (dropped)."""
    out = []
    for s in sorted(set(base) & set(other)):
        (tb, rb), (to, _) = base[s], other[s]
        if not rb:
            out.append(np.inf)
        elif tb > 0 and to > 0:
            out.append(float(np.log(tb / to)))
    return out


def below_claim(logs, claim):
    """One-sided p of H0 "the speed-up is at least `claim`" from per-seed log ratios (`log_ratios_at_most`: each seed's
    largest log ratio the data allow): the paired t on log ratio - log(claim), and the exact sign-flip test of the same
    ("less"). (t p, exact p). NaN, NaN (not tested) where a seed's ratio is unbounded (+inf: the baseline never reached
    the level in that seed), so a level the baseline does not reach in every seed is refused, never read as below."""
    from scipy import stats

    if np.any(np.isposinf(np.asarray(logs, dtype=float))):
        return np.nan, np.nan
    d = np.asarray(logs, dtype=float) - np.log(claim)
    m, lo, hi, n = mean_ci(d)
    if n < 2:
        return np.nan, np.nan
    se = interval_sd(lo, hi, n) / np.sqrt(n)
    t_p = 1.0 / 2**n if no_spread(m, se) and m < 0 else 1.0 if no_spread(m, se) else float(stats.t.cdf(m / se, n - 1))
    return t_p, sign_flip_p(d, alternative="less")


def fmt_speedup(km, pair=None, p_holm=None, exact_holm=None):
    """ "KM 1.19x [0.95, 2.34]; paired 1.30x [0.99, 1.94] p 0.06 Holm 1, exact p 0.08 Holm 1 (n=8)": the ratio of
    Kaplan-Meier medians with its paired bootstrap (`censored_speedup`; inf: the baseline's median is never reached,
    0.00x: the method's is not) and the paired test (`paired_speedup`) with Holm p of both of its tests."""
    r, lo, hi, n = km
    if not n:
        return "n/a"

    def fmt(x):
        return "inf" if np.isinf(x) else "n/a" if np.isnan(x) else f"{x:.2f}"

    text = f"KM {fmt(r)}{'x' if np.isfinite(r) else ''} [{fmt(lo)}, {fmt(hi)}]"
    if pair is not None and pair[3] > 1:
        g, glo, ghi, _, p, exact = pair
        text += f"; paired {fmt(g)}x [{fmt(glo)}, {fmt(ghi)}] p {p:.2g}"
        text += f" Holm {p_holm:.2g}" if p_holm is not None and np.isfinite(p_holm) else ""
        text += fmt_exact(exact, exact_holm)
    return text + f" (n={n})"


def mean_std(values, digits=4):
    v = np.asarray(values, dtype=float)
    return f"{np.nanmean(v):.{digits}f} ± {np.nanstd(v):.{digits}f}" if np.isfinite(v).any() else "n/a"


def rounded(obj, digits=10):
    """A result file's numbers at `digits` significant digits (dicts, lists and tuples walked; NaN and inf kept): the
    last float digits differ from CPU to CPU (other kernels, other summation orders), so a rebuild of a committed
    summary on another machine writes the same bytes. 10 digits keep every quoted number exact."""
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    if isinstance(obj, float) and np.isfinite(obj):
        return float(f"{obj:.{digits}g}")
    return obj
