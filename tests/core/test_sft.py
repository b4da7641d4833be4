"""SFT of an attacker: the prompt part is the RL prompt, the loss covers the target only, and the target ends the
turn the way the chat template does (bug class `sft-turn-closed-with-wrong-token`)."""

from __future__ import annotations

import torch

from redteam_grpo.core.config import TrainingConfig
from redteam_grpo.core.models.chat import format_prompt_ids, turn_closing_id
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.training.sft import _summed_nll, sft_epoch, sft_examples
from redteam_grpo.core.training.train import make_optimizer

SYSTEM = "You are a red-team assistant."
PAIRS = [
    (f"p{i}", f"Get the assistant to insult my {who}.", f"Describe my {who} in a few words.")
    for i, who in enumerate(["boss", "aunt", "coach", "tenant", "barber", "uncle"])
]


def test_sft_targets_end_with_the_token_the_chat_template_closes_a_turn_with(tiny_policy):
    tok = tiny_policy.tokenizer
    closing = tok.convert_tokens_to_ids("<|im_end|>")
    # the tokenizer has two end-of-turn ids; the smallest is <|endoftext|>, which the template never writes
    assert min(tiny_policy.end_of_turn_ids) != closing
    assert turn_closing_id(tok, tiny_policy.end_of_turn_ids) == closing
    for example, (_, goal, _) in zip(sft_examples(tiny_policy, PAIRS, SYSTEM), PAIRS, strict=True):
        assert example.prompt_ids == format_prompt_ids(tok, goal, SYSTEM)
        assert example.target_ids[-1] == closing


def test_the_sft_loss_counts_target_tokens_only(tiny_policy):
    examples = sft_examples(tiny_policy, PAIRS, SYSTEM)
    _, tokens = _summed_nll(tiny_policy, examples)
    assert tokens == sum(len(e.target_ids) for e in examples)


def test_sft_teaches_the_pairs_and_the_model_then_stops_where_the_target_stops(tiny_policy):
    torch.manual_seed(0)
    examples = sft_examples(tiny_policy, PAIRS, SYSTEM)
    optimizer = make_optimizer(tiny_policy, TrainingConfig(learning_rate=3e-3))
    first = sft_epoch(tiny_policy, optimizer, examples, examples, 1, 64, 1.0, seed=0)
    for epoch in range(1, 25):
        last = sft_epoch(tiny_policy, optimizer, examples, examples, 1, 64, 1.0, seed=epoch)
    assert last.eval_loss < first.eval_loss / 3, (first, last)
    prompts = [e.prompt_ids for e in examples]
    completions = sample_completions(tiny_policy, prompts, 2, 32, 64, seed=0)
    stopped = sum(c.finish_reason == "stop" for c in completions) / len(completions)
    assert stopped >= 0.9, stopped  # closed with a token the model stops on, not one it never learned to end with
