"""Generation from a run's checkpoint (the `infer` command): base model + the checkpoint's adapter.

Unlike an RL run, inference may change the distribution (nucleus, top-k, minimum length, repetition penalty):
nothing is trained on what it samples.
"""

from __future__ import annotations

from pathlib import Path

import torch

from redteam_grpo.core.config import InferenceConfig
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import load_policy, resolve_device
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.rundir import RunDir, RunDirError


class InferenceError(RuntimeError):
    """The checkpoint or prompt cannot be used."""


def generate_from_checkpoint(run_dir: Path, prompt: str, iteration: int | None, options: InferenceConfig) -> str:
    try:
        run = RunDir.open(run_dir)
        iteration = run.checkpoint_to_use(iteration)
    except RunDirError as exc:
        raise InferenceError(str(exc)) from None
    cfg = run.stored_config()
    policy = load_policy(cfg.model, max(options.temperature, 1e-5), resolve_device(cfg.run.device), cfg.run.seed)
    policy.load_adapter(run.checkpoint_dir(iteration) / checkpoints.ADAPTER_FILE)
    ids = torch.tensor([format_prompt_ids(policy.tokenizer, prompt, cfg.model.system_prompt)], device=policy.device)
    greedy = options.temperature == 0
    torch.manual_seed(options.seed)
    with torch.no_grad():
        out = policy.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=not greedy,
            temperature=None if greedy else options.temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            min_new_tokens=options.min_new_tokens,
            repetition_penalty=options.repetition_penalty,
            max_new_tokens=options.max_new_tokens,
            eos_token_id=policy.end_of_turn_ids,
            pad_token_id=policy.pad_id,
            suppress_tokens=list(policy.distribution.suppressed_ids) or None,
        )
    return policy.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
