"""Sampling completions with transformers `generate`, recording each token's logprob as it is drawn.

`generate` gets a fresh GenerationConfig (temperature 1, top_k 0, top_p 1: the model's own generation config,
which may carry a hidden top-k, is not used) and one logits processor, `SamplingDistribution.process`, which
the trainer replays. After sampling, the processed scores `generate` returned are checked against that
function applied to the raw logits: if anything else touched the distribution the stage fails instead of
training on a wrong ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from redteam_grpo.core.masks import split_generated
from redteam_grpo.core.policy import Policy

LOGPROB_CHECK_TOLERANCE = 1e-4


class SamplingError(RuntimeError):
    """Sampling did not draw from the distribution the trainer will replay."""


@dataclass(frozen=True)
class Completion:
    prompt_index: int  # index into the prompt list given to `sample_completions`
    sample_idx: int  # 0..G-1 within the prompt's group
    completion_ids: list[int]  # exactly as sampled, end-of-turn token included when there is one
    sample_logprobs: list[float]  # one per completion token, from the distribution it was drawn from
    finish_reason: str  # "stop" (end-of-turn token) or "length" (max_new_tokens reached)


class _DistributionProcessor(LogitsProcessor):
    def __init__(self, process):
        self.process = process

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.process(scores)


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
        mask[b, width - len(row) :] = 1
    return ids, mask


@torch.no_grad()
def sample_completions(
    policy: Policy,
    prompt_ids: Sequence[Sequence[int]],
    group_size: int,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
) -> list[Completion]:
    """G completions for every prompt; deterministic for a given seed and weights."""
    policy.require_eval_mode()
    jobs = [(p, g) for p in range(len(prompt_ids)) for g in range(group_size)]
    generation_config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=policy.end_of_turn_ids,
        pad_token_id=policy.pad_id,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    processors = LogitsProcessorList([_DistributionProcessor(policy.distribution.process)])
    completions: list[Completion] = []
    with torch.random.fork_rng(devices=[policy.device] if policy.device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            ids, mask = _left_pad([prompt_ids[p] for p, _ in chunk], policy.pad_id)
            out = policy.model.generate(
                input_ids=ids.to(policy.device),
                attention_mask=mask.to(policy.device),
                generation_config=generation_config,
                logits_processor=processors,
            )
            sequences = out.sequences.cpu()
            pieces, reasons = split_generated(sequences, ids.shape[1], policy.end_of_turn_ids)
            recorded_S_B = _recorded_logprobs(out.scores, sequences[:, ids.shape[1] :])
            replayed_S_B = _recorded_logprobs(
                tuple(policy.distribution.process(step) for step in out.logits), sequences[:, ids.shape[1] :]
            )
            for b, ((p, g), piece, reason) in enumerate(zip(chunk, pieces, reasons, strict=True)):
                recorded = recorded_S_B[: len(piece), b]
                if not torch.isfinite(recorded).all():
                    raise SamplingError(f"a sampled token has probability 0 under the recorded distribution: {piece}")
                drift = (recorded - replayed_S_B[: len(piece), b]).abs().max().item() if piece else 0.0
                if drift > LOGPROB_CHECK_TOLERANCE:
                    raise SamplingError(
                        f"generate changed the sampling distribution beyond temperature and token suppression "
                        f"(logprob drift {drift:.2e}); the trainer could not replay it. Check the model's "
                        "generation config and the sampling settings."
                    )
                completions.append(Completion(p, g, piece, recorded.tolist(), reason))
    return completions


def _recorded_logprobs(step_scores: tuple[torch.Tensor, ...], generated_B_S: torch.Tensor) -> torch.Tensor:
    """log_softmax of each step's scores at the token drawn at that step: [S, B]."""
    rows = []
    for s, scores_B_V in enumerate(step_scores):
        logprobs = torch.log_softmax(scores_B_V.float().cpu(), dim=-1)
        rows.append(logprobs.gather(-1, generated_B_S[:, s : s + 1]).squeeze(-1))
    return torch.stack(rows) if rows else torch.zeros((0, generated_B_S.shape[0]))
