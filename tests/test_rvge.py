"""RVGE math (NOTES.md §4): value directions, transfer, regression groups and bandwidths, by hand and
against closed forms. The end-to-end runs of rvge.py are in test_recast.py (parametrised over both scripts).
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import nft
import rvge

# -----------------------------------------------------------------------------
# RVGE math (NOTES.md §4)
# -----------------------------------------------------------------------------


def test_value_direction_by_hand_and_ties():
    x0 = np.array([[0.0, 1.0], [2.0, 1.0], [4.0, 4.0]])
    R = np.array([0.0, 1.0, 2.0])
    # centred: R - 1 = (-1, 0, 1); x0 - mean = ((-2,-1), (0,-1), (2,2)); 1/(G-1) sum = (4, 3) / 2
    assert np.allclose(rvge.value_direction(x0, R), [2.0, 1.5])
    assert np.array_equal(rvge.value_direction(x0[:1], R[:1]), np.zeros(2))  # one sample: no contrast
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
    post_mean = (1 - t) * s2 / ((1 - t) ** 2 * s2 + t**2) * x_t
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
    assert np.allclose(kappa, s2 - s2**2 * (1 - t) ** 2 / ((1 - t) ** 2 * s2 + t**2))
    assert np.allclose(rvge.transfer_ratio(t, 0.3, s2, cap=1e9), kappa / rvge.posterior_var(0.3, s2))
    assert rvge.transfer_ratio(1.0, 0.05, s2, cap=4.0) == 4.0
    qw = rvge.query_weight(t, 0.3, s2)
    assert np.all(qw[t <= 0.3] == 1.0) and np.all(qw[t > 0.3] < 1.0)
    v_old, d_B = torch.zeros(3, 2), torch.ones(3, 2)
    tq = torch.tensor([0.2, 0.3, 0.5])
    v = rvge.target_velocity(v_old, d_B, tq, 0.3, s2)
    assert torch.allclose(v[1], -d_B[1] / 0.3)  # at t = t_b: d(t) = d_B


def hand_tree(P, R, C, L=1):
    """(groups, ancestry) exactly as tree_rollout builds them: P prompts x R roots, each state copied C times
    at each of L branch steps (repeat_interleave: leaf i descends from root i // C^L)."""
    roots = np.arange(P * R)
    groups, ancestry = roots // R, [roots]
    for _ in range(L):
        groups, ancestry = groups.repeat(C), [a.repeat(C) for a in ancestry] + [np.tile(np.arange(C), len(groups))]
    return groups, np.stack(ancestry, 1)


@pytest.mark.parametrize("L", [1, 2])
def test_local_and_broad_groups_are_like_for_like(L):
    P, R, C = 2, 3, 3
    groups, ancestry = hand_tree(P, R, C, L)
    local, broad = rvge.regression_groups(groups, ancestry, True), rvge.regression_groups(groups, ancestry, False)
    assert (np.bincount(local) == C).all() and (np.bincount(broad) == R).all()  # same size, same leaves
    for g in np.unique(local):  # the C siblings of one state at the last branch step
        rows = ancestry[local == g]
        assert (rows[:, :-1] == rows[0, :-1]).all() and sorted(rows[:, -1]) == list(range(C))
    for g in np.unique(broad):  # one leaf per root of one prompt, all with the same branch indices
        rows, members = ancestry[broad == g], np.flatnonzero(broad == g)
        assert len(set(rows[:, 0])) == R and len(set(groups[members])) == 1 and (rows[:, 1:] == rows[0, 1:]).all()
    # no branch step: the broad group is the prompt group
    assert (rvge.regression_groups(groups, ancestry[:, :1], False) == groups).all()


def test_split_bandwidth_transfer_and_query_weight_ablations_change_the_target():
    s2, t_b, cap = 0.5, 0.4, 1e9
    t = torch.tensor([0.2, 0.4, 0.7], dtype=torch.float64)
    v_old, d_loc, d_br = (
        torch.zeros(3, 2, dtype=torch.float64),
        torch.ones(3, 2, dtype=torch.float64),
        torch.full((3, 2), 2.0, dtype=torch.float64),
    )
    tb = torch.full((3,), t_b, dtype=torch.float64)
    kappa = lambda x: rvge.posterior_var(x, s2)  # noqa: E731
    shift = lambda v: (-v[:, 0] * t).numpy()  # d(t) per query  # noqa: E731
    target = lambda bw, **kw: rvge.reward_target(v_old, t, rvge.RewardDirections(bw, d_loc, d_br, tb), s2, cap, **kw)  # noqa: E731
    ratio_loc, ratio_br = (kappa(t) / kappa(t_b)).numpy(), (kappa(t) / kappa(1.0)).numpy()
    v, q = target("split")
    assert (
        np.allclose(shift(v), [ratio_loc[0], 1.0, 2 * ratio_br[2]]) and (q == 1).all()
    )  # local below t_b, broad above
    assert np.allclose(shift(target("local")[0]), ratio_loc) and np.allclose(shift(target("broad")[0]), 2 * ratio_br)
    assert np.allclose(shift(target("split", transfer="none")[0]), [1.0, 1.0, 2.0])  # no transfer: d(t) = d_B
    v, q = target("local", query_weights="on")
    assert np.allclose(q.numpy(), [1.0, 1.0, kappa(t_b) / kappa(0.7)])
    assert np.isclose(q[2] * shift(v)[2], 1.0)  # weight x ratio = 1 above t_b: the weight undoes the transfer
    assert (target("split", query_weights="on")[1] == 1).all()  # the broad group's t_b = 1: nothing to weight
    assert (target("local", query_weights="off")[1] == 1).all()


def test_auto_bandwidth_picks_broad_for_tied_rewards_and_split_for_smooth_ones():
    assert rvge.pick_bandwidth("auto", 0.5, 0.2) == "broad" and rvge.pick_bandwidth("auto", 0.0, 0.2) == "split"
    assert all(rvge.pick_bandwidth(b, 0.9, 0.2) == b for b in ("local", "broad", "split"))
    P, R, C = 2, 4, 4
    groups, ancestry = hand_tree(P, R, C)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(len(groups), 3, 2, 2, generator=gen)
    smooth = x0.flatten(1) @ torch.randn(12, generator=gen)
    coarse = (ancestry[:, 0] % 2).astype(float)  # a 0/1 reward set by the root: siblings always tie
    A = nft.advantages(np.stack([smooth.numpy(), coarse], 1), groups)
    b = SimpleNamespace(leaves=x0, groups=groups, ancestry=ancestry)
    sigmas = torch.linspace(1, 0, 11)
    dirs, s2, m = rvge.value_directions(
        b, A, sigmas, [7], ["auto", "auto"], ["smooth", "coarse"], rvge.Args(), np.asarray
    )
    assert [d.bandwidth for d in dirs] == ["split", "broad"] and m["rvge/tie_share/coarse"] == 1.0
    assert m["rvge/group_size/smooth"] == m["rvge/group_size/coarse"] == 4.0
    assert np.isclose(m["rvge/t_b/smooth"], float(sigmas[7])) and m["rvge/t_b/coarse"] == 1.0
    assert dirs[1].local is None and torch.allclose(
        dirs[1].broad,
        rvge.group_directions(
            x0, torch.tensor(A[:, 1]).float(), rvge.regression_groups(groups, ancestry, False), eta=0.2
        ),
    )
    broad = rvge.regression_groups(
        groups, ancestry, False
    )  # s2: unbiased variance around the broad (independent) groups
    dev = torch.cat([x0[broad == g] - x0[broad == g].mean(0) for g in np.unique(broad)])
    assert np.isclose(s2, float(dev.pow(2).sum()) / ((R - 1) * len(np.unique(broad)) * 12))


def test_noisy_coordinates_come_from_each_leafs_own_trajectory():
    assert rvge.coordinate_steps("clean", [7]) == () and rvge.coordinate_steps("noisy", [7]) == (1, 8)
    assert rvge.coordinate_steps("noisy", [1]) == (1, 2) and rvge.coordinate_steps("noisy", []) == (1,)
    P, R, C = 2, 3, 2
    groups, ancestry = hand_tree(P, R, C)
    states = torch.arange(P * R, dtype=torch.float32).view(-1, 1) * torch.ones(1, 2)  # step 1: one state per root
    leaves_states = torch.arange(len(groups), dtype=torch.float32).view(-1, 1) * torch.ones(
        1, 2
    )  # step 8: one per leaf
    probes = [(1, states, None), (8, leaves_states, None)]
    assert torch.equal(
        rvge.denoised_coordinates(probes, 1, len(groups))[:, 0], torch.as_tensor(ancestry[:, 0], dtype=torch.float32)
    )
    assert torch.equal(rvge.denoised_coordinates(probes, 8, len(groups)), leaves_states)
    x0 = torch.randn(len(groups), 2, generator=torch.Generator().manual_seed(1))
    b = SimpleNamespace(leaves=x0, groups=groups, ancestry=ancestry, probes=probes)
    A = nft.advantages(x0[:, :1].double().numpy(), groups)
    sig = torch.linspace(1, 0, 11)
    clean, _, _ = rvge.value_directions(b, A, sig, [7], ["split"], ["r"], rvge.Args(), np.asarray)
    noisy, _, _ = rvge.value_directions(b, A, sig, [7], ["split"], ["r"], rvge.Args(coords="noisy"), np.asarray)
    A_t = torch.tensor(A[:, 0]).float()
    assert torch.allclose(
        clean[0].local, rvge.group_directions(x0, A_t, rvge.regression_groups(groups, ancestry, True), eta=0.2)
    )
    assert torch.allclose(
        noisy[0].local,
        rvge.group_directions(leaves_states, A_t, rvge.regression_groups(groups, ancestry, True), eta=0.2),
    )
    assert torch.allclose(
        noisy[0].broad,
        rvge.group_directions(states[ancestry[:, 0]], A_t, rvge.regression_groups(groups, ancestry, False), eta=0.2),
    )
    assert not torch.allclose(noisy[0].local, clean[0].local)


def test_weighted_advantage_is_diffusionnfts_combined_advantage():
    R = np.random.default_rng(0).normal(size=(12, 3))
    groups = np.repeat(np.arange(3), 4)
    run = SimpleNamespace(reduce=np.asarray)
    A = rvge.weighted_advantage(SimpleNamespace(R=R, groups=groups), [0.5, 0.3, 0.2], run)
    Rc = R @ [0.5, 0.3, 0.2]
    centred = Rc - np.array([Rc[groups == g].mean() for g in groups])
    assert A.shape == (12, 1) and np.allclose(A[:, 0], centred / (Rc.std() + 1e-4))
