"""Sampling completions with transformers `generate`, drawing each token ourselves and recording its logprob as it is
drawn.

`generate` runs the model (KV cache, left padding, stopping); the token is drawn by one logits processor,
`_StepwiseDraw`, from `SamplingDistribution.process` (the function the trainer replays) applied to the model's own
logits of that step, read by a forward hook, not to the scores `generate` hands the processor: so no processor
`generate` adds before ours (a repetition penalty, a minimum length, suppressed tokens from a model's generation
config) can change the distribution. The processor hands `generate` scores that are 0 at the drawn token and -inf
everywhere else, and `generate` runs greedy (`do_sample=False`): it keeps the argmax, that token, and applies no
warper (top-k, top-p, min-p, temperature from a generation config) and no draw of its own. After each batch the tokens
`generate` kept are checked against the tokens drawn: a mismatch fails the stage instead of training on a wrong ratio.

The draw is by the inverse of the cumulative distribution (float64, one uniform per row), not `torch.multinomial`: on a
CPU, at Qwen3's 151,936 ids and 64 rows, multinomial took 298 ms a step and the cumulative sum 70 ms, and the second
draw `generate` made in sampling mode (its own softmax and multinomial over the one-hot) as much again.

Memory: the bookkeeping is one token id and one logprob per sequence and step, O(batch x steps); the only
vocabulary-wide tensors are the current step's ([batch, vocab], freed at the next step). `generate` is asked for
neither its per-step scores nor its logits, which for Qwen3-4B's 151,936-token vocabulary at batch 64 x 256
tokens would be 10 GB each.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from redteam_grpo.core.models.policy import Policy
from redteam_grpo.core.tokens.logprobs import SamplingDistribution
from redteam_grpo.core.tokens.masks import split_generated


class SamplingError(RuntimeError):
    """Sampling did not draw from the distribution the trainer will replay."""


@dataclass(frozen=True)
class Completion:
    prompt_index: int  # index into the prompt list given to `sample_completions`
    sample_idx: int  # 0..G-1 within the prompt's group
    completion_ids: list[int]  # exactly as sampled, end-of-turn token included when there is one
    sample_logprobs: list[float]  # one per completion token, from the distribution it was drawn from
    finish_reason: str  # "stop" (end-of-turn token) or "length" (max_new_tokens reached)


class _StepwiseDraw(LogitsProcessor):
    """Draws the next token of every row from `distribution` applied to the model's logits of the step and records
    its id and logprob; returns a one-hot distribution on it, so `generate` keeps exactly that token."""

    def __init__(self, distribution: SamplingDistribution, generator: torch.Generator):
        self.distribution = distribution
        self.generator = generator
        self.model_logits_B_V: torch.Tensor | None = None
        self.tokens: list[torch.Tensor] = []  # one [B] per step
        self.logprobs: list[torch.Tensor] = []  # one [B] per step

    def record_model_logits(self, module, args, output) -> None:
        """Forward hook on the causal LM: its logits at the last position, as `generate` reads them."""
        self.model_logits_B_V = output.logits[:, -1].float()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.model_logits_B_V is None or self.model_logits_B_V.shape != scores.shape:
            raise SamplingError("the sampler did not see the model's logits of this step; it cannot draw a token")
        logprobs_B_V = self.distribution.logprobs(self.model_logits_B_V)
        self.model_logits_B_V = None  # each step's logits are used once
        token_B_1 = draw_tokens(logprobs_B_V, self.generator)
        self.tokens.append(token_B_1[:, 0].cpu())
        self.logprobs.append(logprobs_B_V.gather(-1, token_B_1)[:, 0].cpu())
        return torch.full_like(scores, float("-inf")).scatter_(-1, token_B_1, 0.0)


def draw_tokens(logprobs_B_V: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row ([B, 1]) drawn from exp(logprobs_B_V) by the inverse of its cumulative distribution: the
    first id whose cumulative probability exceeds a uniform draw in [0, 1) times the row's total. An id of probability
    0 adds nothing to the sum, so no draw lands on it; and a float64 product of a uniform below 1 and the total stays
    below the total, so every draw lands on an id.

    >>> inf = float("inf")
    >>> draw_tokens(torch.tensor([[0.0, -inf], [-inf, 0.0]]), torch.Generator().manual_seed(0)).tolist()
    [[0], [1]]
    """
    cdf_B_V = logprobs_B_V.exp().double().cumsum(-1)
    uniform_B_1 = torch.rand((cdf_B_V.shape[0], 1), generator=generator, device=cdf_B_V.device, dtype=torch.float64)
    return torch.searchsorted(cdf_B_V, uniform_B_1 * cdf_B_V[:, -1:], right=True)


@contextlib.contextmanager
def _ignored_flags_unreported() -> Iterator[None]:
    """A greedy `generate` reports, at every call, each sampling setting a model's generation config holds (Qwen3's
    temperature, top-k, top-p) as a flag it ignores. Here it ignores them by design (the sampler has drawn the
    token), so that report is left out; nothing else of transformers' is."""
    logger = logging.getLogger("transformers.generation.configuration_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(list(row), dtype=torch.long)
        mask[b, width - len(row) :] = 1
    return ids, mask


def generation_config(policy: Policy, max_new_tokens: int) -> GenerationConfig:
    """Greedy, explicitly, so a model's own generation config cannot turn sampling (and its warpers) back on:
    `generate` keeps the argmax of the sampler's scores, the token it drew; whatever else that config sets acts on
    those scores, where it cannot change the token."""
    return GenerationConfig(
        do_sample=False,  # the argmax of the processor's scores: the token it drew, with no draw of generate's own
        max_new_tokens=max_new_tokens,
        eos_token_id=policy.end_of_turn_ids,
        pad_token_id=policy.pad_id,
        return_dict_in_generate=False,  # no per-step scores or logits kept: O(batch x steps x vocab)
    )


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
    config = generation_config(policy, max_new_tokens)
    generator = torch.Generator(policy.device).manual_seed(seed)
    model = policy.model
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # what `generate` runs
    completions: list[Completion] = []
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        ids, mask = _left_pad([prompt_ids[p] for p, _ in chunk], policy.pad_id)
        draw = _StepwiseDraw(policy.distribution, generator)
        hook = causal_lm.register_forward_hook(draw.record_model_logits)
        try:
            with _ignored_flags_unreported():
                sequences = policy.model.generate(
                    input_ids=ids.to(policy.device),
                    attention_mask=mask.to(policy.device),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([draw]),
                ).cpu()
        finally:
            hook.remove()
        pieces, reasons = split_generated(sequences, ids.shape[1], policy.end_of_turn_ids)
        drawn_S_B = torch.stack(draw.tokens) if draw.tokens else torch.zeros((0, len(chunk)), dtype=torch.long)
        logprobs_S_B = torch.stack(draw.logprobs) if draw.logprobs else torch.zeros((0, len(chunk)))
        for b, ((p, g), piece, reason) in enumerate(zip(chunk, pieces, reasons, strict=True)):
            if drawn_S_B[: len(piece), b].tolist() != piece:
                raise SamplingError(
                    "generate kept other tokens than the sampler drew (something after the sampler's logits processor "
                    "changed the distribution); the trainer could not replay them. Check the model's generation "
                    "config and the sampling settings."
                )
            recorded = logprobs_S_B[: len(piece), b]
            if not torch.isfinite(recorded).all():
                raise SamplingError(f"a sampled token has probability 0 under the recorded distribution: {piece}")
            completions.append(Completion(p, g, piece, recorded.tolist(), reason))
    return completions
