"""One GRPO policy update on a sampled batch, and the diagnostics that show it is sound.

The forward runs on exactly the ids the sampler produced (prompt ids as fed to `generate`, completion ids as
drawn), through the same sampling distribution, so the first update's importance ratio is 1; it is checked
every step and a step whose ratio is off is refused (the trainer would be optimising a different
distribution than the one sampled from).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from redteam_grpo.core.config import TrainingConfig
from redteam_grpo.core.logprobs import entropy, pad_ragged, token_logprobs
from redteam_grpo.core.loss import clipped_importance_sampling_loss, importance_sampling_loss, token_weights
from redteam_grpo.core.policy import Policy, completion_logits


class RatioCheckError(RuntimeError):
    """The first update's importance ratio is not 1: sampler and trainer disagree on the distribution."""


@dataclass(frozen=True)
class TrainBatch:
    prompt_ids: Sequence[Sequence[int]]
    completion_ids: Sequence[Sequence[int]]
    sample_logprobs: Sequence[Sequence[float]]
    advantages: Sequence[float]
    group_ids: Sequence[str] = ()  # the prompt id of each row

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if not (len(self.completion_ids) == len(self.sample_logprobs) == len(self.advantages) == n):
            raise ValueError("prompt_ids, completion_ids, sample_logprobs and advantages differ in length")
        for i, (ids, lps) in enumerate(zip(self.completion_ids, self.sample_logprobs, strict=True)):
            if len(ids) != len(lps):
                raise ValueError(f"row {i}: {len(ids)} completion tokens but {len(lps)} sampling logprobs")


def make_optimizer(policy: Policy, cfg: TrainingConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        policy.trainable_parameters(),
        lr=cfg.learning_rate,
        betas=cfg.adam_betas,
        weight_decay=cfg.weight_decay,
    )


def policy_gradient_step(
    policy: Policy, optimizer: torch.optim.Optimizer, batch: TrainBatch, cfg: TrainingConfig
) -> dict[str, float]:
    """`cfg.updates_per_batch` optimizer steps on the batch; returns the diagnostics of the first and last."""
    keep = [i for i, ids in enumerate(batch.completion_ids) if len(ids) > 0]
    n_tokens = sum(len(batch.completion_ids[i]) for i in keep)
    metrics: dict[str, float] = {}
    params = policy.trainable_parameters()
    for update in range(cfg.updates_per_batch):
        optimizer.zero_grad(set_to_none=True)
        ratios, entropies, clip_tokens, loss_total = [], [], 0.0, 0.0
        for start in range(0, len(keep), cfg.micro_batch_size):
            rows = keep[start : start + cfg.micro_batch_size]
            logits_B_C_V, ids_B_C, mask_B_C = completion_logits(
                policy, [batch.prompt_ids[i] for i in rows], [batch.completion_ids[i] for i in rows]
            )
            logprobs_B_C_V = policy.distribution.logprobs(logits_B_C_V)
            logprobs_B_C = token_logprobs(logprobs_B_C_V, ids_B_C)
            sample_B_C = pad_ragged([batch.sample_logprobs[i] for i in rows], ids_B_C.shape[1]).to(policy.device)
            advantages_B = torch.tensor([batch.advantages[i] for i in rows], dtype=torch.float32, device=policy.device)
            weights_B_C = token_weights(mask_B_C, cfg.loss_normalization, n_tokens, len(keep))
            if cfg.clip_epsilon is None:
                loss, stats = importance_sampling_loss(logprobs_B_C, sample_B_C, advantages_B, weights_B_C, mask_B_C)
            else:
                loss, stats = clipped_importance_sampling_loss(
                    logprobs_B_C, sample_B_C, advantages_B, weights_B_C, mask_B_C, cfg.clip_epsilon
                )
            loss.backward()
            loss_total += float(loss.detach())
            clip_tokens += float(stats.clip_fraction) * int(stats.n_tokens)
            ratios.append(torch.exp(logprobs_B_C - sample_B_C).detach()[mask_B_C].cpu())
            if update == 0:
                entropies.append(entropy(logprobs_B_C_V.detach())[mask_B_C].cpu())
        max_norm = cfg.grad_clip if cfg.grad_clip is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        ratio = torch.cat(ratios) if ratios else torch.ones(1)
        step_metrics = {
            "loss": loss_total,
            # KL(sampler || trainer) by the k3 estimator on the ratio (Schulman 2020; CleanRL's approx_kl):
            # exactly what must be 0 on the first update after sampling.
            "approx_kl": float((ratio - 1 - ratio.log()).mean()),
            "ratio_mean": float(ratio.mean()),
            "ratio_std": float(ratio.std(unbiased=False)),
            "ratio_max": float(ratio.max()),
            "clip_fraction": clip_tokens / max(n_tokens, 1),
            "grad_norm": grad_norm,
        }
        if update == 0:
            deviation = float((ratio - 1).abs().mean())
            if deviation > cfg.ratio_tolerance:
                raise RatioCheckError(
                    f"first-update importance ratio deviates from 1 by {deviation:.2e} on average "
                    f"(tolerance {cfg.ratio_tolerance}): the trainer does not see the distribution the tokens "
                    "were sampled from. The batch was not trained on."
                )
            metrics.update(step_metrics)
            metrics["first_ratio_abs_dev"] = deviation
            metrics["entropy"] = float(torch.cat(entropies).mean()) if entropies else 0.0
        else:
            metrics.update({f"last_{k}": v for k, v in step_metrics.items()})
        if not math.isfinite(grad_norm):
            raise RuntimeError(f"non-finite gradient norm ({grad_norm}) on update {update}: the step was not taken")
        optimizer.step()
    metrics["n_tokens"] = float(n_tokens)
    metrics["n_sequences"] = float(len(keep))
    metrics["sampler_kl"] = metrics.pop("approx_kl")
    metrics["n_dropped_groups"] = 0.0
    metrics["last_ratio_std"] = metrics.get("last_ratio_std", math.nan)
    return {k: v for k, v in metrics.items() if not k.startswith("last_") or k == "last_ratio_std"}
