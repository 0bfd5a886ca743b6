"""What the end-to-end tests of both scripts share (test_recast.py, test_run_kit.py): a tiny random SD3 pipeline built
from configs (diffusers' get_dummy_components pattern, nothing downloaded), two image rewards, the flags of a tiny
run, a finished run to copy, and readers of what a run writes. Under `pytest -n N` (pytest-xdist, the README's test
command) each worker and the scripts it starts use one thread: N workers share the cores."""

import contextlib
import http.server
import json
import os
import pickle
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import sd3
from kit import checkpoints

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the scripts a test starts
    torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "long: a test of minutes (an experiment's --quick on the embedded model, the notebook, the toy's checks)",
    )


def pytest_collection_modifyitems(items):
    """The long tests first, longest first (`long(seconds)`): under -n N the workers take the queue in turn (one test at
    a time, pytest_xdist_make_scheduler), so they share the long ones from the start instead of one worker ending
    alone with the last of them."""

    def seconds(item):
        mark = item.get_closest_marker("long")
        return mark.args[0] if mark else 0

    items.sort(key=seconds, reverse=True)  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it, never called
def pytest_xdist_make_scheduler(config, log):
    """Under -n N (xdist's --dist load), the workers are topped up one test at a time from one queue (as with
    --maxschedchunk 1). By default xdist hands each worker a block of consecutive tests up front, a quarter of its
    share: the first block held every long test, and its worker ran 555 s while the other ran out of work at 333 s."""
    if config.getvalue("dist") != "load":
        return None  # another --dist: xdist's own scheduler
    from xdist.scheduler import LoadScheduling

    scheduler = LoadScheduling(config, log)
    if scheduler.maxschedchunk is None:  # --maxschedchunk not given
        scheduler.maxschedchunk = 1
    return scheduler


TINY_WORDS = ["a", "red", "blue", "circle", "square", "two"]


def make_tiny_pipeline(path, seed=0):
    """A tiny random SD3 pipeline of the real diffusers classes (`sd3.pipeline_from_configs`), tokenizers built from a
    vocabulary: nothing is downloaded."""
    from transformers import CLIPTokenizer, T5Tokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1, "!": 2}
    merges = []
    for ch in sorted(set("".join(TINY_WORDS))):
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    for w in TINY_WORDS:  # merge from the word's end so that every word is a single token
        parts = list(w[:-1]) + [w[-1] + "</w>"]
        while len(parts) > 1:
            merges.append((parts[-2], parts[-1]))
            vocab.setdefault(parts[-2] + parts[-1], len(vocab))
            parts = parts[:-2] + [parts[-2] + parts[-1]]
    clip_tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=16)
    clip = dict(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        projection_dim=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    t5_tok = T5Tokenizer(
        vocab=[("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [("\u2581" + w, -1.0) for w in TINY_WORDS],
        model_max_length=16,
    )
    pipe = sd3.pipeline_from_configs(
        transformer=dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=32,
            out_channels=4,
            pos_embed_max_size=8,
        ),
        vae=dict(
            block_out_channels=(8, 16),
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            norm_num_groups=8,
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            mid_block_add_attention=False,
            shift_factor=0.0,
            scaling_factor=1.0,
        ),
        clips=(clip, clip),
        t5=dict(vocab_size=len(t5_tok), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
        tokenizers=(clip_tok, clip_tok, t5_tok),
        seed=seed,
    )
    pipe.save_pretrained(path)
    return path


def brightness(images, prompts):
    return np.array([np.asarray(im, dtype=np.float64).mean() / 255 for im in images])


def redness(images, prompts):
    return np.array(
        [
            (np.asarray(im, dtype=np.float64)[..., 0] - np.asarray(im, dtype=np.float64)[..., 2]).mean() / 255
            for im in images
        ]
    )


TINY_REWARDS = {"brightness": brightness, "redness": redness}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    make_tiny_pipeline(root / "pipe")
    (root / "prompts.txt").write_text("a red circle\ntwo blue square\na blue circle\ntwo red square\n")
    return root


def tiny_argv(tiny, out, *more):
    return [
        "--model",
        str(tiny / "pipe"),
        "--rewards",
        "brightness,redness",
        "--budgets",
        "0.6,0.4",
        "--resolution",
        "16",
        "--max-sequence-length",
        "8",
        "--train-prompts",
        str(tiny / "prompts.txt"),
        "--eval-prompts",
        str(tiny / "prompts.txt"),
        "--prompts-per-iter",
        "2",
        "--out",
        str(out),
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        *more,
    ]


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def snapshot(folder):
    """{relative path: bytes} of every file under a run folder (the lock file excluded)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module", params=["recast", "rvge"])
def finished_run(request, tiny, tmp_path_factory):
    """A finished 2-iteration run (checkpoints at both iterations) of each script; tests copy it."""
    script = __import__(request.param)
    out = tmp_path_factory.mktemp(request.param) / "run"
    script.train(
        script.parse_args(tiny_argv(tiny, out, "--iterations", "2", "--save-every", "1", "--eval-every", "0")),
        extra_rewards=TINY_REWARDS,
    )
    return SimpleNamespace(script=script, out=out)


def copy_of(run, tmp_path, name="run"):
    dst = tmp_path / name
    shutil.copytree(run.out, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def tiny_argv_for(run, out, *more):
    return json_args_to_argv(json.loads((run.out / "config.json").read_text())["args"], out, *more)


def json_args_to_argv(saved, out, *more):
    keep = [
        "model",
        "rewards",
        "budgets",
        "resolution",
        "max_sequence_length",
        "train_prompts",
        "eval_prompts",
        "prompts_per_iter",
        "lora_rank",
        "lora_alpha",
    ]
    return [x for k in keep for x in (f"--{k.replace('_', '-')}", str(saved[k]))] + ["--out", str(out), *more]


def assert_loads_as_trained(script, out, folder, adapter="default"):
    """diffusers' own loader on a checkpoint folder gives the model the run trained: the transformer's output with
    pipe.transformer.load_lora_adapter(folder, ...) equals the training model's (sd3.load_pipeline +
    load_checkpoint, the adapter active) to float tolerance, and the change from the base model is far above that
    tolerance (a LoRA loaded at the wrong scale, as with alpha != r and no alpha recorded, moves it by the wrong
    amount)."""
    from diffusers import StableDiffusion3Pipeline

    args = script.parse_args(["--resume", str(out)])
    assert args.lora_alpha != args.lora_rank, "the check needs alpha != r to see a wrong scale"
    trained = sd3.load_pipeline(args, "cpu", torch.float32).transformer
    checkpoints.load_checkpoint(Path(out), trained, torch.optim.AdamW(sd3.lora_params(trained, "default")), 1e-3, 0.0)
    trained.set_adapter(adapter)
    loaded = StableDiffusion3Pipeline.from_pretrained(args.model, local_files_only=True)
    base = loaded.transformer(**transformer_inputs(loaded.transformer)).sample
    loaded.transformer.load_lora_adapter(  # kit/README.md's instruction (and the closing summary's), as a user runs it
        folder, prefix="transformer", weight_name="pytorch_lora_weights.safetensors"
    )
    with torch.no_grad():
        y_loaded = loaded.transformer(**transformer_inputs(loaded.transformer)).sample
        y_trained = trained(**transformer_inputs(trained)).sample
    change = (y_trained - base).abs().max().item()
    assert change > 1e-5, "training did not move the model: the comparison would show nothing"
    assert (y_loaded - y_trained).abs().max().item() < 1e-3 * change
    assert loaded.transformer.peft_config["default_0"].lora_alpha == args.lora_alpha


def transformer_inputs(transformer, seed=0):
    """One fixed random input of an SD3 transformer (latents, a timestep, text states and pooled states)."""
    g, c = torch.Generator().manual_seed(seed), transformer.config
    side = c.sample_size
    return dict(
        hidden_states=torch.randn(2, c.in_channels, side, side, generator=g),
        timestep=torch.tensor([500.0, 700.0]),
        encoder_hidden_states=torch.randn(2, 5, c.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(2, c.pooled_projection_dim, generator=g),
        return_dict=True,
    )


class PickleReplyHandler(http.server.BaseHTTPRequestHandler):
    """A local stand-in for a reward server (FlowGRPO's GenEval server speaks pickles over HTTP POST): `reply` answers
    with a pickled object; requests are not logged."""

    def reply(self, obj):
        body = pickle.dumps(obj)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(handler, **attributes):
    """A ThreadingHTTPServer on a free local port with `handler`, its `attributes` set, for the with block."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in attributes.items():
        setattr(server, name, value)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
