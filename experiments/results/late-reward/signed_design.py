"""Candidate (b), the signed world variant: the measurements its design and prediction rest on (README.md section 8),
made before any build, on the shipped world.

    OMP_NUM_THREADS=1 python experiments/results/late-reward/signed_design.py vae [--images 400]     # ~1 min
    OMP_NUM_THREADS=1 python experiments/results/late-reward/signed_design.py errors [--groups 64]  # ~5-10 min

vae: the finest latent patterns (a checkerboard (-1)^(i+j), and the row / column alternations the texture lines live
on, per latent channel) against the shipped world's latents (ground truth of the train split, encoded by the shipped
VAE, the pipeline's scale): the data's own variance along each (the noise a sign must be read against), and the round
trip of the pattern through the shipped VAE as the rewards see it (latent + a u -> decoder -> 8-bit image -> encoder ->
projection on u): its gain and the share of the response that stays on u. Writes signed_vae.json.

errors: the x0 error DiffusionNFT's loss sees, at the pretrained shipped model and on the gate's own rollouts (the
rollouts and noisings of phase_gate.py splithalf, seed 0, its first --groups groups): per training timestep, the
size of e = x_t - t v_old - x0, and the gradient of nft.nft_loss with respect to the transformer's output v for each
group (the output-space analogue of the gate's LoRA gradient: g = sum_i dL_i / dv, exactly what the LoRA gradient is
J^T of), for the gate's rewards (lines_phase, saturation, grain, texture_lines) and for candidate (b) simulated on the
same leaves (a sign s = +-1 per leaf, x0 + s a u, x0_hat moved along u by the ideal observer's posterior mean; its
reward s). From those, the per-group signal to noise s(t) in output space with the gate's statistic
(phase_gate.signal), to set against the gate's measured LoRA-space s(t) (phase_gate_splithalf.json). Writes
signed_errors.json.
"""

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

import world as sw  # noqa: E402
from experiments import late_reward_world as lrw  # noqa: E402
from world import build as world_build  # noqa: E402


def patterns():
    """name -> (16, 16) +-1 pattern of the latent grid's finest scale."""
    ii, jj = np.mgrid[:16, :16]
    return {"checker": (-1.0) ** (ii + jj), "rows": (-1.0) ** ii, "cols": (-1.0) ** jj}


def unit(pattern, channel_weights):
    """A unit vector (4, 16, 16) of the latent space: pattern x channel weights."""
    u = np.asarray(channel_weights, float)[:, None, None] * pattern[None]
    return u / np.linalg.norm(u)


def vae_part(a):
    import torch
    from diffusers import AutoencoderKL

    torch.set_num_threads(1)
    vae = AutoencoderKL.from_pretrained(str(sw.PIPELINE_DIR / "vae"), local_files_only=True).eval()
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor
    prompts = sw.sample_prompts(a.images, "train", seed=11)
    images = [sw.render(p, 11_000_000 + i) for i, p in enumerate(prompts)]

    def enc(ims):
        return ((sw.vae_encode(vae, ims) - shift) * scale).double().numpy()

    def dec(x):
        return sw.vae_decode(vae, torch.as_tensor(x / scale + shift, dtype=torch.float32))

    x = enc(images)  # (N, 4, 16, 16)
    out = {"command": " ".join(["python", *sys.argv]), "images": len(images), "world": sw.world_id()}
    out["latent_var_per_dim"] = float(x.var(0).mean())
    pats, data = patterns(), {}
    for name, p in pats.items():
        coef = np.einsum("nchw,hw->nc", x, p) / np.sqrt(p.size)  # (N, 4): projection on each channel's unit pattern
        cov = np.cov(coef, rowvar=False)
        data[name] = {"mean": coef.mean(0).tolist(), "var": np.diag(cov).tolist(), "cov": cov.tolist()}
    out["data_along_pattern"] = data
    # round trip: latent + amp u -> decode -> 8-bit image -> encode, projected on u (per channel and for the chosen)
    rt_images = images[: a.roundtrip]
    x_rt = x[: a.roundtrip]
    base = enc(dec(x_rt))  # the round trip of the unchanged latents (the reference)
    out["roundtrip_images"] = len(rt_images)
    rt = {}
    for name, p in pats.items():
        for c in range(4):
            w = np.eye(4)[c]
            u = unit(p, w)
            for amp in a.amps:
                y = enc(dec(x_rt + amp * u))
                d = (y - base).reshape(len(y), -1)
                gain = d @ u.reshape(-1) / amp
                on = gain * amp
                off = np.linalg.norm(d - on[:, None] * u.reshape(1, -1), axis=1) / amp
                rt[f"{name}/c{c}/a{amp:g}"] = {
                    "gain_mean": float(gain.mean()),
                    "gain_sd": float(gain.std()),
                    "off_u_norm_mean": float(off.mean()),
                }
                print(name, c, amp, rt[f"{name}/c{c}/a{amp:g}"], flush=True)
    out["roundtrip"] = rt
    # the base round trip's own spread along each pattern: how much the 8-bit decode + encode moves a latent along u
    rt_noise = {}
    for name, p in pats.items():
        for c in range(4):
            u = unit(p, np.eye(4)[c]).reshape(-1)
            rt_noise[f"{name}/c{c}"] = float(((base - x_rt).reshape(len(x_rt), -1) @ u).std())
    out["roundtrip_shift_sd"] = rt_noise
    (HERE / "signed_vae.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "roundtrip"}, indent=1))


def pixel_part(a):
    """The design as built (world variant ``signed``: background lines in pixel space), measured through the shipped
    VAE: the latent half-distance a_lat between an image's two signs (same seed: same layout, fills, texture), along
    the fixed unit direction u_hat of their mean difference; the data's other variance along u_hat (the variant's
    images without lines, the shipped model's samples); the reward on ground truth, on the VAE's reconstructions and
    on the shipped model's samples; the ideal observer's amplitude for t_half = 0.3 (share_decided, amp_for)."""
    import torch

    torch.set_num_threads(1)
    pipe = sw.load_pipeline()
    vae = pipe.vae
    scale, shift = vae.config.scaling_factor, vae.config.shift_factor
    prompts = sw.sample_prompts(a.images, "train", seed=12)
    seeds = [12_000_000 + i for i in range(len(prompts))]
    specs = [sw.parse_prompt(p) for p in prompts]

    def enc(ims):
        return ((sw.vae_encode(vae, ims) - shift) * scale).double().numpy().reshape(len(ims), -1)

    out = {"command": " ".join(["python", *sys.argv]), "images": len(prompts), "world": sw.world_id(), "depths": {}}
    ref = lrw.VARIANTS["signed"]["depth"]
    plain = enc([sw.render_spec(sp, sd, "signed", sign=0) for sp, sd in zip(specs, seeds)])
    gen = sw.generate(pipe, prompts[: a.samples], seed=3)
    x_gen = enc(gen)
    for depth in a.depths:
        lrw.VARIANTS["signed"]["depth"] = depth
        try:
            ip = [sw.render_spec(sp, sd, "signed", sign=1) for sp, sd in zip(specs, seeds)]
            im = [sw.render_spec(sp, sd, "signed", sign=-1) for sp, sd in zip(specs, seeds)]
            xp, xm = enc(ip), enc(im)
            d = (xp - xm) / 2
            u_hat = d.mean(0) / np.linalg.norm(d.mean(0))
            a_lat = d @ u_hat
            rec = sw.vae_decode(
                vae,
                torch.as_tensor(np.concatenate([xp, xm]).reshape(-1, 4, 16, 16) / scale + shift, dtype=torch.float32),
            )
            r_rec = sw.REWARDS["signed"](rec, None)
            r_gt = sw.REWARDS["signed"](ip + im, None)
            r_gen = sw.REWARDS["signed"](gen, None)
            entry = {
                "a_lat_median": float(np.median(a_lat)),
                "a_lat_quartiles": np.quantile(a_lat, [0.25, 0.75]).tolist(),
                "half_distance_median": float(np.median(np.linalg.norm(d, axis=1))),
                "share_of_difference_on_u_hat": float(np.median(a_lat / np.linalg.norm(d, axis=1))),
                "var_u_plain": float((plain @ u_hat).var()),
                "var_u_generated": float((x_gen @ u_hat).var()),
                "reward_gt": [float(r_gt[: len(ip)].mean()), float(r_gt[len(ip) :].mean()), float(r_gt.std())],
                "reward_vae": [float(r_rec[: len(ip)].mean()), float(r_rec[len(ip) :].mean())],
                "reward_vae_sd": [float(r_rec[: len(ip)].std()), float(r_rec[len(ip) :].std())],
                "reward_shipped_samples": [float(r_gen.mean()), float(r_gen.std())],
            }
        finally:
            lrw.VARIANTS["signed"]["depth"] = ref
        out["depths"][str(depth)] = entry
        if depth == max(a.depths):  # the design's latent direction (the deepest lines: the least rounding)
            np.save(HERE / "signed_u.npy", u_hat.astype(np.float32))
        print(depth, entry, flush=True)
    # the ideal observer: the amplitude whose latent half-distance puts half of the sign's D(0) decided at t_half
    slope = np.median([v["a_lat_median"] / float(k) for k, v in out["depths"].items()])
    var_u = max(v["var_u_plain"] for v in out["depths"].values())
    out["a_lat_per_level"] = float(slope)
    out["var_u"] = var_u
    out["kappa_half"] = float(amp_for(0.5, 0.0) ** 2)  # kappa at which half is decided (t = 0.5, var 0: kappa = a^2)
    out["design_marginal_observer"] = {}  # the data's whole variance along u_hat as the noise: see signed_errors
    for t_half in (0.25, 0.3, 0.35, 0.4):
        a_lat = amp_for(t_half, var_u)
        out["design_marginal_observer"][f"{t_half:g}"] = {"a_lat": a_lat, "depth": a_lat / slope}
    (HERE / "signed_pixel.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "depths"}, indent=1))


# ------------------------------------------------------------------ the ideal observer for the sign
def share_decided(kappa, z=None):
    """E[tanh^2(kappa + sqrt(kappa) Z)], Z ~ N(0, 1): Var(E[s | y]) / Var(s) for a sign s = +-1 seen as
    y = s mu + noise with kappa = mu^2 / var (the share of the sign's D(0) decided), by Gauss-Hermite quadrature."""
    x, w = np.polynomial.hermite_e.hermegauss(80) if z is None else z
    k = np.asarray(kappa, float)[..., None]
    return (np.tanh(k + np.sqrt(k) * x) ** 2 * w).sum(-1) / w.sum()


def kappa_of(t, amp, var_u):
    """The sign's signal to noise in x_t = (1 - t)(s amp u + n) + t eps, seen along u: (1 - t)^2 amp^2 /
    ((1 - t)^2 var_u + t^2), var_u the data's other variance along u (n's)."""
    t = np.asarray(t, float)
    return (1 - t) ** 2 * amp**2 / ((1 - t) ** 2 * var_u + t**2)


def amp_for(t_half, var_u, target=0.5):
    """The amplitude at which the ideal observer has half of the sign's D(0) decided at t_half."""
    lo, hi = 1e-4, 100.0
    for _ in range(200):
        mid = np.sqrt(lo * hi)
        if share_decided(kappa_of(t_half, mid, var_u)) < target:
            lo = mid
        else:
            hi = mid
    return float(np.sqrt(lo * hi))


def nft_dv(e, t, r, c=5.0):
    """d nft_loss / d v_theta at v_theta = v_old (b = 1): (2 c t / (d S)) (1 - 2 r) e, S = mean |e| (NOTES.md, "A
    learnable late reward"; checked against autograd on the first batch). e (N, d), t (N,), r (N,) -> (N, d)."""
    S = np.maximum(np.abs(e).mean(1), 1e-5)
    return (2 * c * t / (e.shape[1] * S) * (1 - 2 * r))[:, None] * e


def load_gate():
    """phase_gate.py of this folder, as a module (its setup, draws and statistics)."""
    spec = importlib.util.spec_from_file_location("phase_gate", HERE / "phase_gate.py")
    gate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate)
    return gate


def errors_part(a):
    import torch

    import nft

    gate = load_gate()
    torch.set_num_threads(1)
    args, run = gate.setup(gate.SPLIT_REWARDS, 0, 8, HERE / "work" / "signed-errors")
    sigmas, T, K = run.sigmas, args.steps, len(gate.SPLIT_REWARDS)
    u = np.load(HERE / "signed_u.npy").astype(np.float64)  # (1024,): the design's latent direction (pixel part)
    amps = [float(x) for x in a.amps.split(",")]
    iterations = -(-a.groups // 8)
    n_groups, leaves = iterations * 8, args.n_roots * args.n_branch
    N = n_groups * leaves
    E = np.zeros((T, N, 1024), np.float32)  # every leaf's x0 error e = x_t - t v_old - x0 at every timestep
    eps_u = np.zeros((T, N))
    r_all = np.zeros((N, K))
    gen, t0 = torch.Generator().manual_seed(2), time.time()
    checked = False
    for gi, idx, b, r, j, nb, v_old in gate.gate_draws(run, args, iterations, 0, gen, t0):  # the gate's draws
        rows = slice(gi * leaves, (gi + 1) * leaves)
        if j == 0:
            r_all[rows] = r[idx.numpy()]
        s = nb.s.view(-1, 1, 1, 1)
        e = nb.x_t - s * v_old - nb.x0
        E[j, rows] = e.reshape(len(idx), -1).numpy()
        eps = (nb.x_t - (1 - s) * nb.x0) / s.clamp_min(1e-6)
        eps_u[j, rows] = eps.reshape(len(idx), -1).double().numpy() @ u
        if not checked:  # the analytic gradient is nft_loss's
            v = v_old.clone().requires_grad_(True)
            rr = torch.as_tensor(r[idx.numpy(), 0], dtype=torch.float32)
            (gv,) = torch.autograd.grad(nft.nft_loss(v, v_old, nb.x_t, nb.x0, nb.s, rr, b=args.nft_b).sum(), v)
            want = nft_dv(E[j, rows].astype(np.float64), nb.s.double().numpy(), r_all[rows, 0])
            assert np.allclose(gv.reshape(len(idx), -1).numpy(), want, rtol=1e-3, atol=1e-7)
            checked = True
    sig = sigmas[:T].double().numpy()
    e_u = E.astype(np.float64) @ u  # (T, N): the shipped model's x0 error along u
    # the sign's observer on top of what the shipped model knows: y' = <u, x_t> - (1 - t) <u, x0_hat_shipped>
    # = (1 - t) s a + w, w = -(1 - t) e_u + t eps_u, read with tanh((1 - t) a y' / var(w))
    w = -(1 - sig[:, None]) * e_u + sig[:, None] * eps_u
    var_w = w.var(1)
    out = {
        "command": " ".join(["python", *sys.argv]),
        "world": sw.world_id(),
        "groups": n_groups,
        "leaves_per_group": leaves,
        "sigmas": sig.tolist(),
        "amps": amps,
        "x0_error_sq_mean": (E.astype(np.float64) ** 2).sum(2).mean(1).tolist(),  # E|e|^2 (1024 numbers), per t
        "x0_error_sq_along_u": (e_u**2).mean(1).tolist(),
        "observer_noise_var": var_w.tolist(),
        "s": {},
        "s_ci": {},
        "mu": {},
        "late_share": {},
        "late_share_gradient_units": {},
        "share_decided": {},
    }
    late = sig <= gate.LATE_T
    omega = (1 / sig) / (1 / sig).sum()  # recast.py --column-units gradient: step weights propto 1 / t_j
    rng, srng = np.random.default_rng(0), np.random.default_rng(a.seed)
    signs = srng.choice([-1.0, 1.0], size=N)
    boot = [rng.multinomial(n_groups, np.ones(n_groups) / n_groups).astype(float) for _ in range(a.resamples)]
    names = list(gate.SPLIT_REWARDS) + [f"signed a={amp:g}" for amp in amps]
    r_sign = nft.optimality(signs, np.repeat(np.arange(n_groups), leaves), std=np.ones(1))
    for name in names:
        out["s"][name], out["s_ci"][name] = [], []
        for j in range(T):
            if name in gate.SPLIT_REWARDS:
                d = nft_dv(E[j].astype(np.float64), np.full(N, sig[j]), r_all[:, gate.SPLIT_REWARDS.index(name)])
            else:
                amp = float(name.split("=")[1])
                y = (1 - sig[j]) * signs * amp + w[j]
                post = np.tanh((1 - sig[j]) * amp * y / var_w[j])
                eb = E[j].astype(np.float64) + amp * (post - signs)[:, None] * u[None]
                d = nft_dv(eb, np.full(N, sig[j]), r_sign)
                if j == 0:
                    out["share_decided"][name] = []
                out["share_decided"][name].append(float(np.mean(post**2)))
            grads = d.reshape(n_groups, leaves, -1).sum(1)
            G = grads @ grads.T
            out["s"][name].append(float(gate.signal(G)[0]))
            out["mu"].setdefault(name, []).append(float(np.sqrt(max(gate.signal(G)[1], 0.0))))
            out["s_ci"][name].append(np.quantile([gate.signal(G, wb)[0] for wb in boot], [0.025, 0.975]).tolist())
        mu = np.array(out["mu"][name])
        out["late_share"][name] = float(mu[late].sum() / max(mu.sum(), 1e-300))
        out["late_share_gradient_units"][name] = float((omega * mu)[late].sum() / max((omega * mu).sum(), 1e-300))
        print(name, " ".join(f"{x:.4f}" for x in out["s"][name]), flush=True)
    # the ideal observer's t_half per amplitude, and the amplitude for t_half = 0.3, from the measured noise var(w)
    # (log-linear in t between the grid's levels)
    fine = np.linspace(0.01, 0.99, 981)
    order = np.argsort(sig)
    V = np.exp(np.interp(fine, sig[order], np.log(np.maximum(var_w[order], 1e-12))))
    out["t_half_ideal"] = {}
    for amp in amps:
        share = lrw.sign_share_decided(lrw.sign_kappa(fine, amp, V))
        out["t_half_ideal"][f"signed a={amp:g}"] = float(fine[np.flatnonzero(share >= 0.5).max()])
    out["amp_for_t_half"] = {
        f"{th:g}": lrw.sign_amplitude_for(th, float(np.exp(np.interp(th, sig[order], np.log(var_w[order])))))
        for th in (0.25, 0.3, 0.35, 0.4, 0.45)
    }
    out["seconds"] = time.time() - t0
    (HERE / "signed_errors.json").write_text(json.dumps(out, indent=1) + "\n")


def decoder_part(a):
    """Can the shipped VAE carry the pattern once its decoder learns it? The shipped decoder draws back ~4% of the
    background lines (pixel part: reward_vae); here the decoder alone is fine-tuned (train_vae decoder_only: the
    encoder, and so every latent, unchanged) on the variant's images at each amplitude, --steps steps, and the
    reward is read from the reconstructions of held-out variant images (mean reward x sign; the share whose sign is
    read back), beside the checker on them. Writes signed_decoder.json."""
    import copy

    import torch

    torch.set_num_threads(1)
    base = sw.load_pipeline().vae
    prompts = sw.sample_prompts(a.images, "train", seed=13)
    test = sw.sample_prompts(128, "heldout", seed=14)
    signs = np.array([lrw.variant_sign(14_000_000 + i) for i in range(len(test))])
    ref = lrw.VARIANTS["signed"]["depth"]
    out = {"command": " ".join(["python", *sys.argv]), "world": sw.world_id(), "steps": a.steps, "depths": {}}
    for depth in a.depths:
        lrw.VARIANTS["signed"]["depth"] = depth
        try:
            with sw.texture_amplitude(max(sw.TEXTURE["amp"], world_build.VAE_TEXTURE_AMP)):
                train = [sw.render(p, 13_000_000 + i, "signed") for i, p in enumerate(prompts)]
            gt = [sw.render(p, 14_000_000 + i, "signed") for i, p in enumerate(test)]
            vae = copy.deepcopy(base)
            t0 = time.time()
            world_build.train_vae(vae, train, a.steps, batch=32, decoder_only=True, lr=a.lr)
            rec = sw.vae_decode(vae, sw.vae_encode(vae, gt))
            rec0 = sw.vae_decode(base, sw.vae_encode(base, gt))
            r, r0 = sw.REWARDS["signed"](rec, test), sw.REWARDS["signed"](rec0, test)
            entry = {
                "seconds": time.time() - t0,
                "reward_gt_times_sign": float((sw.REWARDS["signed"](gt, test) * signs).mean()),
                "reward_vae_times_sign": float((r * signs).mean()),
                "vae_sign_read_back": float((np.sign(r) == signs).mean()),
                "shipped_vae_times_sign": float((r0 * signs).mean()),
                "strict_vae": float(sw.REWARDS["geneval_strict"](rec, test).mean()),
                "strict_shipped_vae": float(sw.REWARDS["geneval_strict"](rec0, test).mean()),
                "texture_vae": float(sw.REWARDS["texture"](rec, test).mean()),
                "texture_shipped_vae": float(sw.REWARDS["texture"](rec0, test).mean()),
            }
        finally:
            lrw.VARIANTS["signed"]["depth"] = ref
        out["depths"][str(depth)] = entry
        print(depth, entry, flush=True)
    (HERE / "signed_decoder.json").write_text(json.dumps(out, indent=1) + "\n")


def lora_part(a):
    """The gate's own statistic in the gate's own space: each group's LoRA gradient of nft.nft_loss (sum over its
    leaves of J_i^T dL_i / dv, one backward pass per column), count-sketched as phase_gate.py does, for saturation and
    lines_phase (their s(t) reproduce the gate's, a check of the machinery) and for candidate (b) simulated as in
    `errors` (its x0 error e + a (E[s | y] - s) u, the observer's noise var(w) from signed_errors.json), the Jacobian
    taken at the shipped model's x_t (the variant's differs from it only by the faint pattern). Writes
    signed_lora.json: s(t) with its 95% bootstrap interval, |mu(t)|, the share of |mu| at t <= 0.47 in loss units
    and in gradient units (recast.py --column-units gradient)."""
    import torch

    import nft

    gate = load_gate()
    torch.set_num_threads(1)
    real = ("saturation", "lines_phase")
    args, run = gate.setup(real, 0, 8, HERE / "work" / "signed-lora")
    tr, sigmas, T = run.transformer, run.sigmas, args.steps
    u = np.load(HERE / "signed_u.npy").astype(np.float64)
    var_w = np.array(json.loads((HERE / "signed_errors.json").read_text())["observer_noise_var"])
    amps = [float(x) for x in a.amps.split(",")]
    names = list(real) + [f"signed a={amp:g}" for amp in amps]
    params = nft.lora_params(tr, "default")
    D = sum(p.numel() for p in params)
    hrng = np.random.default_rng(12345)  # phase_gate's sketch
    bucket = torch.as_tensor(hrng.integers(a.sketch, size=D))
    sign = torch.as_tensor(hrng.choice([-1.0, 1.0], size=D), dtype=torch.float32)
    iterations = -(-a.groups // 8)
    n_groups = iterations * 8
    sk = np.zeros((len(names), T, n_groups, a.sketch), np.float32)
    gen, srng, t0 = torch.Generator().manual_seed(2), np.random.default_rng(a.seed), time.time()
    sig = sigmas[:T].double().numpy()
    for gi, idx, _, r, j, nb, v_old in gate.gate_draws(run, args, iterations, 0, gen, t0):  # the gate's draws
        if j == 0:  # the group's simulated signs
            signs = srng.choice([-1.0, 1.0], size=len(idx))
            r_sign = nft.optimality(signs, np.zeros(len(idx)), std=np.ones(1))
        v_theta = nft.velocity(tr, nb.x_t, nb.s, *nb.cond)
        s_ = nb.s.view(-1, 1, 1, 1)
        e = (nb.x_t - s_ * v_old - nb.x0).reshape(len(idx), -1).double().numpy()
        eps = ((nb.x_t - (1 - s_) * nb.x0) / s_.clamp_min(1e-6)).reshape(len(idx), -1).double().numpy()
        w = -(1 - sig[j]) * (e @ u) + sig[j] * (eps @ u)
        tt = np.full(len(idx), sig[j])
        cots = [nft_dv(e, tt, r[idx.numpy(), k]) for k in range(len(real))]
        for amp in amps:
            post = np.tanh((1 - sig[j]) * amp * ((1 - sig[j]) * signs * amp + w) / var_w[j])
            cots.append(nft_dv(e + amp * (post - signs)[:, None] * u[None], tt, r_sign))
        for k, cot in enumerate(cots):
            ct = torch.as_tensor(cot.reshape(v_theta.shape), dtype=v_theta.dtype)
            grads = torch.autograd.grad(v_theta, params, grad_outputs=ct, retain_graph=k < len(cots) - 1)
            flat = torch.cat([x.reshape(-1) for x in grads])
            sk[k, j, gi] = torch.zeros(a.sketch).index_add_(0, bucket, sign * flat).numpy()
    late = sig <= gate.LATE_T
    omega = (1 / sig) / (1 / sig).sum()
    rng = np.random.default_rng(0)
    boot = [rng.multinomial(n_groups, np.ones(n_groups) / n_groups).astype(float) for _ in range(a.resamples)]
    out = {
        "command": " ".join(["python", *sys.argv]),
        "world": sw.world_id(),
        "groups": n_groups,
        "sketch": a.sketch,
        "sigmas": sig.tolist(),
        "names": names,
        "s": {},
        "s_ci": {},
        "mu": {},
        "late_share": {},
        "late_share_ci": {},
        "late_share_gradient_units": {},
    }
    for k, name in enumerate(names):
        Gs = [sk[k, j].astype(np.float64) @ sk[k, j].astype(np.float64).T for j in range(T)]
        out["s"][name] = [float(gate.signal(G)[0]) for G in Gs]
        out["s_ci"][name] = [np.quantile([gate.signal(G, wb)[0] for wb in boot], [0.025, 0.975]).tolist() for G in Gs]
        mu = np.array([np.sqrt(max(gate.signal(G)[1], 0.0)) for G in Gs])
        out["mu"][name] = mu.tolist()
        out["late_share"][name] = float(mu[late].sum() / max(mu.sum(), 1e-300))
        out["late_share_gradient_units"][name] = float((omega * mu)[late].sum() / max((omega * mu).sum(), 1e-300))
        shares = []
        for wb in boot:
            m = np.array([np.sqrt(max(gate.signal(G, wb)[1], 0.0)) for G in Gs])
            shares.append(m[late].sum() / max(m.sum(), 1e-300))
        out["late_share_ci"][name] = np.quantile(shares, [0.025, 0.975]).tolist()
        print(name, " ".join(f"{x:.4f}" for x in out["s"][name]), f"late {out['late_share'][name]:.3f}", flush=True)
    out["seconds"] = time.time() - t0
    (HERE / "signed_lora.json").write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["vae", "pixel", "decoder", "errors", "lora"])
    ap.add_argument("--steps", type=int, default=300, help="decoder: fine-tuning steps")
    ap.add_argument("--lr", type=float, default=1e-3, help="decoder: learning rate")
    ap.add_argument("--depths", default="1,2,4", help="vae, pixel, decoder: line depths in grey levels")
    ap.add_argument("--sketch", type=int, default=16384, help="lora: count-sketch buckets (phase_gate's)")
    ap.add_argument("--samples", type=int, default=64, help="pixel: samples of the shipped model")
    ap.add_argument("--images", type=int, default=400, help="vae: ground-truth images for the data's variance")
    ap.add_argument("--roundtrip", type=int, default=64, help="vae: images for the round trip")
    ap.add_argument("--amps", default="0.5,1,2", help="vae, errors, lora: latent norms of the pattern")
    ap.add_argument("--groups", type=int, default=64, help="errors: prompt groups (the gate's first ones)")
    ap.add_argument("--channel", type=int, default=0, help="errors: the latent channel of the checkerboard u")
    ap.add_argument("--resamples", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0, help="errors: the simulated signs")
    a = ap.parse_args(argv)
    if a.part in ("vae", "pixel", "decoder"):
        a.amps = [float(x) for x in a.amps.split(",")]
        a.depths = [int(x) for x in a.depths.split(",")]
        {"vae": vae_part, "pixel": pixel_part, "decoder": decoder_part}[a.part](a)
    else:
        (errors_part if a.part == "errors" else lora_part)(a)


if __name__ == "__main__":
    main()
