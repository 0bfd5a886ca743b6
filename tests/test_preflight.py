"""--dry-run as a preflight (kit/preflight.py): every check the launch makes that needs no GPU, all failures named at
once with a non-zero exit; each recipe's own arithmetic, memory and time; the gated model's access in one line; an
SD3.5-M run without a recipe refused (kit/flags.check_recipe); a launch of another process count named with the batch
it keeps and loses. Nothing downloads: the hub is offline or its call replaced."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import nft
import recast
import rvge
from kit import checks, flags, preflight

ROOT = Path(__file__).resolve().parents[1]
REF = yaml.safe_load((ROOT / "configs" / "reference" / "diffusionnft.yaml").read_text())
SD35M = "stabilityai/stable-diffusion-3.5-medium"


def recipe_args(recipe, *more):
    script = rvge if recipe.startswith("rvge") else recast
    return script.parse_args(["--config", str(ROOT / "configs" / recipe), *more]), script


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty hub cache and HF_HUB_OFFLINE: nothing here may reach the network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return tmp_path / "hub"


def test_the_preflight_names_every_missing_input_at_once_and_exits_non_zero(offline_hub, tmp_path, monkeypatch, capsys):
    """nft-multi in a folder with no dataset/ and no reward_ckpts/, offline: one SystemExit that numbers every
    problem (the gated model with its fix, both prompt files, PickScore's weights and processor, HPSv2's
    architecture, the CLIP, HPSv2's checkpoint), after the plan was printed; with the files and weights there it
    passes and exits 0."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as err:
        recast.main(["--config", str(ROOT / "configs/nft-multi.yaml"), "--dry-run"])
    said = str(err.value)
    assert said.startswith("preflight: 8 problem(s) the launch would stop at:")
    for words in (
        f"1. --model {SD35M}: not in the local hub cache and HF_HUB_OFFLINE is set; unset it, accept its licence",
        "hf auth login",
        "2. --train-prompts dataset/pickscore/train.txt: cannot read it",
        "3. --eval-prompts dataset/pickscore/test.txt: cannot read it",
        "--pickscore-model yuvalkirstain/PickScore_v1",
        "--pickscore-processor laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        "--hpsv2-config laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        "--clip-model openai/clip-vit-large-patch14",
        "8. --hpsv2-checkpoint reward_ckpts/HPS_v2.1_compressed.pt: no such file",
    ):
        assert words in said, words
    out = capsys.readouterr().out
    assert "samples per optimizer step    27,648" in out and "memory per GPU" in out and "GPU-hours" in out
    # everything there: model and reward weights as folders, the prompt files, the aesthetic MLP
    for folder, file in [("sd", "model_index.json"), ("pick", "config.json"), ("proc", "preprocessor_config.json")]:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / file).write_text("{}")
    (tmp_path / "clip").mkdir()
    for file in ("config.json", "preprocessor_config.json"):
        (tmp_path / "clip" / file).write_text("{}")
    (tmp_path / "dataset/pickscore").mkdir(parents=True)
    for split in ("train", "test"):
        (tmp_path / f"dataset/pickscore/{split}.txt").write_text("a cat\na dog\n")
    (tmp_path / "reward_ckpts").mkdir()
    (tmp_path / "reward_ckpts/HPS_v2.1_compressed.pt").write_bytes(b"")
    given = ["--pickscore-model", "pick", "--pickscore-processor", "proc", "--clip-model", "clip", "--model", "sd"]
    (tmp_path / "proc" / "config.json").write_text("{}")  # HPSv2's architecture and tokenizer: the CLIP-H folder
    given += ["--hpsv2-config", "proc"]
    info = recast.main(["--config", str(ROOT / "configs/nft-multi.yaml"), "--dry-run", *given])
    assert info["plan"]["samples_per_step"] == 27_648 and "passed" in capsys.readouterr().out


@pytest.mark.parametrize("recipe", sorted(c["recipe"] for c in REF["configs"].values()))
def test_a_diffusionnft_recipe_plans_its_own_batch(recipe):
    """The arithmetic of each nft-* recipe from the rollout and the flags as the loop reads them, against
    configs/reference/diffusionnft.yaml: 48 prompt groups x 24 images on the recipe's 8 processes, int(steps x 0.99)
    timesteps each, cut into its optimizer steps (1152 x 9 = 10,368 samples per step; OCR's two steps 5,184; the
    multi-reward run's 24 of 25 steps 27,648); DPM-Solver-2 takes one transformer pass per step and image."""
    args, _ = recipe_args(recipe)
    ref = {**REF["all"], **next(c for c in REF["configs"].values() if c["recipe"] == recipe)}
    plan = preflight.run_arithmetic(args, *preflight.planned_processes(args)[:1])
    images = ref["prompts-per-epoch"] * ref["n-roots"]
    assert plan["processes"] == ref["gpus"] == args.num_processes
    assert plan["images"] * plan["processes"] == images == 1152
    per_image = int(ref.get("steps", REF["all"]["steps"]) * ref["timestep-fraction"])
    assert plan["samples_per_step"] == images * per_image / ref["updates-per-iter"]
    assert plan["rollout_passes"] == plan["images"] * args.steps
    assert plan["frozen_passes"] == 2 * plan["samples"]  # v_old and v_base (--base-reg 1e-4)


def test_the_rollout_is_counted_by_running_it():
    """rollout_counts runs nft.tree_rollout: 2 prompts x 2 roots branching x2 at steps 1 and 2 of T = 4 with 2 SDE
    sub-steps after a branch pass 4 + (8 + 8) + (16 + 16) + 16 = 68 samples (the last step is Euler, one pass) and
    end in 16 leaves; rotate at 6 groups of trees 3 x 8 on T = 10 branches each group once."""
    args = SimpleNamespace(
        prompts_per_iter=2, steps=4, branch_steps="1,2", sampler="tree", n_roots=2, n_branch=2, sde_a=1.4,
        sde_substeps=2,
    )  # fmt: skip
    assert preflight.rollout_counts(args, 1) == (68, 16, 16)
    args = recipe_args("recast-sd35m.yaml")[0]
    passes, leaves, decodes = preflight.rollout_counts(args, 1)
    assert leaves == decodes == 6 * 24
    # each group: 3 roots until its branch step b, then 24 leaves with 2 passes per step but the last
    layouts = nft.branch_layout(6, 10, "rotate")
    assert passes == sum(3 * b + 24 * (2 * (9 - b) + 1) for (b,) in layouts)


def test_each_sd35m_recipe_prints_its_own_memory_and_time(offline_hub):
    """The resident reward models differ: nft-multi's PickScore and HPSv2 (two CLIP-H) and CLIPScore's CLIP-L;
    recast's CLIP-L is shared by CLIPScore and the aesthetic; rvge's five rewards add a local GenEval worker (an
    assumption, so named); OCR holds nothing on the GPU. Time scales with the passes: nft-multi's 25 steps cost more
    than nft-geneval's 10."""
    memory, cost = {}, {}
    for recipe in ("nft-geneval.yaml", "nft-ocr.yaml", "nft-multi.yaml", "recast-sd35m.yaml", "rvge-sd35m.yaml"):
        args, script = recipe_args(recipe)
        names = [n for n in args.rewards.split(",")]
        memory[recipe] = preflight.reward_memory(args, names)
        plan = preflight.run_arithmetic(args, 8)
        cost[recipe] = preflight.time_estimate(args, plan, (2.0e12, 4.0e12), 0)
    assert memory["nft-ocr.yaml"] == {}
    assert [k for k in memory["nft-geneval.yaml"]] == ["GenEval server worker (Mask2Former + CLIP-L, fp32; assumed)"]
    multi = memory["nft-multi.yaml"]
    assert any(k.startswith("reward model PickScore_v1 (pickscore; float32, 986M, estimate") for k in multi)
    assert any(k.startswith("reward model CLIP-ViT-H-14-laion2B-s32B-b79K (hpsv2; float32, 986M") for k in multi)
    assert any(k.startswith("reward model clip-vit-large-patch14 (clipscore; float32, 428M") for k in multi)
    assert 3.5 < sum(v for k, v in multi.items() if "PickScore" in k) < 3.8  # ~986M x 4 bytes
    shared = memory["recast-sd35m.yaml"]
    assert any(k.startswith("reward model clip-vit-large-patch14 (clipscore+aesthetic; float32, 428M") for k in shared)
    assert set(memory["rvge-sd35m.yaml"]) == set(shared) | set(memory["nft-geneval.yaml"])
    assert cost["nft-multi.yaml"]["seconds"] > 2 * cost["nft-geneval.yaml"]["seconds"]


def test_the_time_is_the_flop_count_over_the_stated_rate():
    """seconds = (rollout and frozen passes x forward + gradient samples x forward-and-backward) / (peak x MFU),
    GPU-hours = seconds x processes / 3600; gradient checkpointing adds one forward per gradient sample."""
    plan = {"rollout_passes": 100, "frozen_passes": 40, "samples": 20, "processes": 8}
    args = SimpleNamespace(gradient_checkpointing=False, eval_every=0, eval_steps=0, steps=10)
    got = preflight.time_estimate(args, plan, (1e12, 3e12), 0)
    rate = preflight.PEAK_TFLOPS * 1e12 * preflight.ASSUMED_MFU
    assert got["seconds"] == pytest.approx((140 * 1e12 + 20 * 3e12) / rate)
    assert got["gpu_hours"] == pytest.approx(got["seconds"] * 8 / 3600)
    ckpt = preflight.time_estimate(
        SimpleNamespace(**{**vars(args), "gradient_checkpointing": True}), plan, (1e12, 3e12), 0
    )
    assert ckpt["seconds"] == pytest.approx((160 * 1e12 + 20 * 3e12) / rate)


def test_flops_are_counted_on_the_meta_device():
    """SD3.5-M at 512 px with 128 T5 tokens: ~2.2 TFLOP a forward (2 x 2.2B parameters x 1229 tokens, attention
    beside); forward + backward through the LoRA ~2.1x (input gradients through frozen layers, no weight gradients
    there: not full fine-tuning's 3x)."""
    forward, both = preflight.flops_per_sample(512, 128, 32, 64)
    assert 2.0e12 < forward < 2.5e12 and 2.0 < both / forward < 2.3


class _Gated(Exception):
    pass


@pytest.mark.parametrize(
    "raised, words",
    [
        ("gated", "gated, and this token has no access: accept its licence at https://huggingface.co/"),
        ("missing", "not found on the hub, or gated and no token is saved: accept its licence"),
        ("offline", "the hub cannot be reached (ConnectionError) to check access; accept its licence"),
        (None, None),
    ],
)
def test_gated_model_access_is_one_line_with_the_fix(monkeypatch, tmp_path, raised, words):
    """model_problem asks huggingface_hub's auth_check (replaced here: nothing reaches the hub) and turns each
    answer into one line naming the fix: accept the licence on the hub and `hf auth login`; access: no problem."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    kinds = {"gated": GatedRepoError, "missing": RepositoryNotFoundError, "offline": ConnectionError}
    asked = []

    def auth_check(self, repo_id, **_):
        asked.append(repo_id)
        if raised:
            err = kinds[raised].__new__(kinds[raised])
            Exception.__init__(err, "no")
            raise err

    monkeypatch.setattr(HfApi, "auth_check", auth_check)
    problem = preflight.model_problem(SD35M)
    assert asked == [SD35M]
    if words is None:
        assert problem is None
    else:
        assert problem.startswith(f"--model {SD35M}: ") and words in problem and "hf auth login" in problem
        assert "\n" not in problem


def test_an_sd35m_run_without_a_recipe_is_refused_naming_it(tmp_path):
    """`recast.py --model SD3.5-M --rewards pickscore` would train with the embedded model's optimisation defaults:
    refused, each flag named with DiffusionNFT's value, the recipe and --allow-embedded-defaults. A recipe, the flags
    given, or the switch let it parse; rvge.py's own --base-reg is DiffusionNFT's already; a tiny local pipeline is not
    SD3.5-M, a local copy of SD3.5-M's transformer config is."""
    argv = ["--model", SD35M, "--rewards", "pickscore", "--budgets", "1"]
    with pytest.raises(SystemExit) as err:
        recast.parse_args(argv)
    said = str(err.value)
    for words in (
        "--lr 0.0001 (DiffusionNFT: 0.0003)",
        "--base-reg 0.1 (DiffusionNFT: 0.0001)",
        "--updates-per-iter 8 (DiffusionNFT: 1)",
        "--train-steps-per-leaf 4 (DiffusionNFT: 9)",
        "--ema False (DiffusionNFT: True)",
        "--mixed-precision no (DiffusionNFT: fp16)",
        "--config configs/nft-pickscore.yaml",
        "--allow-embedded-defaults",
    ):
        assert words in said, words
    assert recast.parse_args([*argv, "--allow-embedded-defaults"]).lr == 1e-4
    assert recipe_args("nft-pickscore.yaml")[0].lr == 3e-4
    given = "--lr 3e-4 --base-reg 1e-4 --updates-per-iter 1 --train-steps-per-leaf 9 --ema --mixed-precision fp16"
    assert recast.parse_args([*argv, *given.split()]).ema
    with pytest.raises(SystemExit) as err:
        rvge.parse_args(["--model", SD35M, "--rewards", "pickscore", "--budgets", "1"])
    assert "--base-reg" not in str(err.value) and "--lr 0.0001" in str(err.value)
    sd35m = json.loads((ROOT / "world/assets/sd3.5-medium-transformer.json").read_text())
    for name, config in (("big", sd35m), ("tiny", {**sd35m, "num_layers": 2})):
        (tmp_path / name / "transformer").mkdir(parents=True)
        (tmp_path / name / "transformer" / "config.json").write_text(json.dumps(config))
    assert flags.needs_a_recipe(str(tmp_path / "big")) and not flags.needs_a_recipe(str(tmp_path / "tiny"))
    assert not flags.needs_a_recipe("/no/such/folder")  # check_common names a bad path


@pytest.mark.parametrize(
    "world, words",
    [
        ("4", "4 process(es) draw 24: every iteration and optimizer step loses 24 of them. To keep 48: "
         "--prompts-per-iter 12 --num-processes 4"),
        ("1", "1 process(es) draw 6: every iteration and optimizer step loses 42 of them. To keep 48: "
         "--prompts-per-iter 48 --num-processes 1"),
        ("5", "5 process(es) draw 30: every iteration and optimizer step loses 18 of them. To keep 48: no whole"),
        ("16", "16 process(es) draw 96: every iteration and optimizer step gains 48. To keep 48: --prompts-per-iter 3"),
        ("8", None),
    ],
)  # fmt: skip
def test_a_launch_of_another_process_count_names_the_batch_kept_and_lost(monkeypatch, capsys, world, words):
    """The recipes plan 8 processes x 6 groups = 48 (DiffusionNFT's epoch); a launch of another WORLD_SIZE says what
    it keeps and loses and the flags that keep 48 (1 GPU: 48, 4 GPUs: 12, 2 nodes of 8: 3); only the first process
    says it; the planned count says nothing. The dry run plans for the launch's count."""
    args, _ = recipe_args("nft-geneval.yaml")
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    checks.warn_process_count(args)
    said = capsys.readouterr()
    text = said.out + said.err
    assert (words in text and "--num-processes 8 x --prompts-per-iter 6 = 48" in text) if words else text == ""
    monkeypatch.setenv("RANK", "1")
    checks.warn_process_count(args)
    assert capsys.readouterr().out == ""
    assert preflight.planned_processes(args) == (int(world), "WORLD_SIZE of this launch")
    monkeypatch.delenv("WORLD_SIZE")
    assert preflight.planned_processes(args)[0] == 8


def test_the_counter_stands_in_for_the_transformer_in_the_real_rollout():
    """PassCounter answers sd3.velocity's call as the transformer does (a tuple, the input's shape)."""
    counter = preflight.PassCounter()
    x = torch.zeros(3, 1, 1, 1)
    out = counter(hidden_states=x, timestep=torch.zeros(3), encoder_hidden_states=None, pooled_projections=None)
    assert out[0].shape == x.shape and counter.samples == 3


def test_the_launch_names_every_bad_prompt_file_at_once(tmp_path):
    """checks.check_files (the launch's, before any model loads) names both a missing training file and a held-out
    file of one prompt, not only the first; each line as before."""
    (tmp_path / "eval.txt").write_text("one prompt\n")
    args = SimpleNamespace(
        train_prompts=str(tmp_path / "none.txt"), eval_prompts=str(tmp_path / "eval.txt"), model=SD35M, resume=""
    )
    with pytest.raises(SystemExit) as err:
        checks.check_files(args, ["pickscore"])
    first, second = str(err.value).splitlines()
    assert first.startswith(f"--train-prompts {tmp_path / 'none.txt'}: cannot read it")
    assert second.startswith(f"--eval-prompts {tmp_path / 'eval.txt'}: give at least 2 prompts")


def test_the_recipe_table_quotes_the_dry_run(tmp_path, monkeypatch):
    """configs/README.md's table is the dry run's numbers for each SD3.5-M recipe (launched from a folder without
    its prompt files, so no evaluation is counted): GPUs, samples per optimizer step, memory per GPU, seconds per
    iteration and GPU-hours per 100 iterations."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rows = {
        cells[0].strip("` "): cells
        for line in (ROOT / "configs/README.md").read_text().splitlines()
        if line.startswith("| `") and len(cells := [c.strip() for c in line.strip("|").split("|")]) == 7
    }
    recipes = [r for r in rows if r != "recast-embedded.yaml"]
    assert sorted(recipes) == sorted(
        p.name for p in (ROOT / "configs").glob("*.yaml") if p.name != "recast-embedded.yaml"
    )
    for recipe in recipes:
        args, _ = recipe_args(recipe)
        numbers = preflight.plan_run(args, args.rewards.split(","))
        plan, cost = numbers["plan"], numbers["time"]
        _, _, _, gpus, samples, memory, time = rows[recipe]
        assert int(gpus) == plan["processes"], recipe
        assert samples.endswith(f"= {plan['samples_per_step']:,.0f}"), recipe
        assert memory == f"{sum(numbers['memory_gib'].values()):.2f} GiB", recipe
        assert time == f"{cost['seconds']:.0f} s, {100 * cost['gpu_hours']:.1f}", recipe
