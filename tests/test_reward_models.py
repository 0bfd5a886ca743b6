"""Reward models: tiny random CLIP models from configs, the real RapidOCR models, a local GenEval server."""

import http.server
import io
import json
import os
import pickle
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

import recast
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


class _GenEvalHandler(http.server.BaseHTTPRequestHandler):
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
        body = pickle.dumps(
            {
                "scores": scores,
                "rewards": [0.0] * len(scores),
                "strict_rewards": strict,
                "group_rewards": {"counting": strict},
                "group_strict_rewards": {"counting": strict},
            }
        )
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def geneval_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _GenEvalHandler)
    server.batches = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


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
