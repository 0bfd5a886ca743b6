"""Tests, from fast to slow: hand-computed values, vectorised vs naive loops,
properties of the W solver, closed-form checks against the Gaussian toy, and
end-to-end runs. Run: python -m pytest -q
"""
import itertools
import math

import numpy as np
import pytest
import torch

import recast
import rvge

# -----------------------------------------------------------------------------
# Budgets
# -----------------------------------------------------------------------------


def test_parse_budgets_reads_and_keeps_scale():
    assert recast.parse_budgets("0.4,0.3,0.2,0.1") == [0.4, 0.3, 0.2, 0.1]
    assert recast.parse_budgets(" 2, 0 ,1 ") == [2.0, 0.0, 1.0]  # not normalised


@pytest.mark.parametrize(
    "text, words",
    [("", "empty"), ("   ", "empty"), ("0.4,abc", "not a number"), ("0.4,,0.1", "not a number"),
     ("nan,1", "finite"), ("inf", "finite"), ("0.5,-0.1", "negative"), ("0,0,0", "all budgets are zero")],
)
def test_parse_budgets_errors_name_the_problem_and_the_fix(text, words):
    with pytest.raises(ValueError) as err:
        recast.parse_budgets(text)
    assert words in str(err.value) and "--budgets" in str(err.value)


# -----------------------------------------------------------------------------
# Optimality probabilities (DESIGN §2)
# -----------------------------------------------------------------------------


def test_optimality_hand_computed():
    R = np.array([1.0, 3.0, 10.0, 10.0])
    groups = np.array([0, 0, 1, 1])
    std = R.std()  # global std over the batch
    r = recast.optimality(R, groups)
    A = np.array([-1.0, 1.0, 0.0, 0.0]) / (std + 1e-4)
    assert np.allclose(r, 0.5 + 0.5 * np.clip(A, -5, 5) / 5)
    assert np.allclose(r[2:], 0.5)  # a tied group: r = 0.5, never NaN


def test_optimality_clips_and_handles_nan_and_all_ties():
    R = np.array([[0.0, 1.0], [0.0, np.nan], [0.0, 100.0], [0.0, 1.0]])
    r = recast.optimality(R, [0, 0, 0, 0], std=np.array([1.0, 1e-3]))
    assert np.all(np.isfinite(r)) and np.all((r >= 0) & (r <= 1))
    assert np.allclose(r[:, 0], 0.5)  # every reward tied
    assert r[1, 1] == 0.5  # NaN left out: no preference
    assert r[2, 1] == 1.0 and r[0, 1] == 0.0  # clipped at +-5 -> {0, 1}
    # the NaN is excluded from the group mean: mean of (1, 100, 1) = 34
    assert np.isclose(recast.optimality(R[:, 1], [0] * 4, std=1e3)[0], 0.5 + 0.5 * (1 - 34) / (1e3 + 1e-4) / 5)


def test_combine_raw_is_the_budget_weighted_sum():
    R = np.array([[1.0, 2.0], [3.0, np.nan]])
    out = recast.combine_raw(R, [0.25, 0.75])
    assert out[0] == 0.25 + 1.5 and np.isnan(out[1])


# -----------------------------------------------------------------------------
# Renyi curves (DESIGN §3.2-3.3)
# -----------------------------------------------------------------------------


def test_renyi_alpha2_is_log_one_plus_relative_variance():
    h = np.random.default_rng(0).uniform(0.1, 0.9, size=1000)
    assert np.isclose(recast.renyi_from_h(h, 2.0), np.log(1 + h.var() / h.mean() ** 2))


def test_renyi_orders_are_ordered_and_kl_is_the_limit():
    h = np.random.default_rng(1).uniform(0.05, 0.95, size=500)
    D = [recast.renyi_from_h(h, a) for a in (0.5, 0.999, 1.0, 1.001, 2.0, 3.0)]
    assert np.all(np.diff(D) >= -1e-12)  # D_alpha non-decreasing in alpha
    assert abs(D[1] - D[2]) < 1e-3 and abs(D[3] - D[2]) < 1e-3
    assert abs(recast.renyi_from_h(np.full(10, 0.3), 2.0)) < 1e-12 and recast.renyi_from_h(np.zeros(5), 1.0) == 0.0


def test_split_levels_by_hand():
    anc = np.array([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]])
    S = recast.split_levels(anc)
    assert S[0, 1] == 2 and S[0, 2] == 1 and S[0, 3] == 0 and S[0, 0] == 3 and (S == S.T).all()


def test_pair_moments_match_a_naive_loop():
    rng = np.random.default_rng(2)
    anc = np.array(list(itertools.product(range(3), range(2), range(2))))  # 3 roots x 2 x 2
    anc = np.concatenate([anc, anc + [3, 0, 0]])  # two prompt groups
    groups = np.repeat([0, 1], 12)
    r = rng.random((24, 2))
    sums, counts = recast.pair_moments(r, groups, anc)
    naive_s, naive_c = np.zeros((2, 4)), np.zeros(4)
    for a in range(24):
        for b in range(24):
            if groups[a] != groups[b]:
                continue
            level = 0
            while level < 3 and anc[a, level] == anc[b, level]:
                level += 1
            naive_s[:, level] += r[a] * r[b]
            naive_c[level] += 1
    assert np.allclose(sums, naive_s) and np.array_equal(counts, naive_c)
    assert counts[-1] == 24  # each leaf with itself
    D = recast.pairs_curve(sums, counts)
    assert np.allclose(D[:, 0], 0.0)


def test_pairs_estimator_sees_a_coarse_reward_early():
    """Leaves of one root share a reward decided at the root (coarse): pairs split after the root
    are perfectly correlated, so D is already at its t = 0 value at the first branch level."""
    anc = np.array(list(itertools.product(range(8), range(2), range(2))))
    root_value = np.random.default_rng(3).integers(0, 2, 8).astype(float)
    r = root_value[anc[:, 0]][:, None] * 0.8 + 0.1
    D = recast.pairs_curve(*recast.pair_moments(r, np.zeros(len(r)), anc))[0]
    assert D[1] > 0.1 and np.allclose(D[1:], D[-1])


def test_denoised_moments_reduce_to_renyi_from_h():
    rng = np.random.default_rng(4)
    h = rng.uniform(0.1, 0.9, size=(3, 16, 2))
    groups = np.zeros(16)
    for alpha in (0.5, 1.0, 2.0):
        sums, counts = recast.denoised_moments(h, groups, alpha)
        D = recast.renyi_from_moment(sums / counts, alpha)
        assert np.allclose(D, recast.renyi_from_h(np.moveaxis(h, 1, -1), alpha).T)


def test_gains_are_monotone_projected_and_telescope():
    sig = recast.shifted_sigmas(10, 3.0)
    t_levels = [1.0, 0.8, 0.6, 0.3, 0.0]
    D_raw = np.array([[0.0, 0.2, 0.1, 0.4, 0.5],  # violates monotonicity at 0.6
                      [0.0, -0.05, 0.0, 0.0, 0.3],  # negative noise
                      [0.0, 0.0, 0.0, 0.0, 0.0]])  # uninformative reward
    D_grid, gains = recast.gains_on_grid(t_levels, D_raw, sig)
    assert (gains >= 0).all() and np.allclose(D_grid[:, 0], 0.0)
    assert np.allclose(gains.sum(1), D_grid[:, -1], atol=1e-12)
    assert np.allclose(D_grid[:, -1], [0.5, 0.3, 0.0])
    assert np.allclose(recast.profiles(gains)[2], 0.1)  # no gain: uniform profile
    with pytest.raises(ValueError, match="t = 0"):
        recast.gains_on_grid([1.0, 0.5], D_raw[:, :2], sig)


# -----------------------------------------------------------------------------
# The W solver (DESIGN §3.4)
# -----------------------------------------------------------------------------


def random_instance(seed, K=4, T=10):
    rng = np.random.default_rng(seed)
    return rng.uniform(0.05, 1.0, K), rng.dirichlet(np.full(T, 0.5), size=K)


@pytest.mark.parametrize("seed", range(5))
def test_W_marginals(seed):
    lam, P = random_instance(seed)
    W = recast.solve_W(lam, P, tau=1.5, eps=1e-3)
    assert np.abs(W.sum(1) - lam).max() < 1e-9
    assert np.abs(W.sum(0) - lam.sum() / P.shape[1]).max() < 1e-9
    assert (W > 0).all()


def test_W_tau_zero_and_identical_profiles_are_uniform():
    lam, P = random_instance(7)
    U = recast.uniform_W(lam, P.shape[1])
    assert np.allclose(recast.solve_W(lam, P, tau=0.0), U, rtol=0, atol=1e-15)
    assert np.allclose(recast.solve_W(lam, np.repeat(P[:1], len(lam), 0), tau=2.0), U, rtol=0, atol=1e-12)


def test_W_permuting_rewards_permutes_rows():
    lam, P = random_instance(8)
    perm = np.array([2, 0, 3, 1])
    W = recast.solve_W(lam, P)
    assert np.allclose(recast.solve_W(lam[perm], P[perm]), W[perm], atol=1e-13)


def test_W_moves_credit_towards_informative_steps():
    lam = np.array([1.0, 1.0])
    early, late = np.linspace(1, 0.1, 10), np.linspace(0.1, 1, 10)
    P = np.stack([early / early.sum(), late / late.sum()])
    W = recast.solve_W(lam, P)
    assert W[0, 0] > W[1, 0] and W[0, -1] < W[1, -1]


@pytest.mark.parametrize("seed", range(3))
def test_W_agrees_with_pot_sinkhorn(seed):
    ot = pytest.importorskip("ot")
    lam, P = random_instance(seed + 20, K=3, T=7)
    tau, eps = 1.3, 1e-2
    W = recast.solve_W(lam, P, tau=tau, eps=eps)
    Kmat = lam[:, None] * ((1 - eps) * P + eps / 7) ** tau
    # entropic OT with cost -log K and reg 1 has the Gibbs kernel K itself
    W_pot = ot.sinkhorn(lam, np.full(7, lam.sum() / 7), -np.log(Kmat), reg=1.0,
                        method="sinkhorn_log", stopThr=1e-15, numItermax=100000)
    assert np.allclose(W, W_pot, atol=1e-10)


def test_W_zero_budget_and_eps_zero():
    lam, P = random_instance(9)
    lam[1] = 0.0
    W = recast.solve_W(lam, P)
    assert (W[1] == 0).all() and np.abs(W.sum(0) - lam.sum() / 10).max() < 1e-9
    Wexact = recast.solve_W(lam, P, eps=0.0)  # strictly positive profile: allowed
    assert np.abs(Wexact.sum(1) - lam).max() < 1e-9


def test_W_input_errors():
    lam, P = random_instance(10)
    with pytest.raises(ValueError, match="shape"):
        recast.solve_W(lam[:3], P)
    with pytest.raises(ValueError, match="non-negative"):
        recast.solve_W(lam, -P)
    with pytest.raises(ValueError, match="non-negative"):
        recast.solve_W(-lam, P)
    P0 = P.copy()
    P0[0, 0] = 0.0
    with pytest.raises(ValueError, match="eps > 0"):
        recast.solve_W(lam, P0, eps=0.0)


# -----------------------------------------------------------------------------
# The mixed NFT loss (DESIGN §2, §3.1)
# -----------------------------------------------------------------------------


def nft_batch(seed=0, N=6):
    g = torch.Generator().manual_seed(seed)
    shape = (N, 2, 3, 3)
    x0, eps, v_old, v_theta = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(4))
    t = torch.rand(N, generator=g, dtype=torch.float64) * 0.9 + 0.05
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    return x0, x_t, v_old, v_theta, t


def test_nft_loss_matches_the_formula_by_hand():
    x0, x_t, v_old, v_theta, t = nft_batch()
    r, b = torch.rand(6, dtype=torch.float64), 0.7
    got = recast.nft_loss(v_theta, v_old, x_t, x0, t, r, b)
    for i in range(6):
        terms = []
        for v in ((1 - b) * v_old[i] + b * v_theta[i], (1 + b) * v_old[i] - b * v_theta[i]):
            err = x_t[i] - t[i] * v - x0[i]
            terms.append(float((err ** 2).mean() / err.abs().mean()))
        assert math.isclose(got[i].item(), (r[i] * terms[0] + (1 - r[i]) * terms[1]).item() / b, rel_tol=1e-12)


def test_mixture_with_one_reward_is_diffusionnft_and_uniform_is_per_reward_normalisation():
    x0, x_t, v_old, v_theta, t = nft_batch(1)
    T = 10
    step = torch.arange(6) % T
    r1 = torch.rand(6, 1, dtype=torch.float64)
    W1 = torch.tensor(recast.uniform_W([0.7], T))
    assert torch.allclose(recast.mix_optimality(r1, W1, step), r1[:, 0])
    lam = [0.4, 0.3, 0.2, 0.1]
    r = torch.rand(6, 4, dtype=torch.float64)
    mixed = recast.mix_optimality(r, torch.tensor(recast.uniform_W(lam, T)), step)
    assert torch.allclose(mixed, r @ torch.tensor(lam, dtype=torch.float64) / sum(lam))
    # linear in r: the mixed loss is the W-weighted sum of per-reward losses
    W = torch.tensor(recast.solve_W(lam, np.random.default_rng(0).dirichlet(np.ones(T), 4)))
    mixed_loss = recast.nft_loss(v_theta, v_old, x_t, x0, t, recast.mix_optimality(r, W, step))
    per_reward = torch.stack([recast.nft_loss(v_theta, v_old, x_t, x0, t, r[:, k]) for k in range(4)], 1)
    weights = W[:, step].T * T / W.sum()
    assert torch.allclose(mixed_loss, (weights * per_reward).sum(1))


# -----------------------------------------------------------------------------
# RVGE math (DESIGN §4)
# -----------------------------------------------------------------------------


def test_value_direction_by_hand_and_ties():
    x0 = np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 4.0]])
    R = np.array([0.0, 1.0, 2.0])
    # centred: R - 1 = (-1, 0, 1); x0 - mean = ((-2,-1), (0,-1), (2,2)); (1/3) sum = (4/3, 1)
    assert np.allclose(rvge.value_direction(x0, R), [4 / 3, 1.0])
    assert np.array_equal(rvge.value_direction(x0, np.ones(3)), np.zeros(2))
    assert np.array_equal(rvge.value_direction(x0, np.ones(3), beta=0.1), np.zeros(2))
    w = np.exp(R / 0.5) / np.exp(R / 0.5).sum()
    assert np.allclose(rvge.value_direction(x0, R, beta=0.5), w @ x0 - x0.mean(0))
    t = torch.tensor(x0)
    assert torch.allclose(rvge.value_direction(t, torch.tensor(R), beta=0.5), torch.tensor(w @ x0 - x0.mean(0)))
    with pytest.raises(ValueError, match="kl-beta"):
        rvge.value_direction(x0, R, beta=0.0)


def test_value_direction_matches_the_linear_gaussian_tilt():
    """x0 ~ N(mu, s2 I), R = w.x0: E[x0 | x_t] under the tilt exp(R / beta) moves by kappa(t) w / beta."""
    rng = np.random.default_rng(5)
    d, s2, t, beta = 8, 0.8, 0.6, 4.0
    w = rng.normal(size=d)
    x_t = rng.normal(size=d)
    # exact posterior x0 | x_t for the Gaussian base (mu = 0)
    kappa = rvge.posterior_var(t, s2)
    post_mean = (1 - t) * s2 / ((1 - t) ** 2 * s2 + t ** 2) * x_t
    x0 = post_mean + math.sqrt(kappa) * rng.normal(size=(200_000, d))
    exact = kappa * w / beta
    for est in (rvge.value_direction(x0, x0 @ w, beta=beta), rvge.value_direction(x0, x0 @ w, eta=1 / beta)):
        cos = est @ exact / np.linalg.norm(est) / np.linalg.norm(exact)
        assert cos > 0.99 and abs(np.linalg.norm(est) / np.linalg.norm(exact) - 1) < 0.05


def test_kappa_transfer_and_query_weights():
    s2 = 0.5
    t = np.linspace(0.01, 1.0, 50)
    kappa = rvge.posterior_var(t, s2)
    assert np.all(np.diff(kappa) > 0) and np.isclose(kappa[-1], s2)
    # the posterior variance of x0 given x_t for x0 ~ N(0, s2): s2 - s2^2 (1-t)^2 / ((1-t)^2 s2 + t^2)
    assert np.allclose(kappa, s2 - s2 ** 2 * (1 - t) ** 2 / ((1 - t) ** 2 * s2 + t ** 2))
    assert np.allclose(rvge.transfer_ratio(t, 0.3, s2, cap=1e9), kappa / rvge.posterior_var(0.3, s2))
    assert rvge.transfer_ratio(1.0, 0.05, s2, cap=4.0) == 4.0
    qw = rvge.query_weight(t, 0.3, s2)
    assert np.all(qw[t <= 0.3] == 1.0) and np.all(qw[t > 0.3] < 1.0)
    v_old, d_B = torch.zeros(3, 2), torch.ones(3, 2)
    tq = torch.tensor([0.2, 0.3, 0.5])
    v = rvge.target_velocity(v_old, d_B, tq, 0.3, s2)
    assert torch.allclose(v[1], -d_B[1] / 0.3)  # at t = t_b: d(t) = d_B


# -----------------------------------------------------------------------------
# The SDE step (DESIGN §1)
# -----------------------------------------------------------------------------


def test_sde_step_is_the_reverse_sde_euler_maruyama_step():
    x, v, s, s_next, a, s1 = 0.3, -1.2, 0.6, 0.5, 0.7, 0.9
    g2 = a * a * s / (1 - s)
    score = -(x + (1 - s) * v) / s  # from v = -(x + t score) / (1 - t)
    drift = v - g2 / 2 * score
    assert math.isclose(recast.sde_step(x, v, s, s_next, a, s1, 0.0), x + drift * (s_next - s))
    assert math.isclose(recast.sde_step(x, v, s, s_next, a, s1, 1.0) - recast.sde_step(x, v, s, s_next, a, s1, 0.0),
                        math.sqrt(g2 * (s - s_next)))
    # at s = 1 the denominator uses s_1
    assert math.isfinite(recast.sde_step(x, v, 1.0, 0.9, a, 0.9, 1.0))
