"""A trained deep model for the tests of depth- and distribution-dependent rounding noise: the embedded policy's
recipe (its tokenizer, corpus, chat format and optimiser) at 8 decoder layers, pre-trained briefly, so its
distributions are peaked as a trained chat model's are and the depth term of the first-update bound is exercised.

Built on first use (under two minutes on one core: 109 s measured on an AMD EPYC beside another job) into the user
cache, under a file lock and an atomic rename, and reused; the folder's name carries `DEEP_VERSION`, to change with
the recipe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import torch
from filelock import FileLock

from redteam_grpo.embedded.recipes import DEFAULT_RECIPE

DEEP_VERSION = "v1"
LAYERS = 8
# The embedded policy's recipe (its corpus, batch, marker share) with its own seed and 240 steps at 3e-3 (the embedded
# model: 200 at 6e-3); its mean entropy at temperature 1 is about 1.3 nats per token (tests print it).
RECIPE = dataclasses.replace(DEFAULT_RECIPE, seed=77, policy_steps=240, policy_lr=3e-3)


def cache_root() -> Path:
    return Path(os.environ.get("REDTEAM_GRPO_CACHE", Path.home() / ".cache" / "redteam-grpo")) / "test-models"


def trained_deep_policy() -> Path:
    """The folder of the trained deep policy (tokenizer included), built once per machine."""
    folder = cache_root() / f"tiny-qwen3-deep{LAYERS}-{DEEP_VERSION}"
    if (folder / "build.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / "build.json").exists():
            return folder
        staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        try:
            facts = _build(staging)
            (staging / "build.json").write_text(json.dumps(facts, indent=2))
            staging.rename(folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _build(out_dir: Path) -> dict:
    import transformers
    from transformers import AutoTokenizer

    from redteam_grpo.embedded import EMBEDDED_POLICY, resolve_model_path
    from redteam_grpo.embedded.policy import pretrain_policy
    from redteam_grpo.embedded.training import isolated_build

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(EMBEDDED_POLICY))

    def deep_config(**settings):  # the embedded build's config at LAYERS decoder layers
        return qwen3_config(**{**settings, "num_hidden_layers": LAYERS})

    # The embedded build's sources are pinned by the digest its shipped weights record (embedded/shipped.py), so the
    # depth is set from here, on the config class pretrain_policy imports, rather than by a parameter of its own.
    qwen3_config = transformers.Qwen3Config
    with isolated_build(), mock.patch.object(transformers, "Qwen3Config", deep_config):
        torch.manual_seed(RECIPE.seed)
        model = pretrain_policy(tokenizer, RECIPE, random.Random(RECIPE.seed))
        assert model.config.num_hidden_layers == LAYERS
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    return {"recipe": asdict(RECIPE), "layers": LAYERS, "seconds": round(time.perf_counter() - started, 1)}
