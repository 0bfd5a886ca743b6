"""Tests of the late-reward experiment's world (experiments/late_reward_world.py): its candidate rewards by hand, the
``signed`` world variant (rendering, reward, ideal observer, build at toy size), the gate script's set-up, and the
NFT-gradient laws that motivate a signed late reward (NOTES.md, "A learnable late reward"). CPU, < 1 min.
"""

import numpy as np
import pytest
from PIL import Image
from test_shapes_world import _textured

import world as sw
from experiments import late_reward_world as lrw


def test_smooth_texture_rewards_by_hand():
    """texture_soft = min(a, 1) - min(x, 1) for a named texture, 1 - min(max(ex, ey) / c, 1) for a plain caption
    (a, x: fine energy along / across the named lines in units of c = texture_contrast()); texture_along drops the
    across term. The striped square's ey / c is (light - dark) / (light + dark) / c (see the test above), ex = 0."""
    amp, c = sw.TEXTURE["amp"], sw.texture_contrast()
    light, dark = 215.0, np.round(215 * (1 - amp))
    e = (light - dark) / (light + dark) / c  # 0.9756 at amp 0.1: just under ground truth's 1 (uint8 rounding)
    striped, barred, plain = _textured("striped"), _textured("barred"), _textured("plain")
    soft, along = sw.REWARDS["texture_soft"], sw.REWARDS["texture_along"]
    caps = ["a red striped square", "a red barred square", "a red square"]
    assert soft([striped] * 3, caps) == pytest.approx([e, -e, 1 - e], abs=1e-9)
    assert soft([barred] * 3, caps) == pytest.approx([-e, e, 1 - e], abs=1e-9)
    assert along([striped] * 3, caps) == pytest.approx([e, 0.0, 1 - e], abs=1e-9)
    # a flat fill: nothing for a named texture, full marks for a plain caption; no object at all: 0
    assert soft([plain] * 3, caps).tolist() == [0.0, 0.0, 1.0] == along([plain] * 3, caps).tolist()
    blank = Image.new("RGB", (32, 32), (235, 235, 235))
    assert soft([blank] * 3, caps).tolist() == [0.0, 0.0, 0.0]
    # bounded at ground truth's level: lines at twice the amplitude score exactly 1 (not more)
    assert soft([_textured("striped", amp=2 * amp)], caps[:1])[0] == 1.0
    # fainter lines score in proportion: at half the amplitude about half
    assert soft([_textured("striped", amp=amp / 2)], caps[:1])[0] == pytest.approx(0.5, abs=0.05)
    # a plaid (lines both ways) is penalised for the other orientation in texture_soft, not in texture_along
    plaid = _textured("plaid")
    assert abs(soft([plaid], caps[:1])[0]) < 0.05 and along([plaid], caps[:1])[0] > 0.4
    # ground-truth renders score near the top, named and plain; the wrong texture scores below 0
    for i, p in enumerate(["a green barred circle", "two yellow striped squares", "a blue triangle on the left"]):
        im = sw.render(p, 40 + i)
        assert soft([im], [p])[0] > 0.9 and along([im], [p])[0] > 0.9
    assert soft([sw.render("a green barred circle", 40)], ["a green striped circle"])[0] < -0.5


def test_line_texture_rewards_by_hand():
    """texture_lines reads period-4 line amplitudes (row / column means, Fourier coefficient at period 4) in units of
    ground truth's. Rows of 2-on-2-off lines of depth d = light - dark sit at +-d / 2 from their mean; their period-4
    coefficient per 4 rows is (d / 2)(2 - 2i), so the amplitude 2 |c| / 4 = sqrt(2) d / 2, over the mean brightness
    (light + dark) / 2 and in units of sqrt(2) c: d / (light + dark) / c, the same number e as the second
    differences of the test above. The 14 inner rows are not a whole number of periods: a small leak, abs=0.01."""
    amp, c = sw.TEXTURE["amp"], sw.texture_contrast()
    light, dark = 215.0, np.round(215 * (1 - amp))
    e = (light - dark) / (light + dark) / c
    striped, barred, plain = _textured("striped"), _textured("barred"), _textured("plain")
    lines, along, locked = sw.REWARDS["texture_lines"], sw.REWARDS["lines_along"], sw.REWARDS["lines_locked"]
    caps = ["a red striped square", "a red barred square", "a red square"]
    assert lines([striped] * 3, caps) == pytest.approx([e, -e, 1 - e], abs=0.01)
    assert lines([barred] * 3, caps) == pytest.approx([-e, e, 1 - e], abs=0.01)
    assert along([striped] * 3, caps) == pytest.approx([e, 0.0, 1 - e], abs=0.01)
    assert lines([plain] * 3, caps).tolist() == [0.0, 0.0, 1.0]
    # period-2 noise (a 1-pixel checkerboard) is fine energy for texture_soft but no period-4 line: texture_lines
    # leaves a plain caption's fill at full marks, texture_soft does not
    a = np.asarray(plain, np.float64).copy()
    yy, xx = np.mgrid[:32, :32]
    a[(abs(yy - 15.5) < 8) & (abs(xx - 15.5) < 8) & ((yy + xx) % 2 == 0)] *= 1 - amp
    checker = Image.fromarray(np.round(a).astype(np.uint8))
    assert lines([checker], caps[2:])[0] == pytest.approx(1.0, abs=1e-9)
    assert sw.REWARDS["texture_soft"]([checker], caps[2:])[0] < 0.5
    # ground truth (random phase per object) scores near the top
    for i, p in enumerate(["a green barred circle", "two yellow striped squares", "a blue triangle on the left"]):
        assert lines([sw.render(p, 40 + i)], [p])[0] > 0.85
    # the phase-locked diagnostic: dark rows at 0, 1 mod 4 (the hand-drawn lines) give -e, shifted by 2 rows +e,
    # by 1 row 0 (a quarter period: the projection on the fixed phase vanishes)
    shifted = {k: Image.fromarray(np.roll(np.asarray(striped), k, axis=0)) for k in (1, 2)}
    assert locked([striped, shifted[2], shifted[1]], caps[:1] * 3) == pytest.approx([-e, e, 0.0], abs=0.01)
    # lines_phase: the same signed value for a named texture, 0 for a plain caption (its group ties), whatever it shows
    phase = sw.REWARDS["lines_phase"]
    assert phase([striped, shifted[2], shifted[1]], caps[:1] * 3) == pytest.approx([-e, e, 0.0], abs=0.01)
    assert phase([striped, plain, barred], caps[2:] * 3).tolist() == [0.0, 0.0, 0.0]
    assert phase([barred], caps[1:2])[0] == pytest.approx(-e, abs=0.01)


def test_the_signed_variant_changes_only_the_texture_phase_and_the_background():
    """The ``signed`` variant draws the shipped world's image for the same seed, with the texture at its fixed phase
    (dark rows / columns 0, 1 mod 4) and the background's signed lines: with sign 0 a plain caption's image is the
    shipped one byte for byte and a textured one differs only inside the objects; sign +1 darkens background pixels
    of rows 2, 3 mod 4 only, -1 those of rows 0, 1; the sign is ~50/50 over seeds and not the caption's."""
    from scipy import ndimage

    for i, p in enumerate(["two red circles", "a blue striped square on the left", "three green barred triangles"]):
        seed = 300 + i
        shipped = np.asarray(sw.render(p, seed), np.int64)
        zero = np.asarray(sw.render_spec(sw.parse_prompt(p), seed, "signed", sign=0), np.int64)
        fg = np.asarray(sw.render_spec(dict(sw.parse_prompt(p), texture=None), seed), np.int64)
        inside = ndimage.binary_dilation((fg.max(-1) - fg.min(-1)) > 30, iterations=2)
        if "texture" not in sw.parse_prompt(p):
            assert np.array_equal(shipped, zero)
        else:
            assert not np.array_equal(shipped[inside], zero[inside])
            assert np.array_equal(shipped[~inside], zero[~inside])
            tex = sw.parse_prompt(p)["texture"]
            yy, xx = np.mgrid[:32, :32]
            dark = ((yy if tex == "striped" else xx) % 4) < 2
            core = ndimage.binary_erosion((fg.max(-1) - fg.min(-1)) > 60, iterations=1)
            assert (zero.sum(-1)[core & dark] < fg.sum(-1)[core & dark]).all()  # the fixed phase is the dark one
            assert np.array_equal(zero[core & ~dark], fg[core & ~dark])
        rows = np.arange(32)[:, None] % 4
        for sign, darkened in ((1, rows >= 2), (-1, rows < 2)):
            lined = np.asarray(sw.render_spec(sw.parse_prompt(p), seed, "signed", sign=sign), np.int64)
            diff = (lined - zero).sum(-1)
            assert (diff <= 0).all() and (diff[~inside] < 0).any()
            assert not diff[np.broadcast_to(~darkened, diff.shape)].any()
        drawn = lrw.variant_sign(seed)
        assert np.array_equal(
            np.asarray(sw.render(p, seed, "signed")),
            np.asarray(sw.render_spec(sw.parse_prompt(p), seed, "signed", sign=drawn)),
        )
    signs = np.array([lrw.variant_sign(s) for s in range(4000)])
    assert set(signs.tolist()) == {-1, 1} and abs(signs.mean()) < 0.05
    with pytest.raises(ValueError, match="unknown world variant"):
        sw.render("a red circle", 0, "nope")


def test_the_signed_reward_by_hand():
    """reward_signed reads the background's period-4 rows at the variant's + phase in units of ground truth's (2-pixel
    lines ``depth`` grey levels deep): lines 8 depths deep give 8, the opposite phase -8, a quarter period off 0, a
    flat background 0; ground truth of both signs +1 / -1 and the shipped world's 0; the caption is not read."""
    depth = lrw.VARIANTS["signed"]["depth"]
    light = 235.0
    dark = light - 8 * depth  # 8x the variant's lines: 8 in its units
    e = 8.0
    yy = np.mgrid[:32, :32][0]
    flat = np.full((32, 32, 3), light)

    def lines(offset):
        a = flat.copy()
        a[((yy + offset) % 4) >= 2] = dark
        return Image.fromarray(a.astype(np.uint8))

    signed = sw.REWARDS["signed"]
    raw = [lrw.signed_amplitude(im) for im in (lines(0), lines(2), lines(1), Image.fromarray(flat.astype(np.uint8)))]
    assert raw == pytest.approx([e, -e, 0.0, 0.0], abs=0.02 * e)
    assert signed([lines(0), lines(2)], ["a red circle"] * 2).tolist() == [1.0, -1.0]  # clipped
    caps = sw.sample_prompts(24, "heldout", 5)
    plus = [sw.render_spec(sw.parse_prompt(p), 60 + i, "signed", sign=1) for i, p in enumerate(caps)]
    minus = [sw.render_spec(sw.parse_prompt(p), 60 + i, "signed", sign=-1) for i, p in enumerate(caps)]
    assert signed(plus, caps).min() > 0.9 and signed(minus, caps).max() < -0.9
    assert abs(signed(plus, caps).mean() - 1) < 0.02 and abs(signed(minus, caps).mean() + 1) < 0.02
    shipped = [sw.render(p, 60 + i) for i, p in enumerate(caps)]
    assert np.abs(signed(shipped, caps)).max() < 1e-9
    assert signed(plus, caps).tolist() == signed(plus, caps[::-1]).tolist() == signed(plus, None).tolist()
    assert signed([Image.new("RGB", (32, 32), (215, 45, 45))], None).tolist() == [0.0]  # no background at all


def test_the_signs_ideal_observer_against_monte_carlo():
    """NOTES.md, "A late reward by design: the sign's ideal observer". A sign s = +-1 of a pattern of latent norm a,
    other data n ~ N(0, v) along it, x_t = (1 - t) x0 + t eps seen along the pattern: y = (1 - t)(s a + n) + t eps.
    The posterior mean is tanh((1 - t) a y / ((1 - t)^2 v + t^2)) (binned Monte Carlo), the share of the sign's D(0)
    decided, Var(E[s | y]) = E[tanh^2], is sign_share_decided(kappa) with kappa = sign_kappa(t, a, noise), and
    sign_amplitude_for puts it at 1/2 at t_half. Dropping the data's own variance v from the noise fails."""
    rng = np.random.default_rng(0)
    M = 400_000
    for t, amp, v in ((0.3, 0.5, 0.15), (0.5, 1.0, 0.3), (0.8, 4.0, 8.0)):
        s = rng.choice([-1.0, 1.0], M)
        y = (1 - t) * (s * amp + np.sqrt(v) * rng.standard_normal(M)) + t * rng.standard_normal(M)
        noise = (1 - t) ** 2 * v + t**2
        post = np.tanh((1 - t) * amp * y / noise)
        edges = np.quantile(y, np.linspace(0, 1, 21))
        which = np.clip(np.searchsorted(edges, y) - 1, 0, 19)
        for b in range(20):
            sel = which == b
            se = s[sel].std() / np.sqrt(sel.sum())
            assert abs(s[sel].mean() - post[sel].mean()) < 4 * se + 1e-3, (t, b)
        share = float(lrw.sign_share_decided(lrw.sign_kappa(t, amp, noise)))
        assert abs((post**2).mean() - share) < 0.005 and abs((s * post).mean() - share) < 0.006
        wrong = float(lrw.sign_share_decided(lrw.sign_kappa(t, amp, t**2)))  # the data's own variance left out
        assert abs(wrong - (post**2).mean()) > 0.02
    for t_half, noise in ((0.3, 0.09), (0.45, 0.2)):
        a = lrw.sign_amplitude_for(t_half, noise)
        assert float(lrw.sign_share_decided(lrw.sign_kappa(t_half, a, noise))) == pytest.approx(0.5, abs=1e-6)
        assert float(lrw.sign_share_decided(lrw.sign_kappa(t_half, a, noise) * 2)) > 0.5


def test_per_group_signal_to_noise_of_a_signed_reward_follows_the_law():
    """NOTES.md, "A late reward by design": with nft.optimality's r on a group of n leaves whose reward is the sign s
    (50/50), x0 = s a u + rest, x0_hat = a E[s | y] u (rest unknown: error -rest, d numbers of variance sigma^2), the
    groups' moves sum_i (2 r_i - 1)(x0_i - x0_hat_i) have the per-group signal to noise
    s = (n - 1) a^2 (1 - m)^2 / (d sigma^2 + a^2 (1 - m)), m the share of the sign decided (E[s E[s | y]] = m);
    it grows with n - 1 and with the pattern's share of the x0 error. Measured with phase_gate's statistic."""
    import importlib.util
    from pathlib import Path

    import nft

    path = Path(__file__).resolve().parents[1] / "experiments" / "results" / "late-reward" / "phase_gate.py"
    spec = importlib.util.spec_from_file_location("phase_gate_for_test", path)
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)
    rng = np.random.default_rng(3)
    G, d, sigma2, amp, kappa = 3000, 48, 0.02, 0.5, 0.85
    for n in (4, 8, 16):
        s = rng.choice([-1.0, 1.0], (G, n))
        y = np.sqrt(kappa) * s + rng.standard_normal((G, n))  # the sign seen at kappa (m ~ 1/2)
        post = np.tanh(np.sqrt(kappa) * y)
        m = float(lrw.sign_share_decided(kappa))
        rest = np.sqrt(sigma2) * rng.standard_normal((G, n, d))
        err = np.concatenate([(amp * (s - post))[..., None], rest], -1)  # x0 - x0_hat: u first, then the rest
        r = nft.optimality(s.reshape(-1), np.repeat(np.arange(G), n), std=np.ones(1)).reshape(G, n)
        moves = ((2 * r - 1)[..., None] * err).sum(1)
        got = gate.signal(moves @ moves.T)[0]
        law = (n - 1) * amp**2 * (1 - m) ** 2 / (d * sigma2 + amp**2 * (1 - m))
        assert got == pytest.approx(law, rel=0.15), (n, got, law)


def test_a_world_variant_builds_at_toy_size_into_its_own_folder(tmp_path):
    """`experiments/late_reward_world.py build --variant signed` at toy sizes: the pipeline goes to its own folder
    with the variant's marker, a world.json naming the experiment's module as its world, and its own world id; the
    scripts take it as the embedded model (kit.worlds.is_embedded), the shipped VAE's encoder is kept exactly (only the
    decoder learns: every latent of the shipped world stays what the transformer learned), and the shipped assets are
    untouched; the shipped folder is refused as --out."""
    import json

    from safetensors.torch import load_file

    from kit import worlds

    shipped = sw.world_id()
    out = tmp_path / "assets-signed"
    m = lrw.build_variant("signed", out, n_images=16, vae_steps=2, transformer_steps=2, eval_n=4)
    path = out / "shapes-sd3"
    marker = json.loads((path / lrw.VARIANT_FILE).read_text())
    assert marker["variant"] == "signed" and marker["base_world"] == shipped == m["base_world"]
    assert marker["depth"] == lrw.VARIANTS["signed"]["depth"]
    assert json.loads((path / sw.WORLD_FILE).read_text())["module"] == lrw.MODULE == lrw.__name__
    assert sw.world_id() == shipped and m["world"] == sw.world_id(path) != shipped
    assert worlds.is_embedded(str(path)) and worlds.is_embedded(worlds.EMBEDDED_MODEL)
    assert not worlds.is_embedded(str(tmp_path))
    old = load_file(str(sw.PIPELINE_DIR / "vae" / "diffusion_pytorch_model.safetensors"))
    new = load_file(str(path / "vae" / "diffusion_pytorch_model.safetensors"))
    enc = [k for k in old if k.startswith(("encoder.", "quant_conv."))]
    assert enc and all(np.array_equal(old[k].numpy(), new[k].numpy()) for k in enc)
    assert any(not np.array_equal(old[k].numpy(), new[k].numpy()) for k in old if k.startswith("decoder."))
    assert (out / "build_metrics.json").is_file() and "gen_positive_share_of_decided" in m
    with pytest.raises(SystemExit, match="its own folder"):
        lrw.build_variant("signed", sw.ASSETS)


def test_phase_gate_reads_another_candidate_on_another_world(monkeypatch):
    """phase_gate.py --candidate signed --model FOLDER --prefix NAME [--n-roots N]: the candidate is row 0 of both
    parts (the comparisons saturation, geneval, grain, texture_lines stay), the runs load FOLDER with N roots per
    prompt, and the result files are named NAME_*; the defaults are candidate (a)'s."""
    import importlib.util
    from pathlib import Path

    import recast

    path = Path(__file__).resolve().parents[1] / "experiments" / "results" / "late-reward" / "phase_gate.py"
    spec = importlib.util.spec_from_file_location("phase_gate_for_test2", path)
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)
    assert gate.PROFILE_REWARDS[0] == gate.SPLIT_REWARDS[0] == "lines_phase" and gate.MODEL is None
    monkeypatch.setattr(recast, "setup_run", lambda args: "run")
    folder = str(sw.PIPELINE_DIR)
    gate.use_candidate("signed", folder, "signed_gate")
    assert gate.PROFILE_REWARDS == ("signed", "saturation", "geneval", "grain", "texture_lines")
    assert gate.SPLIT_REWARDS == ("signed", "saturation", "grain", "texture_lines") and gate.PREFIX == "signed_gate"
    args, run = gate.setup(gate.SPLIT_REWARDS, 0, 8, "/tmp/unused")
    assert run == "run" and args.model == folder and args.rewards == "signed,saturation,grain,texture_lines"
    assert args.n_roots * args.n_branch == 8
    gate.use_candidate("signed", folder, "signed_gate16", n_roots=4)
    assert gate.setup(gate.SPLIT_REWARDS, 0, 8, "/tmp/unused")[0].n_roots == 4


def test_phase_gate_part3_step_arms_fit_recast(tmp_path, monkeypatch):
    """Part 3's two W rows (phase_gate.py weights): weight only at t >= 0.7 (steps 0-5 of the 10-step grid) or only
    at t <= 0.47 (steps 7-9), equal within the arm, each summing to 1; the files it writes pass recast.py's own
    --credit-file check for a one-reward run of the candidate, and a file naming another reward is refused."""
    import importlib.util
    import json
    from pathlib import Path

    import recast
    import recast_controls

    path = Path(__file__).resolve().parents[1] / "experiments" / "results" / "late-reward" / "phase_gate.py"
    spec = importlib.util.spec_from_file_location("phase_gate_for_test3", path)
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)
    t = np.array([1.0, 0.96, 0.913, 0.858, 0.79, 0.707, 0.602, 0.465, 0.278, 0.009])
    arms = gate.step_arms(t)
    assert np.flatnonzero(arms["early"]).tolist() == [0, 1, 2, 3, 4, 5]
    assert np.flatnonzero(arms["late"]).tolist() == [7, 8, 9]
    assert arms["early"][0] == pytest.approx(1 / 6) and arms["late"][9] == pytest.approx(1 / 3)
    assert all(w.sum() == pytest.approx(1.0) for w in arms.values())
    gate.use_candidate("signed", None, "test_gate")
    monkeypatch.setattr(gate, "HERE", tmp_path)
    gate.weights(None)
    for label in ("early", "late"):
        f = tmp_path / f"test_gate_W_{label}.json"
        args = recast.parse_args(["--rewards", "signed", "--budgets", "1", "--credit", "file", "--credit-file", str(f)])
        W = recast_controls.fixed_W_of(args, ["signed"], [1.0])
        assert W.shape == (1, 10) and np.array_equal(W[0] > 0, arms[label] > 0)
    f.write_text(json.dumps({"rewards": ["grain"], "W": json.loads(f.read_text())["W"]}))
    with pytest.raises(SystemExit, match="not --rewards"):
        recast_controls.fixed_W_of(args, ["signed"], [1.0])


def test_nft_update_adds_across_groups_for_a_signed_reward_and_cancels_for_an_energy():
    """NOTES.md, "A learnable late reward". (1) At v_theta = v_old, nft.nft_loss's gradient is
    (2 c t / (d S)) (1 - 2r) e, e = x_t - t v_old - x0, S = mean |e|, c = 5. (2) On Gaussian groups
    x0 | x_t ~ N(mu_g, Sigma) whose mean has a random phase, the groups' moves mean_i (2 r_i - 1)(x0_i - mu_g) with
    nft.optimality's r average to (1 - 1/n) Cov(R, x0 | x_t) / (clip sigma_R) (1 - 1/n: the group's own mean is
    subtracted): b Sigma u for a signed reward b <u, x0> (the groups add: their split-half cosine is near 1),
    2 <u, mu_g> Sigma u per group for the energy <u, x0>^2 (the groups cancel)."""
    import torch

    import nft

    g = torch.Generator().manual_seed(0)
    x0, x_t, v_old = (torch.randn(6, 4, 2, 2, generator=g) for _ in range(3))
    t, r = torch.rand(6, generator=g), torch.rand(6, generator=g)
    v = v_old.clone().requires_grad_(True)
    nft.nft_loss(v, v_old, x_t, x0, t, r).sum().backward()
    e = x_t - t.view(-1, 1, 1, 1) * v_old - x0
    S, d = e.abs().mean((1, 2, 3)), e[0].numel()
    want = (2 * 5 * t / (d * S) * (1 - 2 * r)).view(-1, 1, 1, 1) * e
    assert torch.allclose(v.grad, want, rtol=1e-5, atol=1e-7)

    rng = np.random.default_rng(1)
    G, n, dims, m = 4000, 8, 3, 1.5
    sd = np.array([0.6, 0.6, 1.0])  # Sigma = diag(sd^2): u = e_0, a quiet direction 1, a nuisance direction 2
    phase = rng.uniform(0, 2 * np.pi, G)
    mu = np.zeros((G, dims))
    mu[:, 0], mu[:, 1] = m * np.cos(phase), m * np.sin(phase)
    x = mu[:, None] + sd * rng.standard_normal((G, n, dims))
    groups = np.repeat(np.arange(G), n)
    for name, R in (("signed", 2.0 * x[..., 0]), ("energy", x[..., 0] ** 2)):
        R = R.reshape(-1)
        r = nft.optimality(R, groups).reshape(G, n)
        moves = ((2 * r - 1)[..., None] * (x - mu[:, None])).mean(1)  # (G, dims): each group's move
        sigma = R.std()
        if name == "signed":  # b Sigma u / (clip sigma_R), the same for every group
            want = np.array([2.0 * sd[0] ** 2, 0.0, 0.0]) / (5 * sigma) * (n - 1) / n
            assert np.allclose(moves.mean(0), want, atol=4 * moves.std(0).max() / np.sqrt(G))
        else:  # 2 <u, mu_g> Sigma u / (clip sigma_R): a group's own phase, cancelling over groups
            want = 2 * mu[:, 0] * sd[0] ** 2 / (5 * sigma) * (n - 1) / n
            slope = (moves[:, 0] * want).sum() / (want * want).sum()
            assert abs(slope - 1) < 0.15  # the per-group law (clipping and the finite group bend it slightly)
            assert abs(moves.mean(0)[0]) < 4 * moves[:, 0].std() / np.sqrt(G)
        half = G // 2
        cos = moves[:half].sum(0) @ moves[half:].sum(0)
        cos /= np.linalg.norm(moves[:half].sum(0)) * np.linalg.norm(moves[half:].sum(0))
        assert (cos > 0.9) if name == "signed" else (abs(cos) < 0.5), (name, cos)
