"""The world a model folder names: the embedded model's rewards, judges, prompts and generation settings.

A world is a Python module that a pipeline folder names in its `world.json` ({"module": ...}); the shipped tiny model
names `world`, a variant built by an experiment names the experiment's module. The kit imports a world only through
`load_world`, so it knows none by name; a model folder without `world.json` (SD3.5-Medium) has no world: its rewards
are the real reward models, its prompts a file. What the kit reads from a world module: DEFAULT_REWARDS, REWARDS
({name: (images, prompts) -> (N,)}), JUDGES, frechet_distance, GEN_KWARGS, parse_prompt, sample_prompts,
PROFILES_PATH, world_id.
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path

EMBEDDED_MODEL = str(Path(__file__).resolve().parents[1] / "world" / "assets" / "shapes-sd3")  # runs from any folder
WORLD_FILE = "world.json"  # in a pipeline folder: {"module": the world's module}


@functools.cache
def world_of(path):
    """The world module a pipeline folder names (`WORLD_FILE`), or None."""
    marker = Path(path) / WORLD_FILE
    if not marker.is_file():
        return None
    return importlib.import_module(json.loads(marker.read_text())["module"])


def load_world(model):
    """The world of --model (a folder or a hub id), or None: the embedded model's, or a world variant's built from it,
    which runs the same way (its world's rewards, text length, size)."""
    return world_of(str(Path(model).resolve()))


def is_embedded(model):
    """Whether --model has a world (the embedded model or a variant of it)."""
    return load_world(model) is not None


def reward_extras(model, extra=None):
    """Rewards that are plain callables: the world's programs (for a model with a world; their names shadow the reward
    models', e.g. `geneval` is the shapes checker there) and `extra`."""
    world = load_world(model)
    return {**(world.REWARDS if world else {}), **(extra or {})}
