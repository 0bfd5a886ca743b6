"""The Gaussian-mixture toy: toy_gaussian.py's checks and experiments/toy_checks.py's (6d, 7) at quick sizes; the
trainable toy, experiments/toy_train.py."""

import re

import pytest

# -----------------------------------------------------------------------------
# The Gaussian-mixture toy: every check of toy_gaussian.py, quick sizes
# -----------------------------------------------------------------------------


def quick_rows_all_pass(main, tmp_path, capsys):
    """Run a check runner (toy_gaussian.run_checks behind `main`) at --quick into tmp_path: exit code 0, no FAIL, every
    row passed. Returns the number of rows."""
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    passed = re.search(r"(\d+)/(\d+) passed", table)
    assert "FAIL" not in table and passed and passed.group(1) == passed.group(2)
    return int(passed.group(2))


@pytest.mark.long(120)  # seconds on a 2-core machine, for the order only
def test_toy_gaussian_quick_passes_every_check(tmp_path, capsys):
    import toy_gaussian

    assert quick_rows_all_pass(toy_gaussian.main, tmp_path, capsys) >= 40
    assert len(list(tmp_path.glob("*.png"))) >= 5


@pytest.mark.long(30)  # seconds on a 2-core machine, for the order only
def test_toy_checks_6d_and_7_quick_pass_every_check(tmp_path, capsys):
    """Checks 6d and 7 (experiments/toy_checks.py) through toy_gaussian's runner: every row passes, figure and CSV."""
    from experiments import toy_checks

    assert quick_rows_all_pass(toy_checks.main, tmp_path, capsys) >= 20
    assert {p.name for p in tmp_path.iterdir()} == {"6d_rvge_diagnosis.csv", "7_end_to_end.png"}


# -----------------------------------------------------------------------------
# experiments/toy_train.py: the trainable toy (every arm runs, quantities finite and paired), its pure functions
# -----------------------------------------------------------------------------


def test_train_quick_runs_every_arm_paired(tmp_path):
    import csv
    import json

    import numpy as np

    from experiments import toy_train as tt

    assert tt.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    cfg = tt.QUICK_TRAIN
    cells = {}
    for r in rows:
        for k in ("kl", "coarse", "fine", "discrete"):
            assert np.isfinite(float(r[k])), r
        cells.setdefault((r["family"], int(r["groups"]), r["arm"]), {}).setdefault(int(r["seed"]), []).append(r)
    expected = {
        (f, P, a) for P in cfg.groups for f, arms in (("recast", tt.RECAST_ARMS), ("rvge", tt.RVGE_ARMS)) for a in arms
    }
    assert set(cells) == expected
    seeds = set(range(cfg.seed0, cfg.seed0 + cfg.seeds))
    n_evals = len(range(0, cfg.iterations + 1, cfg.eval_every)) + (cfg.iterations % cfg.eval_every != 0)
    for key, per_seed in cells.items():
        assert set(per_seed) == seeds, key  # the same seeds in every arm
        assert all(len(v) == n_evals for v in per_seed.values()), key
    # paired: at iteration 0 every arm of a seed is the exact model on the same evaluation noise -> identical numbers
    for (family, P, _), per_seed in cells.items():
        for seed, evals in per_seed.items():
            first = next(e for e in evals if e["iteration"] == "0")
            ref = next(
                e
                for e in cells[(family, P, tt.RECAST_ARMS[0] if family == "recast" else tt.RVGE_ARMS[0])][seed]
                if e["iteration"] == "0"
            )
            assert first["coarse"] == ref["coarse"] and first["fine"] == ref["fine"] and float(first["kl"]) == 0.0
    # training moved every run away from the exact model (KL > 0 at the end)
    assert all(
        float(e["kl"]) > 0 for v in cells.values() for evals in v.values() for e in evals if e["iteration"] != "0"
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {"recast", "rvge", "rvge_controls", "power", "profiles"} <= set(summary)
    assert (tmp_path / "tables.md").exists() and (tmp_path / "reward_vs_kl.png").exists()
    # the tables regenerate from the committed files alone
    tables = (tmp_path / "tables.md").read_text()
    assert tt.main(["--tables-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "tables.md").read_text() == tables


def test_stacked_W_mix_optimality_equals_per_run_calls():
    import numpy as np
    import torch

    import recast
    from experiments import toy_train as tt

    rng = np.random.default_rng(0)
    S, K, T, N = 4, 2, 10, 7
    lam = np.array([0.7, 1.3])
    W = np.stack([recast.solve_W(lam, recast.profiles(rng.random((K, T)) ** 3)) for _ in range(S)])
    r = torch.as_tensor(rng.random((S, N, K)))
    step = torch.as_tensor(rng.integers(0, T, (S, N)))
    W_t = torch.as_tensor(W)
    stacked = recast.mix_optimality(
        r.reshape(S * N, K), tt.stack_columns(W_t), (torch.arange(S)[:, None] * T + step).ravel()
    )
    per_run = torch.stack([recast.mix_optimality(r[i], W_t[i], step[i]) for i in range(S)])
    assert torch.allclose(stacked.reshape(S, N), per_run, rtol=0, atol=1e-14)


def test_batched_rvge_targets_equal_per_run_calls():
    import numpy as np
    import torch

    import rvge

    rng = np.random.default_rng(1)
    S, N, d, P = 3, 16, 2, 2
    x0 = torch.as_tensor(rng.standard_normal((S, N, d)))
    A = torch.as_tensor(rng.standard_normal((S, N)))
    groups = np.repeat(np.arange(P), N // P)
    ids = (np.arange(S)[:, None] * P + groups[None]).ravel()
    d_all = rvge.group_directions(x0.reshape(S * N, d), A.reshape(-1), ids, None, 0.2).reshape(S, N, d)
    d_each = torch.stack([rvge.group_directions(x0[i], A[i], groups, None, 0.2) for i in range(S)])
    assert torch.allclose(d_all, d_each, rtol=0, atol=1e-14)
    s2 = np.array([np.divide(*rvge.group_variance(x0[i], groups)) for i in range(S)])
    t = torch.as_tensor(rng.uniform(0.05, 1, S * N))
    v_old = torch.as_tensor(rng.standard_normal((S * N, d)))
    s2_t = torch.as_tensor(np.repeat(s2, N))
    batched = rvge.target_velocity(v_old, d_all.reshape(S * N, d), t, 1.0, s2_t)
    qw = rvge.query_weight(t, 1.0, s2_t)
    for i in range(S):
        rows = slice(i * N, (i + 1) * N)
        one = rvge.target_velocity(v_old[rows], d_each[i], t[rows], 1.0, float(s2[i]))
        assert torch.allclose(batched[rows], one, rtol=0, atol=1e-12)
        assert torch.allclose(qw[rows], rvge.query_weight(t[rows], 1.0, float(s2[i])), rtol=0, atol=1e-14)


def test_reversed_W_has_the_same_marginals_and_is_the_flipped_W():
    import numpy as np

    import recast
    from experiments import toy_train as tt

    rng = np.random.default_rng(2)
    lam, T = np.array([0.5, 1.0, 1.5]), 10
    P = recast.profiles(rng.random((3, T)) ** 4)
    W, W_rev = recast.solve_W(lam, P), tt.reversed_W(lam, P)
    assert np.allclose(W_rev.sum(1), lam, atol=1e-9) and np.allclose(W_rev.sum(0), lam.sum() / T, atol=1e-9)
    assert np.allclose(W_rev, W[:, ::-1], atol=1e-9)
    assert np.abs(W_rev - W).max() > 0.01  # a real control: it differs from W


def test_per_run_clip_matches_clip_grad_norm_run_by_run():
    import torch

    from experiments import toy_train as tt

    g = torch.randn(5, 3, 4, 2, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [0.1, 1, 5, 20, 0.5]
    ).reshape(-1, 1, 1, 1)
    ref = []
    for i in range(5):
        p = torch.nn.Parameter(torch.zeros(3, 4, 2))
        p.grad = g[i].clone()
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        ref.append(p.grad)
    tt.per_run_clip(g, 1.0)
    assert torch.allclose(g, torch.stack(ref), rtol=1e-5, atol=1e-7)


def test_analysis_helpers_on_hand_cases():
    import numpy as np

    from experiments import toy_train as tt

    x, y = np.array([0.0, 1.0, 2.0, 4.0]), np.array([0.0, 0.1, 0.3, 0.5])
    assert np.isclose(tt.value_at_level(x, y, 3.0), 0.4) and np.isnan(tt.value_at_level(x, y, 5.0))
    # a reached at 1, b censored at 3: a wins; a censored at 2, b reached at 3: not comparable (tie);
    # both censored: tie; b reached first: a loss
    w, lo, ties, _ = tt.paired_censored(
        [1.0, 2.0, 5.0, 2.0], [True, False, False, True], [3.0, 3.0, 5.0, 1.0], [False, True, False, True]
    )
    assert (w, lo, ties) == (1, 1, 2)


def test_online_quick_runs_every_arm_paired_and_regenerates(tmp_path):
    import json

    import numpy as np

    from experiments import toy_train as tt

    assert tt.main(["--online", "--quick", "--out", str(tmp_path)]) == 0
    records, credit, cfg, _, _ = tt.read_online_run(str(tmp_path))
    assert cfg == tt.QUICK_ONLINE
    seeds = set(range(cfg.seed0, cfg.seed0 + cfg.seeds))
    for P in cfg.groups:
        arms = tt.arms_at(cfg, P)
        assert (arms == cfg.largest_arms) == (P != min(cfg.groups))  # every arm at the smallest size only
        got = {(r["arm"], r["seed"]) for r in records if r["groups"] == P}
        assert got == {(a, s) for a in arms for s in seeds}
        first = {r["arm"]: r for r in records if r["groups"] == P and r["iteration"] == 0 and r["seed"] == cfg.seed0}
        assert len({(r["coarse"], r["mid"], r["kl"]) for r in first.values()}) == 1  # paired: the same exact model
    # every online run and every prior measurement reports its W's distance to the exact W and its evidence weight
    kinds = {(c["arm"], c["groups"]) for c in credit}
    assert {(f"prior{n}", 0) for n in cfg.prior_groups} <= kinds
    assert {("online", P) for P in cfg.groups} | {("online_noshrink", P) for P in cfg.groups} <= kinds
    assert all(np.isfinite(c["W_distance"]) and len(c["rho"]) == 2 for c in credit)
    assert all(c["rho"] == [1.0, 1.0] for c in credit if c["arm"] == "online_noshrink")  # evidence weight 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sum("p_holm" in r for r in summary["recast"]) == 14  # the pre-registered family
    tables = (tmp_path / "tables.md").read_text()
    assert tt.main(["--online", "--tables-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "tables.md").read_text() == tables


def test_online_groups_appends_a_batch_size_without_rerunning_the_others(tmp_path, monkeypatch):
    """--online --groups N appends N to the run in --out: only N is trained (largest_arms), the files are what one
    run of all three sizes writes, and the Holm family grows to every size's comparisons."""
    import json
    from dataclasses import replace

    import pytest

    from experiments import toy_train as tt

    three = replace(tt.QUICK_ONLINE, groups=tt.QUICK_ONLINE.groups + (4,))
    assert tt.online_main(True, str(tmp_path / "once"), three) == 0
    assert tt.main(["--online", "--quick", "--out", str(tmp_path / "added")]) == 0
    trained, train_batch = [], tt.train_batch
    monkeypatch.setattr(
        tt,
        "train_batch",
        lambda plan, cfg, P, *a, **k: trained.append((P, plan.arms)) or train_batch(plan, cfg, P, *a, **k),
    )
    monkeypatch.setattr(tt, "measured_prior", lambda *a: pytest.fail("a prior measured again"))
    assert tt.main(["--online", "--groups", "4", "--out", str(tmp_path / "added")]) == 0
    assert trained == [(4, tt.QUICK_ONLINE.largest_arms)]  # 2 and 3 not rerun
    for name in ("runs.csv", "credit.json"):
        assert (tmp_path / "added" / name).read_text() == (tmp_path / "once" / name).read_text()
    once, added = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("once", "added"))
    assert {k: v for k, v in added.items() if k != "seconds"} == {k: v for k, v in once.items() if k != "seconds"}
    assert sum("p_holm" in r for r in added["recast"]) == 20  # one family over the three sizes
    with pytest.raises(SystemExit, match="add a new size"):
        tt.main(["--online", "--groups", "3", "--out", str(tmp_path / "added")])


def test_tree_sampler_keeps_children_equal_until_the_branch():
    import numpy as np
    import torch

    import nft
    from experiments import toy_train as tt

    sig = nft.shifted_sigmas(10, 3.0)
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn((1, 3, 2, 1, 2), generator=g).expand(1, 3, 2, 4, 2)
    z = torch.randn((10, 2, 1, 3, 2, 4, 2), generator=g)
    branch = np.array([1, 4, 8])
    x0 = tt.sample_tree(tt.ONLINE_MIX, None, None, sig, np.sqrt(2), x1, z, branch, 2).reshape(3, 2, 4, 2)
    assert torch.isfinite(x0).all() and (x0[:, :, 1:] != x0[:, :, :1]).any(-1).all()  # children split after branching
    # the ODE before the branch is deterministic: a group branching at the last SDE step differs only by that step
    z2 = z.clone()
    z2[:8] = torch.randn(z2[:8].shape, generator=g)
    x0b = tt.sample_tree(tt.ONLINE_MIX, None, None, sig, np.sqrt(2), x1, z2, branch, 2).reshape(3, 2, 4, 2)
    assert torch.equal(x0[2], x0b[2]) and not torch.equal(x0[0], x0b[0])
