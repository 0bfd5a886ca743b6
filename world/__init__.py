"""The shapes world: the embedded default model's world, its rewards and its held-out judges.

The training scripts must run on a laptop CPU with no downloads, so the repo ships its own tiny text-to-image model
built from the SAME diffusers classes as SD3.5-Medium (``StableDiffusion3Pipeline``: SD3 MMDiT transformer,
AutoencoderKL, two CLIP text encoders + one T5 encoder, FlowMatchEulerDiscreteScheduler with shift 3.0), pretrained
here on a procedural world whose rewards are real programs.

    import world
    pipe = world.load_pipeline()                    # world/assets/shapes-sd3, offline
    images = world.generate(pipe, prompts, seed=0)  # pipe(prompts, **world.GEN_KWARGS) with one seeded generator
    scores = world.REWARDS["geneval_strict"](images, prompts)  # (N,) float64

The world's interface, what the run machinery reads from a world module (a pipeline folder names its world in its
``world.json``, WORLD_FILE: {"module": "world"} for the shipped folder; a world variant names its experiment's
module, which offers the same names):

    REWARDS           name -> reward (images: list[PIL.Image], prompts: list[str]) -> np.ndarray (N,) float64
    DEFAULT_REWARDS   the defaults' reward names, in budget order (DEFAULT_BUDGETS: their budgets)
    JUDGES            name -> held-out per-image judge, same interface as REWARDS (the CNN judge)
    frechet_distance  (images, prompts=None, seed=0) -> float: Fréchet distance in the CNN judge's features
    judge_preference  (images, prompts) -> (N,) Bradley-Terry scores of the pairwise preference judge
    GEN_KWARGS        the pipeline-call arguments the model was trained for (32 px, 10 steps, no CFG, 10 tokens)
    RES               image side in pixels (32)
    parse_prompt      caption -> spec {"objects": [(colour, shape), ...], "side", ["texture"]}; ValueError outside
    sample_prompts    (n, split="train", seed=0) -> n captions of a split ("train" | "heldout")
    splits            () -> {"train": [...], "heldout": [...]}, the fixed caption split
    PROFILES_PATH     the pretrained model's level statistics (recast.py --gain-init world)
    world_id          (folder=PIPELINE_DIR) -> 12 hex digits naming a build (WORLD_FILE left out)
    WORLD_FILE        "world.json", the plugin contract's file name (write_world_file writes it)

and, for scripts: render / render_spec (ground truth), check / detect (the checker), load_pipeline, generate,
encode_prompts, vae_encode / vae_decode, PIPELINE_DIR, ASSETS. The modules, one concern each: grammar (captions,
prompts, rendering), checker, rewards, judges, pipeline (assets, id, sampling), metrics (eval, bench), build (the tiny
SD3, training, the CLI: ``python -m world.build build|eval|bench|pref-judge``).

Conventions: images are PIL RGB; every reward/judge resizes to 32x32 (box filter) first, so they also score 512 px
images. `import world` is cheap: numpy/scipy/PIL only; torch and diffusers are imported inside the functions that need
them, in every module of the package.
"""

from world.checker import check, detect, pooled_texture, texture_amplitude, texture_contrast
from world.grammar import (
    COLORS,
    RES,
    SHAPES,
    SPLITS,
    TEMPLATES,
    TEXTURE,
    TEXTURES,
    VARIANT_HOOKS,
    VariantHook,
    all_captions,
    parse_prompt,
    render,
    render_spec,
    sample_prompts,
    splits,
)
from world.judges import JUDGES, frechet_distance, judge_cnn, judge_features, judge_preference, preference_pairs
from world.pipeline import (
    ASSETS,
    GEN_KWARGS,
    PIPELINE_DIR,
    PROFILES_PATH,
    ROOT,
    TEXT_LEN,
    WORLD_FILE,
    encode_prompts,
    generate,
    load_pipeline,
    vae_decode,
    vae_encode,
    world_id,
    write_world_file,
)
from world.rewards import DEFAULT_BUDGETS, DEFAULT_REWARDS, REWARDS

__all__ = [
    "ASSETS",
    "COLORS",
    "DEFAULT_BUDGETS",
    "DEFAULT_REWARDS",
    "GEN_KWARGS",
    "JUDGES",
    "PIPELINE_DIR",
    "PROFILES_PATH",
    "RES",
    "REWARDS",
    "ROOT",
    "SHAPES",
    "SPLITS",
    "TEMPLATES",
    "TEXTURE",
    "TEXTURES",
    "TEXT_LEN",
    "VARIANT_HOOKS",
    "VariantHook",
    "WORLD_FILE",
    "all_captions",
    "check",
    "detect",
    "encode_prompts",
    "frechet_distance",
    "generate",
    "judge_cnn",
    "judge_features",
    "judge_preference",
    "load_pipeline",
    "parse_prompt",
    "pooled_texture",
    "preference_pairs",
    "render",
    "render_spec",
    "sample_prompts",
    "splits",
    "texture_amplitude",
    "texture_contrast",
    "vae_decode",
    "vae_encode",
    "world_id",
    "write_world_file",
]
