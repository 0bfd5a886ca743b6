"""Reward models for the real model (SD3.5-Medium), shared by recast.py and rvge.py.

Every reward is a callable (images: list[PIL.Image], prompts: list[str]) -> np.ndarray float64
of shape (N,). NaN means "this reward does not apply to this image" (the scripts' optimality()
then gives r = 0.5). Models load lazily, once per process per (path, device, dtype), so building
the same reward twice does not reload, and importing this module loads no model.

opts (the scripts' Args, a namespace or a dict; a missing, None or "" field takes DEFAULTS):
device, dtype, local_files_only, pickscore_model, pickscore_processor, clip_model,
aesthetic_clip, aesthetic_mlp, hpsv2_checkpoint, hpsv2_config, geneval_url, geneval_metadata, geneval_key.

The embedded model's rewards are programs in world.REWARDS; the scripts pass them (and
any test rewards) as `extra`.
"""

import functools
import importlib.util
import io
import json
import os
import pickle
import time
import urllib.error
import urllib.request
from collections import OrderedDict

import numpy as np

REWARD_BATCH = 32  # images per forward pass of a reward model
DEFAULTS = dict(
    device="cpu",
    dtype="float32",
    local_files_only=False,
    pickscore_model="yuvalkirstain/PickScore_v1",
    pickscore_processor="laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
    clip_model="openai/clip-vit-large-patch14",
    aesthetic_clip=None,
    aesthetic_mlp=None,
    hpsv2_checkpoint=None,
    hpsv2_config="laion/CLIP-ViT-H-14-laion2B-s32B-b79K",  # HPSv2's architecture (OpenCLIP ViT-H-14) and tokenizer
    geneval_url="http://127.0.0.1:18085",
    geneval_metadata=None,
    geneval_key="scores",
)


def _opt(opts, name):
    """opts.name (or opts[name]), falling back to DEFAULTS[name] when missing, None or ""."""
    value = opts.get(name) if isinstance(opts, dict) else getattr(opts, name, None)
    return DEFAULTS[name] if value is None or value == "" else value


@functools.lru_cache(maxsize=None)
def load_clip(model_path, processor_path, device, dtype, local_files_only):
    """A CLIP-family model (eval, frozen, on device in dtype) and its processor, cached per process."""
    import torch
    from transformers import AutoModel, AutoProcessor

    model = AutoModel.from_pretrained(model_path, local_files_only=local_files_only)
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)
    processor = AutoProcessor.from_pretrained(processor_path, local_files_only=local_files_only)
    return model, processor


def _clip_from_opts(opts, model, processor):
    dtype = str(_opt(opts, "dtype")).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
    return load_clip(model, processor, str(_opt(opts, "device")), dtype, bool(_opt(opts, "local_files_only")))


def _features(out):
    """transformers 5 get_*_features returns a ModelOutput whose pooler_output is the projected
    embedding; transformers 4 returned the tensor itself."""
    return getattr(out, "pooler_output", out)


def clip_embeddings(model, processor, images, prompts=None):
    """L2-normalised CLIP embeddings in float32: image (N, D) and, given prompts, text (N, D).
    Texts are truncated to CLIP's 77 tokens."""
    import torch

    param = next(model.parameters())
    with torch.no_grad():
        pix = processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
        img = _features(model.get_image_features(pixel_values=pix.to(param.device, param.dtype))).float()
        img = img / img.norm(dim=-1, keepdim=True)
        if prompts is None:
            return img, None
        tok = processor(text=list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt")
        txt = _features(model.get_text_features(**{k: v.to(param.device) for k, v in tok.items()})).float()
        return img, txt / txt.norm(dim=-1, keepdim=True)


def _batched(score_chunk, images, prompts, batch=REWARD_BATCH):
    """Apply score_chunk(images, prompts) -> (n,) to chunks of `batch` images; float64 (N,)."""
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts: one prompt per image")
    out = [
        np.asarray(score_chunk(images[i : i + batch], prompts[i : i + batch]), dtype=np.float64)
        for i in range(0, len(images), batch)
    ]
    return np.concatenate(out) if out else np.zeros(0)


def pickscore_reward(opts):
    """PickScore (Kirstain et al. 2023), scaled as FlowGRPO and DiffusionNFT do (pickscore_scorer.py):
    R = exp(logit_scale) * cos(e_img, e_txt) / 26, CLIP-H embeddings. exp(logit_scale) is ~100, so the
    usual raw PickScore of ~20-23 for SD3.5-M samples becomes R ~ 0.77-0.88; |R| <= exp(logit_scale) / 26."""
    model, processor = _clip_from_opts(opts, _opt(opts, "pickscore_model"), _opt(opts, "pickscore_processor"))

    def score(images, prompts):
        img, txt = clip_embeddings(model, processor, images, prompts)
        return (model.logit_scale.exp().float() * (img * txt).sum(-1) / 26.0).cpu().numpy()

    return lambda images, prompts: _batched(score, images, prompts)


def clipscore_reward(opts):
    """CLIPScore as DiffusionNFT uses it: R = cos(e_img, e_txt) in [-1, 1] (~0.15-0.40 for CLIP-L on
    matching pairs). DiffusionNFT writes logits_per_image / 100, the same number for CLIP-L, whose
    exp(logit_scale) is 100. (Later FlowGRPO copies divide by 30; Hessel et al.'s is 2.5 * max(cos, 0).)"""
    model, processor = _clip_from_opts(opts, _opt(opts, "clip_model"), _opt(opts, "clip_model"))

    def score(images, prompts):
        img, txt = clip_embeddings(model, processor, images, prompts)
        return (img * txt).sum(-1).cpu().numpy()

    return lambda images, prompts: _batched(score, images, prompts)


def aesthetic_mlp(dim=768):
    """LAION improved-aesthetic-predictor head: Linear(dim,1024) Drop(.2) Linear(1024,128) Drop(.2)
    Linear(128,64) Drop(.1) Linear(64,16) Linear(16,1), in .layers, so its state-dict keys are
    layers.{0,2,4,6,7}.{weight,bias} as in sac+logos+ava1-l14-linearMSE.pth. dim = 768 for CLIP ViT-L/14."""
    import torch.nn as nn

    layers = nn.Sequential(
        nn.Linear(dim, 1024),
        nn.Dropout(0.2),
        nn.Linear(1024, 128),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.Dropout(0.1),
        nn.Linear(64, 16),
        nn.Linear(16, 1),
    )
    return nn.Sequential(OrderedDict(layers=layers))  # the outer name gives the "layers." key prefix


@functools.lru_cache(maxsize=None)
def load_aesthetic_mlp(path, device):
    """aesthetic_mlp weights from a .pth state dict or a .safetensors file; eval, float32, on device.
    Cached per process. The input size is read from layers.0.weight."""
    import torch

    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    mlp = aesthetic_mlp(state["layers.0.weight"].shape[1])
    mlp.load_state_dict(state)
    return mlp.to(device).eval().requires_grad_(False)


def aesthetic_reward(opts):
    """LAION aesthetic score: R = MLP(e_img / |e_img|), e_img the CLIP ViT-L/14 image embedding
    (aesthetic_clip, default clip_model). Trained to regress 1-10 ratings; real images score ~4-7,
    unbounded in principle. The prompt is ignored."""
    path, clip = _opt(opts, "aesthetic_mlp"), _opt(opts, "aesthetic_clip") or _opt(opts, "clip_model")
    if path is None or not os.path.isfile(path):
        raise ValueError(
            f"aesthetic needs the MLP weights file, got {path!r}: pass --aesthetic-mlp PATH to "
            "sac+logos+ava1-l14-linearMSE.pth (christophschuhmann/improved-aesthetic-predictor)"
        )
    model, processor = _clip_from_opts(opts, clip, clip)
    mlp = load_aesthetic_mlp(str(path), str(_opt(opts, "device")))

    def score(images, prompts):
        import torch

        with torch.no_grad():
            return mlp(clip_embeddings(model, processor, images)[0])[:, 0].cpu().numpy()

    return lambda images, prompts: _batched(score, images, prompts)


# HPSv2 (Wu et al. 2023) is an OpenCLIP ViT-H-14 fine-tuned on human preferences. open_clip needs torchvision, which
# this project does not install, so its checkpoint is loaded into transformers' CLIPModel: OPEN_CLIP_TO_HF renames each
# open_clip key by its prefix (open_clip's, CLIPModel's, and whether the matrix is transposed: open_clip's projections
# are (width, D) parameters, HF's (D, width) Linear weights), BLOCK_TO_HF the keys inside a residual block, and
# open_clip_to_hf splits each attention's packed in_proj into HF's q, k, v.
OPEN_CLIP_TO_HF = [
    ("visual.class_embedding", "vision_model.embeddings.class_embedding", False),
    ("visual.positional_embedding", "vision_model.embeddings.position_embedding.weight", False),
    ("visual.conv1.weight", "vision_model.embeddings.patch_embedding.weight", False),
    ("visual.ln_pre.", "vision_model.pre_layrnorm.", False),  # sic: HF's name
    ("visual.ln_post.", "vision_model.post_layernorm.", False),
    ("visual.proj", "visual_projection.weight", True),
    ("visual.transformer.resblocks.", "vision_model.encoder.layers.", False),
    ("token_embedding.weight", "text_model.embeddings.token_embedding.weight", False),
    ("positional_embedding", "text_model.embeddings.position_embedding.weight", False),
    ("ln_final.", "text_model.final_layer_norm.", False),
    ("text_projection", "text_projection.weight", True),
    ("transformer.resblocks.", "text_model.encoder.layers.", False),
    ("logit_scale", "logit_scale", False),
]
BLOCK_TO_HF = {"ln_1.": "layer_norm1.", "ln_2.": "layer_norm2.", "mlp.c_fc.": "mlp.fc1.", "mlp.c_proj.": "mlp.fc2."}
BLOCK_TO_HF["attn.out_proj."] = "self_attn.out_proj."


def open_clip_to_hf(state):
    """An open_clip CLIP state dict -> transformers CLIPModel's, tensor by tensor. Every key is consumed: an unknown
    one raises ValueError (the causal attn_mask buffer, which HF builds itself, and a DDP "module." prefix apart). The
    packed attention input projection attn.in_proj_{weight,bias} (3 width, ...) is split into q, k, v in that order."""
    out = {}

    def unknown(key):
        return ValueError(f"open_clip key {key!r} has no CLIPModel counterpart: not an open_clip CLIP checkpoint?")

    for key, value in state.items():
        key = key.removeprefix("module.")
        if key == "attn_mask":
            continue
        prefix, name, transpose = next((row for row in OPEN_CLIP_TO_HF if key.startswith(row[0])), (None,) * 3)
        if prefix is None:
            raise unknown(key)
        rest = key[len(prefix) :]
        if not name.endswith(".layers."):
            out[name + rest] = value.t().contiguous() if transpose else value
            continue
        layer, _, inner = rest.partition(".")  # "3", "attn.in_proj_weight"
        if inner.startswith("attn.in_proj_"):
            for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                out[f"{name}{layer}.self_attn.{part}_proj.{inner.removeprefix('attn.in_proj_')}"] = chunk.contiguous()
            continue
        block = next((p for p in BLOCK_TO_HF if inner.startswith(p)), None)
        if block is None:
            raise unknown(key)
        out[f"{name}{layer}.{BLOCK_TO_HF[block]}{inner[len(block) :]}"] = value
    return out


@functools.lru_cache(maxsize=None)
def load_hpsv2(checkpoint, config, device, dtype, local_files_only):
    """HPSv2's CLIPModel (eval, frozen, on device in dtype) and tokenizer, cached per process: `config`'s architecture
    (a transformers CLIP folder or hub id; only its config and tokenizer are read) with the weights of `checkpoint`
    (HPS_v2.1_compressed.pt: {"state_dict": open_clip's}) converted by open_clip_to_hf, loaded strictly."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    with torch.device("meta"):
        model = CLIPModel(CLIPConfig.from_pretrained(config, local_files_only=local_files_only))
    missing, unexpected = model.load_state_dict(
        open_clip_to_hf(state.get("state_dict", state)), strict=False, assign=True
    )
    missing = [k for k in missing if not k.endswith("position_ids")]  # buffers HF fills itself
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint} does not fit {config}'s CLIP: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, buffer in model.named_buffers():  # position_ids: 0 .. n-1, left on meta by the meta-device build
        if buffer.is_meta:
            module, _, attr = name.rpartition(".")
            model.get_submodule(module).register_buffer(attr, torch.arange(buffer.shape[-1])[None], persistent=False)
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(config, local_files_only=local_files_only)


def hpsv2_pixels(images, size):
    """HPSv2's preprocessing as DiffusionNFT writes it (hpsv2_scorer.py, image_transform_tensor): the image as floats in
    [0, 1], resized so that its longer side is `size` (bicubic, antialiased: torchvision's resize of a tensor), padded
    with zeros to size x size (centred), normalised by OpenAI CLIP's mean and std. (N, 3, size, size) float32."""
    import torch
    import torch.nn.functional as F

    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    out = []
    for im in images:
        x = torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
        h, w = x.shape[-2:]
        scale = size / max(h, w)
        if scale != 1.0:
            nh, nw = round(h * scale), round(w * scale)
            x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
            x = F.pad(
                x, ((size - nw) // 2, size - nw - (size - nw) // 2, (size - nh) // 2, size - nh - (size - nh) // 2)
            )
        out.append((x[0] - mean) / std)
    return torch.stack(out)


def hpsv2_reward(opts):
    """HPSv2.1 as DiffusionNFT scores it (hpsv2_scorer.py): R = cos(e_img, e_txt) of the fine-tuned ViT-H-14, no logit
    scale (~0.25-0.35 for SD3.5-M samples; |R| <= 1), images through `hpsv2_pixels`, prompts through the CLIP
    tokenizer (77 tokens). Weights: --hpsv2-checkpoint (HPS_v2.1_compressed.pt, xswu/HPSv2 on the hub)."""
    path = _opt(opts, "hpsv2_checkpoint")
    if path is None or not os.path.isfile(path):
        raise ValueError(f"hpsv2 needs its weights file, got {path!r}: {HPSV2_FIX}")
    dtype = str(_opt(opts, "dtype")).removeprefix("torch.")
    device, offline = str(_opt(opts, "device")), bool(_opt(opts, "local_files_only"))
    model, tokenizer = load_hpsv2(str(path), _opt(opts, "hpsv2_config"), device, dtype, offline)

    def score(images, prompts):
        import torch

        param = next(model.parameters())
        size = model.config.vision_config.image_size
        with torch.no_grad():
            pix = hpsv2_pixels(images, size).to(param.device, param.dtype)
            img = _features(model.get_image_features(pixel_values=pix)).float()
            tok = tokenizer(list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt")
            txt = _features(model.get_text_features(**{k: v.to(param.device) for k, v in tok.items()})).float()
            img, txt = img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)
            return (img * txt).sum(-1).cpu().numpy()

    return lambda images, prompts: _batched(score, images, prompts)


HPSV2_FIX = (
    "pass --hpsv2-checkpoint PATH to HPS_v2.1_compressed.pt (hf download xswu/HPSv2 HPS_v2.1_compressed.pt "
    "--local-dir reward_ckpts)"
)


def ocr_target(prompt):
    """The text to render: what lies between the first two double quotes (FlowGRPO's
    prompt.split('"')[1]); None when the prompt quotes nothing."""
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def ocr_score(recognized, target):
    """FlowGRPO's OCR reward, spaces removed and lowercased on both sides:
    d = 0 if target is a substring of recognized, else min(Levenshtein(recognized, target), |target|);
    R = 1 - d / |target| in [0, 1]. NaN for an empty target."""
    from rapidfuzz.distance import Levenshtein

    rec, tgt = recognized.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not tgt:
        return float("nan")
    dist = 0 if tgt in rec else min(Levenshtein.distance(rec, tgt), len(tgt))
    return 1.0 - dist / len(tgt)


OCR_PACKAGE_MISSING = (
    "--rewards ocr needs the OCR engine, an optional extra: pip install -r configs/requirements-extras.txt "
    "(rapidocr-onnxruntime, which brings opencv and onnxruntime)"
)


@functools.lru_cache(maxsize=None)
def load_ocr():
    """RapidOCR with the PP-OCRv4 det/rec ONNX models bundled in rapidocr-onnxruntime (no download)."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        raise SystemExit(OCR_PACKAGE_MISSING) from None

    return RapidOCR()


def ocr_reward(opts):
    """OCR reward: all lines RapidOCR reads (confidence >= 0.5, like PaddleOCR's drop_score),
    concatenated in reading order, scored by ocr_score against ocr_target(prompt). NaN when the
    prompt quotes nothing, and when the engine fails on an image (DiffusionNFT scores those 0; a NaN
    is left out of the statistics and counted in reward_nonfinite/ocr, and the run goes on).
    Runs on CPU (onnxruntime), one image at a time, no angle classifier."""
    engine = load_ocr()

    def one(image, prompt):
        target = ocr_target(prompt)
        if target is None:
            return float("nan")
        try:
            lines, _ = engine(image.convert("RGB"), use_cls=False)  # a PIL image: RapidOCR makes it BGR
        except Exception:  # the engine's own failure on one image must not stop a training run
            return float("nan")
        return ocr_score("".join(text for _box, text, _conf in (lines or [])), target)

    return lambda images, prompts: _batched(lambda ims, ps: [one(i, p) for i, p in zip(ims, ps)], images, prompts)


@functools.lru_cache(maxsize=None)
def load_geneval_metadata(path):
    """prompt -> GenEval metadata dict, from a JSONL file of FlowGRPO's dataset/geneval format
    (one object per line: tag, include[, exclude], prompt)."""
    table = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                meta = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}, line {number}: not one JSON object ({err.msg}); two records fused by `cat` of a file "
                    "whose last line had no newline? Join JSONL files with `awk 1 a.jsonl b.jsonl > both.jsonl`"
                ) from None
            table[meta["prompt"]] = meta
    return table


def geneval_request(url, images, metadatas, only_strict=True, timeout=120.0, retries=3):
    """One POST of the reward-server GenEval protocol (yifan123/reward-server, app_geneval.py).
    Body: pickle of {"images": [JPEG bytes], "meta_datas": [dict], "only_strict": bool}.
    Reply: pickle of {"scores", "rewards", "strict_rewards": lists (N,), "group_rewards",
    "group_strict_rewards": {tag: list (N,)}}; HTTP 500 carries the server's traceback as text.
    Unpickling runs code the server sends: point this only at a server you trust."""
    jpegs = []
    for im in images:
        buf = io.BytesIO()
        im.convert("RGB").save(buf, format="JPEG")  # PIL's default quality 75, as FlowGRPO
        jpegs.append(buf.getvalue())
    body = pickle.dumps({"images": jpegs, "meta_datas": list(metadatas), "only_strict": only_strict})
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/octet-stream"})
    for attempt in range(retries):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return pickle.loads(reply.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"GenEval server {url} answered {e.code}:\n{e.read().decode(errors='replace')}") from e
        except urllib.error.URLError as e:
            if attempt == retries - 1:
                raise RuntimeError(
                    f"no GenEval server at {url} ({e.reason}); start one (yifan123/reward-server) or fix --geneval-url"
                ) from e
            time.sleep(2.0**attempt)


def geneval_reward(opts):
    """GenEval through a reward server. R = reply[geneval_key]; the default "scores" is FlowGRPO's
    training reward: the mean over the prompt's clauses of partial credit (count 1 - |n - n*| / n*,
    colour, position), in [0, 1]; "strict_rewards" is 0/1 all-clauses-correct. Batches of 64."""
    url, key, path = _opt(opts, "geneval_url"), _opt(opts, "geneval_key"), _opt(opts, "geneval_metadata")
    if key not in ("scores", "strict_rewards", "rewards"):
        raise ValueError(f"--geneval-key must be scores, strict_rewards or rewards, got {key!r}")
    if path is None:
        raise ValueError(
            "geneval needs each prompt's metadata: pass --geneval-metadata FILE.jsonl "
            "(FlowGRPO's dataset/geneval/train_metadata.jsonl format)"
        )
    table = load_geneval_metadata(str(path))

    def score(images, prompts):
        missing = [p for p in prompts if p not in table]
        if missing:
            raise ValueError(f"no GenEval metadata for prompt {missing[0]!r} in {path}")
        reply = geneval_request(url, images, [table[p] for p in prompts], only_strict=(key != "rewards"))
        return reply[key]

    return lambda images, prompts: _batched(score, images, prompts, batch=64)


GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")  # the server's


def geneval_judges(opts, prompts):
    """GenEval's accuracies as DiffusionNFT reports them (the benchmark's numbers, beside the training reward's partial
    credit), as held-out judges {name: (images, prompts) -> (N,)} for evaluate.py: geneval_accuracy (GenEval's own
    all-clauses check: the server's "rewards" with only_strict=False), geneval_strict_accuracy ("strict_rewards"), and
    for each tag of `prompts`' metadata geneval_<tag>_accuracy and geneval_<tag>_strict_accuracy ("group_rewards",
    "group_strict_rewards"), NaN on the images of other tags (the server's -10; DiffusionNFT's mean leaves them out
    too). Their means over the held-out images are DiffusionNFT's eval_reward_accuracy, _strict_accuracy and
    _<tag>_strict_accuracy. The names share one request per batch of 64 (the first name asked for a list of images
    makes it; the others read it)."""
    url, path = _opt(opts, "geneval_url"), _opt(opts, "geneval_metadata")
    table = load_geneval_metadata(str(path))
    last = {}

    def replies(images, prompts):
        if last.get("images") is not images:  # a new list of images (held while cached: its id is not reused)
            parts = [
                geneval_request(url, images[i : i + 64], [table[p] for p in prompts[i : i + 64]], only_strict=False)
                for i in range(0, len(images), 64)
            ]
            merged = {key: np.concatenate([r[key] for r in parts]) for key in ("rewards", "strict_rewards")}
            for group in ("group_rewards", "group_strict_rewards"):
                for tag in GENEVAL_TAGS:
                    values = np.concatenate([r[group].get(tag, [-10.0] * len(r["rewards"])) for r in parts])
                    merged[group, tag] = np.where(values == -10.0, np.nan, values)
            last.update(images=images, merged=merged)
        return last["merged"]

    def judge(*key):
        return lambda images, prompts: replies(images, prompts)[key[0] if len(key) == 1 else key]

    judges = {"geneval_accuracy": judge("rewards"), "geneval_strict_accuracy": judge("strict_rewards")}
    for tag in sorted({table[p]["tag"] for p in prompts if p in table} & set(GENEVAL_TAGS)):
        judges[f"geneval_{tag}_accuracy"] = judge("group_rewards", tag)
        judges[f"geneval_{tag}_strict_accuracy"] = judge("group_strict_rewards", tag)
    return judges


REWARD_MODELS = {
    "pickscore": pickscore_reward,
    "clipscore": clipscore_reward,
    "aesthetic": aesthetic_reward,
    "hpsv2": hpsv2_reward,
    "ocr": ocr_reward,
    "geneval": geneval_reward,
}


WEIGHTS = {  # reward -> the flags naming the weights it loads (a folder or a hub id), each with a file they must hold
    "pickscore": (("pickscore_model", "config.json"), ("pickscore_processor", "preprocessor_config.json")),
    "clipscore": (("clip_model", "config.json"),),
    "aesthetic": (("clip_model", "config.json"),),
    "hpsv2": (("hpsv2_config", "config.json"),),
}


def missing_inputs(names, opts):
    """What the reward models among `names` need and cannot find, checked before any model loads (each would
    otherwise fail after the pipeline has loaded, a hub download after five retries): their weights (a local
    folder, else the hub's local cache, else a hub that answers; HF_HUB_OFFLINE forbids the last), the aesthetic
    MLP file, the GenEval metadata file and server (a TCP connection to --geneval-url). One line per problem, naming
    the flag, the file or address and the fix; [] when everything is there. ocr needs its engine's package (its
    models come with it)."""
    problems = [_weights_problem(flag, _opt(opts, flag), file) for n in names for flag, file in WEIGHTS.get(n, ())]
    if "aesthetic" in names and not os.path.isfile(str(_opt(opts, "aesthetic_mlp"))):
        problems.append(
            f"--aesthetic-mlp {_opt(opts, 'aesthetic_mlp') or '(not given)'}: no such file; give the LAION MLP weights "
            "sac+logos+ava1-l14-linearMSE.pth (christophschuhmann/improved-aesthetic-predictor)"
        )
    if "hpsv2" in names and not os.path.isfile(str(_opt(opts, "hpsv2_checkpoint"))):
        problems.append(
            f"--hpsv2-checkpoint {_opt(opts, 'hpsv2_checkpoint') or '(not given)'}: no such file; {HPSV2_FIX}"
        )
    if "geneval" in names:
        path, url = _opt(opts, "geneval_metadata"), _opt(opts, "geneval_url")
        if not os.path.isfile(str(path)):
            problems.append(
                f"--geneval-metadata {path or '(not given)'}: no such file; give the prompts' GenEval metadata "
                "(FlowGRPO's dataset/geneval/train_metadata.jsonl format)"
            )
        problems.append(_server_problem(url))
    if "ocr" in names and importlib.util.find_spec("rapidocr_onnxruntime") is None:
        problems.append(OCR_PACKAGE_MISSING)
    return list(dict.fromkeys(p for p in problems if p))  # clipscore and aesthetic share --clip-model


def _weights_problem(flag, ref, filename):
    """None when `ref` (a folder or a hub id) can be loaded: a folder holding filename, or a hub id in the local
    cache or on a hub that answers now; else the problem and the fix."""
    option = f"--{flag.replace('_', '-')} {ref}"
    if os.path.isdir(ref):
        return None if os.path.isfile(os.path.join(ref, filename)) else f"{option}: no {filename} in that folder"
    if ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        return f"{option}: no such folder; give a transformers model folder or a hub id (owner/name)"
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(ref, filename), str):
        return None
    fix = f"download it where the hub is reachable (hf download {ref}) into {constants.HF_HUB_CACHE}, or give a folder"
    if constants.HF_HUB_OFFLINE:
        return f"{option}: not in the local hub cache and HF_HUB_OFFLINE is set; {fix}"
    try:
        model_info(ref, timeout=10)
    except RepositoryNotFoundError:
        return f"{option}: no such model on the hub (or gated: log in with hf auth login); fix the id"
    except Exception as err:  # no network: a connection error of the HTTP client
        return f"{option}: not in the local hub cache, and the hub cannot be reached ({type(err).__name__}); {fix}"
    return None


def _server_problem(url):
    """None when a TCP connection to the GenEval server at `url` opens within 5 s; else the problem and the fix."""
    import socket
    from urllib.parse import urlparse

    where = urlparse(url)
    fix = "start FlowGRPO's reward server (yifan123/reward-server) there, or fix --geneval-url"
    if where.scheme not in ("http", "https") or not where.hostname:
        return f"--geneval-url {url}: give an address such as http://127.0.0.1:18085"
    try:
        socket.create_connection((where.hostname, where.port or {"http": 80, "https": 443}[where.scheme]), 5).close()
    except OSError as err:
        return f"--geneval-url {url}: no server answers there ({err.strerror or type(err).__name__}); {fix}"
    return None


def build_rewards(names, opts, extra=None):
    """Reward callables in the order of names (a list or "a,b,c"). extra: {name: reward callable},
    e.g. the shapes world's REWARDS; its names shadow REWARD_MODELS. Raises ValueError on an
    unknown or repeated name, listing the known ones."""
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    extra = dict(extra or {})
    known = sorted(set(REWARD_MODELS) | set(extra))
    fix = f"fix the flag, e.g. --rewards {','.join(known[:3])}; known rewards: {', '.join(known)}"
    if not names or len(set(names)) != len(names):
        raise ValueError(f"rewards must be distinct and at least one, got {names}; {fix}")
    for name in names:
        if name not in extra and name not in REWARD_MODELS:
            raise ValueError(f"unknown reward {name!r}; {fix}")
    return [extra[n] if n in extra else REWARD_MODELS[n](opts) for n in names]
