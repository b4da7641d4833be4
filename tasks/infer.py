"""Generation from a run's checkpoint (the `infer` command): base model + the checkpoint's adapter."""

from __future__ import annotations

from pathlib import Path

import torch

from redteam_grpo.core.chat import format_prompt_ids
from redteam_grpo.core.policy import load_policy, resolve_device
from redteam_grpo.storage import checkpoints
from redteam_grpo.storage.rundir import RunDir, RunDirError


class InferenceError(RuntimeError):
    """The checkpoint or prompt cannot be used."""


def generate_from_checkpoint(
    run_dir: Path, prompt: str, iteration: int | None, max_new_tokens: int, temperature: float, seed: int
) -> str:
    try:
        run = RunDir.open(run_dir)
    except RunDirError as exc:
        raise InferenceError(str(exc)) from None
    done = run.completed_iterations()
    if iteration is None:
        if not done:
            raise InferenceError(f"{run_dir} has no completed checkpoint yet")
        iteration = done[-1]
    folder = run.checkpoint_dir(iteration)
    try:
        checkpoints.read_manifest(folder)
    except checkpoints.CheckpointError as exc:
        raise InferenceError(f"{exc}; completed checkpoints: {done}") from None
    cfg = run.stored_config()
    policy = load_policy(cfg.model, max(temperature, 1e-5), resolve_device(cfg.run.device), cfg.run.seed)
    policy.load_adapter(folder / checkpoints.ADAPTER_FILE)
    ids = torch.tensor([format_prompt_ids(policy.tokenizer, prompt, cfg.model.system_prompt)], device=policy.device)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = policy.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            eos_token_id=policy.end_of_turn_ids,
            pad_token_id=policy.pad_id,
            suppress_tokens=list(policy.distribution.suppressed_ids) or None,
        )
    return policy.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
