"""Reward models: tiny random CLIP models from configs, the real RapidOCR models, a local GenEval server."""

import io
import json
import os
import pickle
import socket
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import recast
from conftest import PickleReplyHandler, serving
from kit import reward_models

# -----------------------------------------------------------------------------
# Reward models: tiny random CLIP from configs, real RapidOCR models, a local GenEval server
# -----------------------------------------------------------------------------

PROMPTS = ['a sign that says "HELLO"', "a red square on a blue field", "a cat", "two dogs in the snow"]


def _images(n, seed=0, size=40):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A random CLIP (hidden 32, projection 16, 32x32 images) + tokenizer + image processor, saved to disk."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor, CLIPTokenizer

    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor  # no torchvision needed, no warning
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor

    chars = [chr(c) for c in range(33, 127)]
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in chars + [c + "</w>" for c in chars]:
        vocab[token] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tower = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(
        text_config=dict(
            tower, vocab_size=len(vocab), max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1
        ),
        vision_config=dict(tower, image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_clip")
    CLIPModel(config).save_pretrained(path)
    image_processor = ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return str(path)


def _opts(tiny_clip, **kw):
    base = dict(
        device="cpu",
        dtype="float32",
        local_files_only=True,
        pickscore_model=tiny_clip,
        pickscore_processor=tiny_clip,
        clip_model=tiny_clip,
    )
    return SimpleNamespace(**{**base, **kw})


def _forward(path, images, prompts):
    """Scores through CLIPModel.forward, a different code path: (cos (N,), exp(logit_scale))."""
    from transformers import CLIPModel, CLIPProcessor

    model, proc = CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
    with torch.no_grad():
        out = model(**proc(text=prompts, images=images, padding=True, return_tensors="pt"))
        scale = model.logit_scale.exp()
        return (out.logits_per_image.diagonal() / scale).double().numpy(), scale.item()


def test_import_loads_no_model():
    """reward_models loads no framework at import; the scripts import torch (a hard dependency) but no model
    library: transformers, diffusers and the OCR runtime load when a run builds its models."""
    code = (
        "from kit import reward_models; import sys; "
        "assert not {'torch', 'transformers', 'rapidocr_onnxruntime'} & set(sys.modules); "
        "import recast, rvge; "
        "assert not {'transformers', 'diffusers', 'rapidocr_onnxruntime'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(recast.__file__))


def test_unknown_or_repeated_name_lists_known_rewards():
    with pytest.raises(ValueError, match=r"unknown reward 'pickscor'.*--rewards.*aesthetic, clipscore, count"):
        reward_models.build_rewards("pickscor,ocr", None, extra={"count": lambda i, p: np.zeros(len(i))})
    with pytest.raises(ValueError, match="distinct"):
        reward_models.build_rewards(["ocr", "ocr"], None)


def test_extra_rewards_keep_order_and_load_nothing():
    a, b = (lambda i, p: np.ones(len(i))), (lambda i, p: np.zeros(len(i)))
    assert reward_models.build_rewards(["b", "a"], None, extra={"a": a, "b": b}) == [b, a]


def test_clipscore_is_the_cosine_of_the_model(tiny_clip):
    images = _images(4)
    (reward,) = reward_models.build_rewards(["clipscore"], _opts(tiny_clip))
    got = reward(images, PROMPTS)
    cos, _ = _forward(tiny_clip, images, PROMPTS)
    assert got.dtype == np.float64 and got.shape == (4,)
    np.testing.assert_allclose(got, cos, atol=1e-5)


def test_pickscore_scale_batching_and_cache(tiny_clip):
    images = _images(2, seed=1)
    images, prompts = images * 18, PROMPTS[:2] * 18  # 36 images: two chunks of REWARD_BATCH = 32
    (reward,) = reward_models.build_rewards(["pickscore"], _opts(tiny_clip))
    got = reward(images, prompts)
    assert got.shape == (36,) and np.isfinite(got).all()
    np.testing.assert_allclose(got, np.tile(got[:2], 18), atol=1e-6)  # same pair, same score, any chunk
    cos, scale = _forward(tiny_clip, images[:2], prompts[:2])
    np.testing.assert_allclose(got[:2], scale * cos / 26, atol=1e-5)
    info = reward_models.load_clip.cache_info()
    reward_models.build_rewards(["pickscore"], _opts(tiny_clip))
    assert (
        reward_models.load_clip.cache_info().hits == info.hits + 1
        and reward_models.load_clip.cache_info().misses == info.misses
    )


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_aesthetic_is_mlp_of_normalised_image_embedding(tiny_clip, tmp_path, fmt):

    torch.manual_seed(1)
    mlp = reward_models.aesthetic_mlp(16).eval()  # the tiny CLIP's projection size
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    path = tmp_path / f"mlp.{fmt}"
    if fmt == "pth":
        torch.save(mlp.state_dict(), path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in mlp.state_dict().items()}, str(path))
    images = _images(3, seed=2)
    with pytest.raises(ValueError, match="--aesthetic-mlp"):
        reward_models.build_rewards(["aesthetic"], _opts(tiny_clip, aesthetic_mlp=""))  # recast.py's Args default
    (reward,) = reward_models.build_rewards(["aesthetic"], _opts(tiny_clip, aesthetic_mlp=str(path), dtype=""))
    got = reward(images, PROMPTS[:3])
    model, proc = reward_models.load_clip(tiny_clip, tiny_clip, "cpu", "float32", True)
    with torch.no_grad():
        emb = model.get_image_features(**proc(images=images, return_tensors="pt")).pooler_output
        want = mlp(emb / emb.norm(dim=-1, keepdim=True))[:, 0].double().numpy()
    assert got.shape == (3,)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert abs(got[0] - got[1]) > 1e-6  # the image matters


def test_ocr_formula_by_hand():
    assert reward_models.ocr_target('a sign that says "Hello World" in neon') == "Hello World"
    assert reward_models.ocr_target("no quotes here") is None
    assert reward_models.ocr_score("HELLOWORLD", "hello world") == 1.0  # spaces and case ignored
    assert reward_models.ocr_score("xx hello world yy", "Hello World") == 1.0  # substring: d = 0
    assert reward_models.ocr_score("HELL0", "hello") == pytest.approx(0.8)  # one substitution: 1 - 1/5
    assert reward_models.ocr_score("", "hello") == 0.0  # d = 5 = |target|
    assert reward_models.ocr_score("abcdefghijklmnop", "hello") == 0.0  # d clipped at |target|
    assert np.isnan(reward_models.ocr_score("hello", " "))


def _render(text):
    image = Image.new("RGB", (512, 512), "white")
    ImageDraw.Draw(image).text((40, 200), text, fill="black", font=ImageFont.load_default(size=80))
    return image


def test_ocr_reads_rendered_text():
    (reward,) = reward_models.build_rewards(["ocr"], None)
    got = reward(
        [_render("HELLO"), _render(""), _render("WORLD"), _render("HELLO")],
        ['A sign that says "HELLO"'] * 3 + ["a sign with no quoted text"],
    )
    assert got[0] > 0.99  # read back exactly
    assert got[1] == 0.0  # nothing to read
    assert got[2] == pytest.approx(0.2)  # reads "WORLD": Levenshtein("world", "hello") = 4 -> 1 - 4/5
    assert np.isnan(got[3])  # reward does not apply


def test_ocr_engine_failure_gives_nan_not_a_crash(monkeypatch):
    calls = []

    def flaky(image, use_cls=False):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("onnxruntime: bad input")
        return [(None, "HELLO", 0.9)], None

    monkeypatch.setattr(reward_models, "load_ocr", lambda: flaky)
    (reward,) = reward_models.build_rewards(["ocr"], None)
    got = reward([_render("HELLO")] * 3, ['a sign that says "HELLO"'] * 3)
    assert got[0] == 1.0 and np.isnan(got[1]) and got[2] == 1.0


def test_ocr_training_prompts_must_quote_their_text(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text('a sign that says "OPEN"\na red barn at dusk\n')
    argv = [
        "--model",
        "stabilityai/stable-diffusion-3.5-medium",
        "--allow-embedded-defaults",
        "--rewards",
        "ocr",
        "--budgets",
        "1",
        "--device",
        "cpu",
        "--train-prompts",
        str(prompts),
        "--out",
        str(tmp_path / "run"),
    ]
    with pytest.raises(SystemExit, match="quote nothing, the first: 'a red barn at dusk'"):
        recast.validate(recast.parse_args(argv))
    assert not (tmp_path / "run").exists()


class _GenEvalHandler(PickleReplyHandler):
    """Speaks the reward-server protocol; score = metadata "want" if the image's red channel is bright."""

    def do_POST(self):
        data = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.batches.append((len(data["images"]), data["only_strict"]))
        if any(m["tag"] == "crash" for m in data["meta_datas"]):
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"Traceback: KeyError 'class'")
            return
        images = [Image.open(io.BytesIO(b), formats=["jpeg"]) for b in data["images"]]
        scores = [m["want"] * float(np.asarray(im)[..., 0].mean() > 128) for im, m in zip(images, data["meta_datas"])]
        strict = [float(s == 1.0) for s in scores]
        self.reply(
            {
                "scores": scores,
                "rewards": [0.0] * len(scores),
                "strict_rewards": strict,
                "group_rewards": {"counting": strict},
                "group_strict_rewards": {"counting": strict},
            }
        )


@pytest.fixture
def geneval_server():
    with serving(_GenEvalHandler, batches=[]) as server:
        yield server


def test_geneval_client_decodes_server_scores(geneval_server, tmp_path):
    meta = tmp_path / "meta.jsonl"
    rows = [
        {"tag": "counting", "include": [{"class": "dog", "count": 2}], "prompt": f"p{i}", "want": i / 70}
        for i in range(70)
    ]
    rows += [
        {"tag": "counting", "include": [], "prompt": "full", "want": 1.0},
        {"tag": "crash", "include": [], "prompt": "bad", "want": 0.0},
    ]
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    url = f"http://127.0.0.1:{geneval_server.server_address[1]}"
    red, black = Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 0))
    images, prompts = [red if i % 2 else black for i in range(70)], [f"p{i}" for i in range(70)]
    (reward,) = reward_models.build_rewards(["geneval"], SimpleNamespace(geneval_url=url, geneval_metadata=str(meta)))
    got = reward(images, prompts)
    np.testing.assert_allclose(got, [(i % 2) * i / 70 for i in range(70)])
    assert geneval_server.batches == [(64, True), (6, True)]
    (strict,) = reward_models.build_rewards(
        ["geneval"], dict(geneval_url=url, geneval_metadata=str(meta), geneval_key="strict_rewards")
    )
    assert strict([red, black, red], ["full", "full", "p1"]).tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(RuntimeError, match="(?s)answered 500.*KeyError"):
        reward([red], ["bad"])
    with pytest.raises(ValueError, match="no GenEval metadata for prompt 'p999'"):
        reward([red], ["p999"])


def test_geneval_needs_metadata_a_valid_key_and_a_server():
    with pytest.raises(ValueError, match="--geneval-metadata"):
        reward_models.build_rewards(["geneval"], None)
    with pytest.raises(ValueError, match="--geneval-key"):
        reward_models.build_rewards(["geneval"], dict(geneval_key="score"))
    with pytest.raises(RuntimeError, match="no GenEval server"):
        reward_models.geneval_request("http://127.0.0.1:9", [Image.new("RGB", (8, 8))], [{}], retries=1, timeout=2)


def test_jsonl_joined_by_awk_reads_and_fused_by_cat_is_refused_naming_the_line(tmp_path):
    """configs/README.md joins two metadata files with `awk 1`: a first file without its final newline stays two
    records; `cat` fuses them, and the reader names the line and the fix instead of JSONDecodeError's "Extra data"."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"prompt": "a cat", "tag": "single_object"}\n{"prompt": "a dog", "tag": "single_object"}')
    b.write_text('{"prompt": "two cats", "tag": "counting"}\n')
    joined, fused = tmp_path / "joined.jsonl", tmp_path / "fused.jsonl"
    subprocess.run(f"awk 1 {a} {b} > {joined} && cat {a} {b} > {fused}", shell=True, check=True)
    assert set(reward_models.load_geneval_metadata(str(joined))) == {"a cat", "a dog", "two cats"}
    with pytest.raises(ValueError, match=r"fused.jsonl, line 2: not one JSON object \(Extra data\).*awk 1"):
        reward_models.load_geneval_metadata(str(fused))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty hub cache and HF_HUB_OFFLINE: nothing here may reach the network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_missing_weights_files_and_servers_are_named_with_flag_and_fix(offline_hub, tiny_clip, tmp_path):
    """missing_inputs: hub ids neither in the cache nor reachable (offline), a folder without the model's file, the
    aesthetic MLP and GenEval metadata files, a GenEval address nobody answers at; a folder, a cached hub id and the
    bundled OCR models pass."""
    flags = dict(geneval_url="http://127.0.0.1:9", clip_model=str(tiny_clip))
    assert reward_models.missing_inputs(["clipscore", "ocr"], flags) == []
    problems = reward_models.missing_inputs(["pickscore", "aesthetic", "geneval"], {**flags, "aesthetic_mlp": "a.pth"})
    assert [p.split(" ")[0] for p in problems] == [
        "--pickscore-model",
        "--pickscore-processor",
        "--aesthetic-mlp",
        "--geneval-metadata",
        "--geneval-url",
    ]
    assert problems[0].startswith("--pickscore-model yuvalkirstain/PickScore_v1: not in the local hub cache and ")
    assert "HF_HUB_OFFLINE is set; download it" in problems[0] and "a.pth: no such file" in problems[2]
    assert "http://127.0.0.1:9: no server answers there" in problems[4]
    snapshot = offline_hub / "models--yuvalkirstain--PickScore_v1" / "snapshots" / "abc"  # the hub cache's layout
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (offline_hub / "models--yuvalkirstain--PickScore_v1" / "refs").mkdir()
    (offline_hub / "models--yuvalkirstain--PickScore_v1" / "refs" / "main").write_text("abc")
    problems = reward_models.missing_inputs(["pickscore"], {"pickscore_processor": str(tmp_path)})
    assert problems == [f"--pickscore-processor {tmp_path}: no preprocessor_config.json in that folder"]
    problems = reward_models.missing_inputs(["hpsv2"], {"hpsv2_config": str(tiny_clip), "hpsv2_checkpoint": "h.pt"})
    assert problems == ["--hpsv2-checkpoint h.pt: no such file; " + reward_models.HPSV2_FIX]


def test_a_reward_without_its_weights_or_server_fails_before_the_pipeline_loads(offline_hub, tmp_path, monkeypatch):
    """`--rewards pickscore` offline without the weights once retried five times per file and ended in an OSError
    after the pipeline had loaded; now validate refuses it, naming the flag and the hub id, and nothing is
    written. A GenEval server that answers passes (here a socket that listens)."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    argv = ["--model", "stabilityai/stable-diffusion-3.5-medium", "--allow-embedded-defaults", "--device", "cpu"]
    argv += ["--budgets", "1"]
    argv += ["--train-prompts", str(prompts), "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as err:
        recast.validate(recast.parse_args([*argv, "--rewards", "pickscore"]))
    assert str(err.value).startswith("--rewards pickscore: a reward model cannot start:\n  --pickscore-model ")
    assert not (tmp_path / "run").exists()
    meta = tmp_path / "meta.jsonl"
    meta.write_text('{"tag": "counting", "include": [], "prompt": "a cat"}\n')
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        args = recast.parse_args([*argv, "--rewards", "geneval", "--geneval-url", url, "--geneval-metadata", str(meta)])
        assert recast.validate(args)[0] == ["geneval"]


# -----------------------------------------------------------------------------
# HPSv2: an open_clip checkpoint in transformers' CLIP, against open_clip's forward written out
# -----------------------------------------------------------------------------

WIDTH, LAYERS, HEADS, PATCH, IMAGE, EMBED = 32, 2, 4, 8, 32, 16


def _open_clip_state(vocab, seed=0):
    """A random state dict with open_clip's CLIP keys and shapes (the tiny CLIP's sizes; ViT-H-14's are width 1280 and
    1024, 32 and 24 layers, patch 14, image 224, embedding 1024)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    def block(prefix):
        return {
            f"{prefix}ln_1.weight": 1 + rand(WIDTH),
            f"{prefix}ln_1.bias": rand(WIDTH),
            f"{prefix}attn.in_proj_weight": rand(3 * WIDTH, WIDTH),
            f"{prefix}attn.in_proj_bias": rand(3 * WIDTH),
            f"{prefix}attn.out_proj.weight": rand(WIDTH, WIDTH),
            f"{prefix}attn.out_proj.bias": rand(WIDTH),
            f"{prefix}ln_2.weight": 1 + rand(WIDTH),
            f"{prefix}ln_2.bias": rand(WIDTH),
            f"{prefix}mlp.c_fc.weight": rand(37, WIDTH),
            f"{prefix}mlp.c_fc.bias": rand(37),
            f"{prefix}mlp.c_proj.weight": rand(WIDTH, 37),
            f"{prefix}mlp.c_proj.bias": rand(WIDTH),
        }

    state = {
        "visual.class_embedding": rand(WIDTH),
        "visual.positional_embedding": rand((IMAGE // PATCH) ** 2 + 1, WIDTH),
        "visual.conv1.weight": rand(WIDTH, 3, PATCH, PATCH),
        "visual.ln_pre.weight": 1 + rand(WIDTH),
        "visual.ln_pre.bias": rand(WIDTH),
        "visual.ln_post.weight": 1 + rand(WIDTH),
        "visual.ln_post.bias": rand(WIDTH),
        "visual.proj": rand(WIDTH, EMBED),
        "token_embedding.weight": rand(vocab, WIDTH),
        "positional_embedding": rand(77, WIDTH),
        "ln_final.weight": 1 + rand(WIDTH),
        "ln_final.bias": rand(WIDTH),
        "text_projection": rand(WIDTH, EMBED),
        "logit_scale": torch.tensor(4.6052),
        "attn_mask": torch.full((77, 77), float("-inf")).triu(1),  # open_clip's causal mask, a buffer
    }
    for i in range(LAYERS):
        state |= block(f"visual.transformer.resblocks.{i}.") | block(f"transformer.resblocks.{i}.")
    return state


def _open_clip_forward(state, pixels, ids, eos):
    """open_clip's CLIP forward written out from its state dict (pre-LN residual blocks, packed attention, exact GELU,
    the class token's output through ln_post and proj; the text's causal attention pooled at the end-of-text token):
    the cosine of the normalised image and text features, (N,)."""
    import torch.nn.functional as F

    def blocks(x, prefix, causal):
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1) if causal else torch.zeros(n, n)
        for i in range(LAYERS):
            p = lambda name: state[f"{prefix}{i}.{name}"]  # noqa: E731
            h = F.layer_norm(x, (WIDTH,), p("ln_1.weight"), p("ln_1.bias"))
            q, k, v = (h @ p("attn.in_proj_weight").T + p("attn.in_proj_bias")).chunk(3, dim=-1)
            q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in (q, k, v))  # (N, heads, n, d)
            att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask, -1) @ v
            x = x + att.transpose(1, 2).flatten(2) @ p("attn.out_proj.weight").T + p("attn.out_proj.bias")
            h = F.layer_norm(x, (WIDTH,), p("ln_2.weight"), p("ln_2.bias"))
            x = x + F.gelu(h @ p("mlp.c_fc.weight").T + p("mlp.c_fc.bias")) @ p("mlp.c_proj.weight").T
            x = x + p("mlp.c_proj.bias")
        return x

    x = F.conv2d(pixels, state["visual.conv1.weight"], stride=PATCH).flatten(2).transpose(1, 2)  # (N, g*g, width)
    x = torch.cat([state["visual.class_embedding"].expand(len(x), 1, -1), x], 1) + state["visual.positional_embedding"]
    x = blocks(
        F.layer_norm(x, (WIDTH,), state["visual.ln_pre.weight"], state["visual.ln_pre.bias"]),
        "visual.transformer.resblocks.",
        False,
    )
    img = (
        F.layer_norm(x[:, 0], (WIDTH,), state["visual.ln_post.weight"], state["visual.ln_post.bias"])
        @ state["visual.proj"]
    )
    t = state["token_embedding.weight"][ids] + state["positional_embedding"][: ids.shape[1]]
    t = F.layer_norm(
        blocks(t, "transformer.resblocks.", True), (WIDTH,), state["ln_final.weight"], state["ln_final.bias"]
    )
    last = (ids == eos).int().argmax(-1)  # open_clip: ids.argmax(-1), its end-of-text token having the largest id
    txt = t[torch.arange(len(ids)), last] @ state["text_projection"]
    return F.cosine_similarity(img, txt, dim=-1)


@pytest.fixture(scope="module")
def tiny_hpsv2(tiny_clip, tmp_path_factory):
    """(checkpoint path, config folder, state): an open_clip state dict as HPS_v2.1_compressed.pt stores it
    ({"state_dict": ...}), and the tiny CLIP's config with ViT-H-14's exact GELU, beside its tokenizer."""
    from transformers import AutoTokenizer, CLIPConfig

    folder = tmp_path_factory.mktemp("tiny_hpsv2")
    config = CLIPConfig.from_pretrained(tiny_clip)
    config.text_config.hidden_act = config.vision_config.hidden_act = "gelu"
    config.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_clip)
    tokenizer.save_pretrained(folder)
    state = _open_clip_state(len(tokenizer))
    torch.save({"epoch": 1, "state_dict": state}, folder / "hps.pt")
    return str(folder / "hps.pt"), str(folder), state


def test_open_clip_to_hf_consumes_every_key_and_refuses_a_stranger(tiny_hpsv2):
    from transformers import CLIPConfig, CLIPModel

    _, config, state = tiny_hpsv2
    converted = reward_models.open_clip_to_hf(state)
    model_state = CLIPModel(CLIPConfig.from_pretrained(config)).state_dict()
    assert set(converted) == {k for k in model_state if not k.endswith("position_ids")}
    assert all(converted[k].shape == model_state[k].shape for k in converted)
    q = converted["text_model.encoder.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(q, state["transformer.resblocks.1.attn.in_proj_weight"][:WIDTH])
    assert torch.equal(converted["visual_projection.weight"], state["visual.proj"].T)
    with pytest.raises(ValueError, match="'visual.head.weight' has no CLIPModel counterpart"):
        reward_models.open_clip_to_hf({**state, "visual.head.weight": torch.zeros(1)})


def test_hpsv2_preprocessing_resizes_the_longer_side_pads_and_normalises():
    image = Image.fromarray(np.full((40, 48, 3), 255, np.uint8))  # H 40, W 48 -> 27 x 32, padded 2 above, 3 below
    x = reward_models.hpsv2_pixels([image, Image.fromarray(np.zeros((32, 32, 3), np.uint8))], 32)
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])
    assert x.shape == (2, 3, 32, 32)
    white, black = (1 - mean) / std, -mean / std
    torch.testing.assert_close(x[0, :, 2:29, :].mean((1, 2)), white, atol=1e-3, rtol=0)
    torch.testing.assert_close(x[0, :, [0, 1, 29, 30, 31], :].amax((1, 2)), black)  # the padding: zeros
    torch.testing.assert_close(x[1], black[:, None, None].expand(3, 32, 32))  # the target size: no resize


def test_hpsv2_is_open_clips_cosine_of_the_converted_checkpoint(tiny_hpsv2):
    """The reward through transformers' CLIP equals open_clip's forward of the same state dict (written out above) on
    the same pixels and tokens: the conversion keeps the model."""
    from transformers import AutoTokenizer

    path, config, state = tiny_hpsv2
    images = _images(4, seed=3, size=40)
    (reward,) = reward_models.build_rewards(["hpsv2"], _opts(config, hpsv2_checkpoint=path, hpsv2_config=config))
    got = reward(images, PROMPTS)
    tokenizer = AutoTokenizer.from_pretrained(config)
    ids = tokenizer(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = _open_clip_forward(state, reward_models.hpsv2_pixels(images, IMAGE), ids, tokenizer.eos_token_id)
    assert got.shape == (4,) and np.ptp(got) > 1e-3
    np.testing.assert_allclose(got, want.double().numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="--hpsv2-checkpoint PATH to HPS_v2.1_compressed.pt"):
        reward_models.build_rewards(["hpsv2"], _opts(config, hpsv2_checkpoint=""))
