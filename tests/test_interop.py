"""evaluate.py on checkpoints this project did not write: a diffusers LoRA folder, PEFT's adapter folder and
DiffusionNFT's checkpoint-N/lora, each holding a tiny run's LoRA and evaluated as the run's own checkpoint is; the
guidance option; GenEval's accuracies as DiffusionNFT reports them."""

import json
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

import evaluate
import sd3
from conftest import PickleReplyHandler, serving
from kit import reward_models


def pixel(images, prompts):  # one pixel's red value: sensitive to the model where a mean over pixels is not
    return np.array([np.asarray(im, dtype=np.float64)[3, 5, 0] / 255 for im in images])


def contrast(images, prompts):
    return np.array([np.asarray(im, dtype=np.float64).std() / 255 for im in images])


REWARDS = {"pixel": pixel, "contrast": contrast}
RECIPE = """script: recast
model: {pipe}
rewards: pixel,contrast
budgets: "0.5,0.5"
resolution: 16
max-sequence-length: 8
steps: 6
eval-prompts: {prompts}
lora-rank: 4
lora-alpha: 8
"""


@pytest.fixture(scope="module")
def lora(tiny, tmp_path_factory):
    """(recipe, {layout: folder}): one random LoRA (rank 4, alpha 8: a wrong scale shows) on the tiny SD3's transformer,
    saved as diffusers saves it (pytorch_lora_weights.safetensors with its LoraConfig as metadata, as this project's
    checkpoints), as PEFT saves an adapter (save_pretrained), and as DiffusionNFT saves a checkpoint
    (checkpoints/checkpoint-7/lora/: PEFT's save_pretrained of the model, with a second adapter "old" in old/, other
    random weights that must not be read), and a recipe of the tiny model's settings to evaluate them with."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    root = tmp_path_factory.mktemp("interop")
    (root / "recipe.yaml").write_text(RECIPE.format(pipe=tiny / "pipe", prompts=tiny / "prompts.txt"))
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=sd3.LORA_TARGETS)
    torch.manual_seed(0)
    model = get_peft_model(SD3Transformer2DModel.from_pretrained(tiny / "pipe", subfolder="transformer"), config)
    model.add_adapter("old", config)
    for name, p in model.named_parameters():
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(root / "logs" / "checkpoints" / "checkpoint-7" / "lora")  # DiffusionNFT's save_ckpt
    model.save_pretrained(root / "peft", selected_adapters=["default"])
    weights = get_peft_model_state_dict(model, adapter_name="default")  # base_model.model.<module>...
    weights = {k.removeprefix("base_model.model."): v for k, v in weights.items()}
    StableDiffusion3Pipeline.save_lora_weights(
        root / "diffusers", transformer_lora_layers=weights, transformer_lora_adapter_metadata=config.to_dict()
    )
    folders = {
        "diffusers": root / "diffusers",
        "peft": root / "peft",
        "diffusionnft": root / "logs/checkpoints/checkpoint-7",
    }
    return root / "recipe.yaml", folders


def diffusers_reference(tiny, folder, guidance):
    """The metrics of diffusers' own pipeline with the LoRA (pipe.load_lora_weights) from evaluate.py's held-out
    noise (session.EVAL_SEED), at `guidance` (diffusers' CFG with the empty negative prompt when > 1)."""
    from diffusers import StableDiffusion3Pipeline

    from kit import session

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny / "pipe")
    if folder is not None:
        pipe.load_lora_weights(folder)
    prompts = (tiny / "prompts.txt").read_text().splitlines()
    shape = (len(prompts), 4, 16 // pipe.vae_scale_factor, 16 // pipe.vae_scale_factor)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(session.EVAL_SEED))
    kw = dict(height=16, width=16, num_inference_steps=6, max_sequence_length=8, guidance_scale=guidance)
    images = pipe(prompts, latents=noise, **kw).images
    return {f"eval/{n}": float(np.mean(fn(images, prompts))) for n, fn in REWARDS.items()}


@pytest.mark.parametrize("guidance", [1.0, 4.5])
def test_a_lora_in_each_layout_evaluates_as_diffusers_samples_it(tiny, lora, tmp_path, guidance):
    """The LoRA in diffusers', PEFT's and DiffusionNFT's layouts: evaluate.py's metrics equal diffusers' pipeline's with
    the LoRA loaded by pipe.load_lora_weights, from the same noise, CFG-free and at FlowGRPO's guidance 4.5, and
    differ from the pretrained model's."""
    recipe, folders = lora
    want = diffusers_reference(tiny, folders["diffusers"], guidance)
    base = diffusers_reference(tiny, None, guidance)
    assert max(abs(want[k] - base[k]) for k in want) > 1e-2, "the LoRA does not move the metrics: nothing shown"
    flags = ["--config", str(recipe), "--guidance-scale", str(guidance)]
    for layout, folder in folders.items():
        result = tmp_path / f"{layout}.json"
        got = evaluate.main([str(folder), *flags, "--json", str(result)], extra_rewards=REWARDS)
        assert {k: got[k] for k in want} == pytest.approx(want, abs=2e-3), layout  # 8-bit images: 1/255 apart
        saved = json.loads(result.read_text())
        assert (saved["layout"], saved["guidance_scale"]) == (
            "diffusers" if layout == "diffusers" else "peft",
            guidance,
        )


def test_diffusionnfts_checkpoint_is_named_and_written_beside_its_checkpoints(lora, tmp_path):
    """checkpoint-N and checkpoint-N/lora are one checkpoint, "checkpoint-N", its result in DiffusionNFT's
    checkpoints/ folder by default; the adapter "old" beside it is not read (its metrics would differ)."""
    recipe, folders = lora
    nft_ckpt = folders["diffusionnft"]
    assert (nft_ckpt / "lora" / "old" / "adapter_model.safetensors").is_file()  # PEFT's layout of a second adapter
    first = evaluate.main([str(nft_ckpt), "--config", str(recipe)], extra_rewards=REWARDS)
    result = nft_ckpt.parent / "eval-checkpoint-7.json"
    assert json.loads(result.read_text())["checkpoint"] == "checkpoint-7"
    again = evaluate.main([str(nft_ckpt / "lora"), "--config", str(recipe), "--replace"], extra_rewards=REWARDS)
    assert again == first
    (tmp_path / "old").symlink_to(nft_ckpt / "lora" / "old")
    old = evaluate.main(
        [str(tmp_path / "old"), "--config", str(recipe), "--json", str(tmp_path / "o.json")], extra_rewards=REWARDS
    )
    assert old != first


def test_a_lora_folder_needs_a_config_and_its_weights(lora, tmp_path):
    recipe, folders = lora
    with pytest.raises(SystemExit, match="LoRA folder \\(diffusers's layout\\), not a run's: give --config FILE"):
        evaluate.main([str(folders["diffusers"])], extra_rewards=REWARDS)
    with pytest.raises(SystemExit, match="--config nowhere.yaml: no such file"):
        evaluate.main([str(folders["diffusers"]), "--config", "nowhere.yaml"], extra_rewards=REWARDS)
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "adapter_config.json").write_text("{}")
    with pytest.raises(SystemExit, match="adapter_config.json but no adapter_model.safetensors or .bin"):
        evaluate.main([str(tmp_path / "peft")], extra_rewards=REWARDS)
    with pytest.raises(SystemExit, match="nor a LoRA folder"):
        evaluate.main([str(tmp_path)], extra_rewards=REWARDS)


def test_guidance_is_one_call_of_twice_the_batch_and_1_is_the_cfg_free_sampler(tiny):
    """guided(): one call on twice the batch gives v_u + g (v_c - v_u) of two separate calls (v_u: the empty prompt's
    velocity); g = 1 returns the sampler itself, so the default samples as before."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny / "pipe")
    emb, pooled = sd3.encode(pipe, ["a red circle", "two blue square"], 8, "cpu")
    uncond = sd3.encode(pipe, [""], 8, "cpu")
    x, s = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0.7, 0.3])

    def sample(transformer, emb, pooled):  # a stand-in sampler: one velocity of the transformer it is given
        return sd3.velocity(transformer, x, s, emb, pooled)

    with torch.no_grad():
        v_c = sd3.velocity(pipe.transformer, x, s, emb, pooled)
        v_u = sd3.velocity(pipe.transformer, x, s, uncond[0].expand(2, -1, -1), uncond[1].expand(2, -1))
        got = evaluate.guided(sample, 4.5, uncond)(pipe.transformer, emb, pooled)
    torch.testing.assert_close(got, v_u + 4.5 * (v_c - v_u), atol=1e-5, rtol=1e-5)
    assert evaluate.guided(sample, 1.0, None) is sample


def test_geneval_accuracies_are_read_as_diffusionnft_reads_them(tmp_path, monkeypatch):
    """geneval_judges: accuracy ("rewards", only_strict=False), strict accuracy, each held-out tag's two, NaN on the
    other tags' images (the server's -10), one request per batch of 64 shared by every name."""
    meta = tmp_path / "meta.jsonl"
    tags = ["counting", "position", "counting"] * 30  # 90 prompts: two batches
    meta.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "tag": t, "include": []}) + "\n" for i, t in enumerate(tags))
    )
    requests = []

    def server(url, images, metadatas, only_strict=True):  # the reward server's reply (reward_server/gen_eval.py)
        requests.append((len(images), only_strict))
        correct = [float(int(m["prompt"][1:]) % 3 == 0) for m in metadatas]
        strict = [float(int(m["prompt"][1:]) % 2 == 0) for m in metadatas]

        def group(v):  # the server's per-tag lists: -10 on the images of the other tags
            return {t: [x if m["tag"] == t else -10.0 for x, m in zip(v, metadatas)] for t in ("counting", "position")}

        return {"scores": strict, "rewards": correct, "strict_rewards": strict, "group_rewards": group(correct),
                "group_strict_rewards": group(strict)}  # fmt: skip

    monkeypatch.setattr(reward_models, "geneval_request", server)
    prompts = [f"p{i}" for i in range(90)]
    judges = reward_models.geneval_judges(dict(geneval_metadata=str(meta)), prompts)
    assert sorted(judges) == sorted(
        ["geneval_accuracy", "geneval_strict_accuracy"]
        + [f"geneval_{t}_{a}" for t in ("counting", "position") for a in ("accuracy", "strict_accuracy")]
    )
    images = [Image.new("RGB", (4, 4))] * 90
    got = {name: judge(images, prompts) for name, judge in judges.items()}
    assert requests == [(64, False), (26, False)]  # one request per batch for all six names
    i = np.arange(90)
    np.testing.assert_array_equal(got["geneval_accuracy"], (i % 3 == 0).astype(float))
    np.testing.assert_array_equal(got["geneval_strict_accuracy"], (i % 2 == 0).astype(float))
    counting = np.array([t == "counting" for t in tags])
    np.testing.assert_array_equal(np.isnan(got["geneval_position_strict_accuracy"]), counting)
    assert np.nanmean(got["geneval_counting_strict_accuracy"]) == pytest.approx(np.mean((i % 2 == 0)[counting]))
    judges["geneval_accuracy"](list(images), prompts)  # a new list of images: asked again
    assert len(requests) == 4


class _GenEvalServer(PickleReplyHandler):
    """The reward server's protocol (reward_server/gen_eval.py's compute_geneval): each prompt's metadata says what
    it scores ("want": partial credit; correct and strict-correct from it)."""

    def do_POST(self):
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        metas = data["meta_datas"]
        self.server.requests.append((len(metas), data["only_strict"]))
        scores = [m["want"] for m in metas]
        correct, strict = [float(s >= 0.5) for s in scores], [float(s == 1.0) for s in scores]
        tags = ("single_object", "counting")
        group = lambda v: {t: [x if m["tag"] == t else -10.0 for x, m in zip(v, metas)] for t in tags}  # noqa: E731
        self.reply(
            {
                "scores": scores,
                "rewards": correct,
                "strict_rewards": strict,
                "group_rewards": group(correct),
                "group_strict_rewards": group(strict),
            }  # fmt: skip
        )


def test_evaluate_with_the_geneval_reward_reports_diffusionnfts_accuracies(tiny, lora, tmp_path):
    """A recipe with the geneval reward: evaluate.py logs the partial credit (eval/geneval) and, as held-out judges,
    the accuracy, strict accuracy and each tag's of the held-out prompts, from the server's replies."""
    prompts = (tiny / "prompts.txt").read_text().splitlines()  # 4 prompts: tags and credits below
    wants, tags = [1.0, 0.5, 0.25, 1.0], ["single_object", "counting", "counting", "counting"]
    metadata = tmp_path / "meta.jsonl"
    metadata.write_text(
        "".join(json.dumps({"prompt": p, "tag": t, "want": w}) + "\n" for p, t, w in zip(prompts, tags, wants))
    )
    with serving(_GenEvalServer, requests=[]) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        recipe = tmp_path / "geneval.yaml"
        text = lora[0].read_text().replace("rewards: pixel,contrast", "rewards: geneval").replace('"0.5,0.5"', '"1"')
        recipe.write_text(text + f"geneval-url: {url}\ngeneval-metadata: {metadata}\n")
        got = evaluate.main([str(lora[1]["diffusers"]), "--config", str(recipe), "--json", str(tmp_path / "g.json")])
    assert server.requests == [(4, True), (4, False)]  # the training reward's request, then the accuracies'
    assert got["eval/geneval"] == pytest.approx(np.mean(wants))
    assert got["eval/judge/geneval_accuracy"] == pytest.approx(0.75)  # correct: credit >= 0.5 here
    assert got["eval/judge/geneval_strict_accuracy"] == pytest.approx(0.5)
    assert got["eval/judge/geneval_single_object_strict_accuracy"] == pytest.approx(1.0)
    assert got["eval/judge/geneval_counting_strict_accuracy"] == pytest.approx(1 / 3)  # the -10 of other tags: left out
    assert got["eval/judge/geneval_counting_accuracy"] == pytest.approx(2 / 3)
    assert not [k for k in got if "colors" in k]  # no held-out prompt of that tag
