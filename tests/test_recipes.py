"""The SD3.5-Medium recipes (configs/*.yaml) against DiffusionNFT's own values, kept with their source in
configs/reference/diffusionnft.yaml: each recipe parsed as its command parses it, then its timesteps trained, held-out
prompts, evaluation and checkpoint cadence and precision mode checked against that table; what a recipe keeps apart on
purpose is a documented difference, one row of NOTES.md's table. And a recipe that claims every flag of some sections
at its default lists every one of them."""

import re
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

import recast
import rvge

ROOT = Path(__file__).resolve().parents[1]
REF = yaml.safe_load((ROOT / "configs" / "reference" / "diffusionnft.yaml").read_text())
RECIPES = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
SD35M = [r for r in RECIPES if yaml.safe_load((ROOT / "configs" / r).read_text()).get("model") == REF["all"]["model"]]
NFT = {c["recipe"]: (name, c) for name, c in REF["configs"].items()}  # recipe -> DiffusionNFT's config it follows
NOT_FLAGS = {"prompts-per-epoch", "gpus", "timestep-fraction"}  # checked below through the flags they set
OWN = ["recast-sd35m.yaml", "rvge-sd35m.yaml"]  # the methods' own SD3.5-M recipes
TWINS = {"nft-recast-sd35m.yaml": "recast-sd35m.yaml", "nft-rvge-sd35m.yaml": "rvge-sd35m.yaml"}  # their baselines


def parse(recipe):
    script = rvge if recipe.startswith("rvge") else recast
    return script.parse_args(["--config", str(ROOT / "configs" / recipe)]), script


def differences_in_notes():
    """The first cells of the rows of NOTES.md's table "Differences from DiffusionNFT"."""
    section = (ROOT / "NOTES.md").read_text().split("### Differences from DiffusionNFT")[1].split("\n#")[0]
    return {m.strip() for m in re.findall(r"^\| ([^|]+?) \|", section, re.M)} - {"", "---"}


def test_the_reference_names_its_source_and_every_difference_is_a_row_of_notes():
    assert REF["source"] == "https://github.com/NVlabs/DiffusionNFT" and re.fullmatch(r"[0-9a-f]{40}", REF["commit"])
    assert set(NFT) <= set(RECIPES) and len(NFT) == 5  # DiffusionNFT's five sd3_* configs
    rows = differences_in_notes()
    missing = {key: row for key, row in REF["differences"].items() if row not in rows}
    assert not missing, f"differences with no row in NOTES.md's table: {missing}"


def test_every_sd35m_recipe_is_checked_here():
    """Every recipe for the real model is either one of DiffusionNFT's configs or one of the project's own."""
    assert set(SD35M) == set(NFT) | set(OWN) | set(TWINS)


@pytest.mark.parametrize("recipe", sorted(NFT))
def test_a_diffusionnft_recipe_has_diffusionnfts_values(recipe):
    """Every value of the reference's `all` and of the recipe's config, flag by flag, unless a documented difference:
    the timesteps trained per image (int(steps x 0.99)), the held-out prompts (DiffusionNFT's test split), the run
    length and cadence (eval 10, save 30, every checkpoint kept), the batch, the optimiser, the precision mode (fp16:
    float32 weights under float16 autocast with a gradient scaler)."""
    args, script = parse(recipe)
    name, config = NFT[recipe]
    known = {f.name for f in fields(script.Args)}
    values = {**REF["all"], **{k: v for k, v in config.items() if k not in ("recipe", "dataset")}}
    differs = {k.removeprefix(f"{name}.") for k in REF["differences"] if "." not in k or k.startswith(f"{name}.")}
    checked = set()
    for key, value in values.items():
        flag = key.replace("-", "_")
        if key in differs or key in NOT_FLAGS:
            continue
        assert flag in known, f"{key}: not a flag here; name it a documented difference or check it by hand"
        got = getattr(args, flag)
        assert got == (pytest.approx(value) if isinstance(got, float) else value), f"{recipe}: {key}"
        checked.add(key)
    cadence = {"eval-every", "save-every", "keep-checkpoints", "iterations", "eval-steps", "ema"}
    assert cadence | {"mixed-precision"} <= checked  # precision: fp16 autocast with a scaler, as DiffusionNFT
    assert args.train_steps_per_leaf == int(values["steps"] * values["timestep-fraction"])  # 9 of 10, 24 of 25
    assert args.prompts_per_iter * values["gpus"] == values["prompts-per-epoch"]
    assert args.budgets == config.get("budgets", "1")  # DiffusionNFT's reward_fn weights, each 1.0
    assert (args.train_prompts, args.eval_prompts) == (
        f"dataset/{config['dataset']}/train.txt",
        f"dataset/{config['dataset']}/test.txt",
    )


@pytest.mark.parametrize("recipe", OWN + sorted(TWINS))
def test_the_projects_sd35m_recipes_train_evaluate_and_save_as_diffusionnft(recipe):
    """ReCAST's and RVGE's own SD3.5-M recipes: DiffusionNFT's model, timesteps trained, batches, held-out prompts,
    evaluation steps and cadence (so their evaluations fall on the nft-*.yaml runs' iterations), precision mode (so a
    comparison with those runs differs in the method only); their own run length."""
    args, _ = parse(recipe)
    ref = REF["all"]
    assert args.eval_prompts, f"{recipe} trains a real model and never evaluates it"
    assert args.train_steps_per_leaf == int(args.steps * ref["timestep-fraction"])
    keys = ("model", "resolution", "steps", "eval-steps", "ema", "lr", "train-batch", "eval-every", "save-every")
    for key in (*keys, "mixed-precision"):
        assert getattr(args, key.replace("-", "_")) == ref[key], f"{recipe}: {key}"
    assert args.keep_checkpoints == ref["keep-checkpoints"] and args.iterations == 1000
    assert (args.max_sequence_length or 128) == ref["max-sequence-length"]  # 0: the model's default, 128 here
    assert args.rollout_batch == parse("nft-geneval.yaml")[0].rollout_batch
    assert images_per_prompt(args) == ref["n-roots"] and args.prompts_per_iter * ref["gpus"] == ref["prompts-per-epoch"]


def images_per_prompt(args):
    """Leaves per prompt group: the independent samples (--sampler ode), or n_roots x n_branch^(branch steps)."""
    if args.sampler == "ode":
        return args.n_roots
    return args.n_roots * args.n_branch ** (1 if args.branch_steps == "rotate" else len(args.branch_steps.split(",")))


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_a_matched_baseline_is_its_methods_recipe_trained_as_diffusionnft(twin):
    """nft-recast-sd35m / nft-rvge-sd35m: the method's recipe (rewards, prompts, images per iteration, steps, batches,
    run length, evaluation, precision) with DiffusionNFT's training (--credit nft, independent ODE samples), each
    weight its budget over its reward's scale (`scales` of the reference), DiffusionNFT's raw sum in its units."""
    args, _ = parse(twin)
    own, script = parse(TWINS[twin])
    assert script is rvge or own.credit == "recast"
    assert (args.credit, args.sampler) == ("nft", "ode")
    for key in ("rewards", "train_prompts", "eval_prompts", "steps", "prompts_per_iter", "train_steps_per_leaf"):
        assert getattr(args, key) == getattr(own, key), f"{twin}: {key}"
    for key in ("lr", "train_batch", "iterations", "eval_every", "eval_steps", "ema", "mixed_precision", "base_reg"):
        assert getattr(args, key) == getattr(own, key), f"{twin}: {key}"
    assert images_per_prompt(args) * args.prompts_per_iter == images_per_prompt(own) * own.prompts_per_iter
    scales = [REF["scales"][name] for name in args.rewards.split(",")]
    weights = [float(b) / s for b, s in zip(own.budgets.split(","), scales)]
    assert [float(b) for b in args.budgets.split(",")] == pytest.approx(weights)
    for name in ("geneval_url", "geneval_metadata", "aesthetic_mlp"):
        assert getattr(args, name) == getattr(own, name)


def test_the_scales_are_the_rewards_orders_and_the_combination_is_diffusionnfts():
    """Every real reward has a scale; the ones whose scores lie in [0, 1] or are cosines have 1, the aesthetic's 1-10
    rating 10; DiffusionNFT's combination is recorded as the raw weighted sum --credit nft takes (`nft.combine_raw`)."""
    import numpy as np

    import nft
    from kit import reward_models

    assert set(REF["scales"]) == set(reward_models.REWARD_MODELS)
    assert {k for k, v in REF["scales"].items() if v != 1} == {"aesthetic"} and REF["scales"]["aesthetic"] == 10
    assert REF["rewards"]["combine"] == "raw weighted sum"
    assert nft.combine_raw(np.array([[0.8, 5.0]]), [1.0, 0.1]) == pytest.approx([1.3])


EVERY_FLAG = re.compile(r"every ([a-z, ]+?) flag at its default")


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_that_claims_every_flag_at_its_default_lists_every_one(recipe):
    """A header that says "every method, rollout, ... flag at its default" lists every flag of those --help sections
    (the prompt files apart: the embedded world has its own), each at its default."""
    text = (ROOT / "configs" / recipe).read_text()
    claim = EVERY_FLAG.search(" ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#")).lower())
    if not claim:
        return
    groups = set(re.split(r",\s*|\s+and\s+", claim[1]))
    args, script = parse(recipe)
    assert groups <= set(script.ARG_GROUPS), groups
    listed = {k.replace("-", "_") for k in yaml.safe_load(text)}
    wanted = {f.name for f in fields(script.Args) if f.metadata["group"] in groups} - {"eval_prompts", "train_prompts"}
    assert not wanted - listed, f"{recipe} claims every {claim[1]} flag at its default and omits {wanted - listed}"
    assert all(getattr(args, f.name) == f.default for f in fields(script.Args) if f.name in wanted)
