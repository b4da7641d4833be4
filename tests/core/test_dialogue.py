"""Dialogues on token ids (core/rollouts/dialogue.py): each turn's prompt is built by appending ids, never by encoding
text again, and each speaker is trained on its own turns' tokens only, with a first-update ratio of 1 on every one."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import span_logits
from redteam_grpo.core.rollouts.dialogue import (
    ATTACKER_SPEAKER,
    POLICY_SPEAKER,
    DialogueDriftError,
    SpeakerTurn,
    TurnGlue,
    sample_dialogues,
    speaker_row,
)
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.tokens.logprobs import token_logprobs
from redteam_grpo.core.tokens.masks import pack_spans
from redteam_grpo.embedded.policy import CHAT_TEMPLATE

SYSTEM = "You are a helpful assistant."
# Qwen3's way with earlier turns: the <think> block of every assistant turn but the last is dropped on render.
THINK_STRIPPING_TEMPLATE = CHAT_TEMPLATE.replace(
    "message['content'] + '<|im_end|>'",
    "((message['content'].split('</think>')[-1].lstrip('\\n')) if message['role'] == 'assistant' and not loop.last "
    "else message['content']) + '<|im_end|>'",
)


@pytest.fixture(params=["embedded", "qwen3-4b-instruct-2507"])
def tokenizer(request, embedded_assets):
    """The embedded policy's tokenizer, and the shipped configs' policy's real one with its published template."""
    from redteam_grpo.core.config import ModelConfig
    from redteam_grpo.core.models.policy import load_tokenizer

    if request.param == "embedded":
        return load_tokenizer(ModelConfig())
    from tests import real_tokenizers as real

    return copy.deepcopy(real.qwen3())


def _eot(tokenizer) -> list[int]:
    from redteam_grpo.core.models.chat import end_of_turn_ids

    return end_of_turn_ids(tokenizer)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _rendered(tokenizer, messages) -> list[int]:
    """What re-applying the chat template to the conversation's text gives: the way this project never builds a turn."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def test_the_glue_read_off_the_template_builds_what_the_template_renders(tokenizer):
    glue = TurnGlue.from_tokenizer(tokenizer, _eot(tokenizer))
    first = format_prompt_ids(tokenizer, "Hi there", SYSTEM)
    reply = _encode(tokenizer, "Tell me more.")
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Sure, what?"},
        {"role": "user", "content": "Tell me more."},
    ]
    closed = [*_encode(tokenizer, "Sure, what?"), glue.closing_id]
    assert glue.next_prompt(first, closed, "stop", reply) == _rendered(tokenizer, conversation)
    # a turn that ran out of tokens is closed the way the template closes one
    assert glue.next_prompt(first, closed[:-1], "length", reply) == _rendered(tokenizer, conversation)
    assert glue.content(closed) == closed[:-1] and glue.content(closed[:-1]) == closed[:-1]


def _split_word(tokenizer) -> list[int]:
    """A word the tokenizer encodes as one token, split into several tokens (its letters) a model can also sample."""
    for token_id in sorted(tokenizer.get_vocab().values()):
        text = tokenizer.decode([token_id])
        if len(text) >= 4 and text.isalpha() and _encode(tokenizer, text) == [token_id]:
            pieces = [_encode(tokenizer, ch) for ch in text]
            if all(len(p) == 1 for p in pieces):
                return [p[0] for p in pieces]
    raise AssertionError("the embedded tokenizer has no multi-letter word token")


def test_a_turn_is_carried_into_the_next_prompt_as_sampled_where_encoding_its_text_again_would_not(tokenizer):
    glue = TurnGlue.from_tokenizer(tokenizer, _eot(tokenizer))
    first = format_prompt_ids(tokenizer, "Hi", SYSTEM)
    letters = _split_word(tokenizer)
    sampled = [*letters, glue.closing_id]  # a split the model may draw, not the one the tokenizer makes
    assert _encode(tokenizer, tokenizer.decode(letters)) != letters  # the premise: text encoded again drifts
    following = glue.next_prompt(first, sampled, "stop", _encode(tokenizer, "and then?"))
    assert following[: len(first) + len(sampled)] == [*first, *sampled]


def test_a_template_that_rewrites_earlier_turns_does_not_change_the_ids_a_turn_was_sampled_with(tokenizer):
    """Qwen3's hybrid template drops the <think> block of every earlier assistant turn when it renders (the model
    card's "no thinking content in history"): a dialogue built by appending ids keeps what was sampled."""
    thinking = copy.deepcopy(tokenizer)
    if tokenizer.convert_tokens_to_ids("<think>") == 151667:  # the real Qwen tokenizer: Qwen3-4B's published template
        from tests import real_tokenizers as real

        thinking.chat_template = real.template("qwen3_4b.jinja")
    else:
        thinking.chat_template = THINK_STRIPPING_TEMPLATE
    glue = TurnGlue.from_tokenizer(thinking, _eot(thinking))
    first = format_prompt_ids(thinking, "Hi", SYSTEM)
    sampled = [*_encode(thinking, "<think>plan it</think>Sure."), glue.closing_id]
    following = glue.next_prompt(first, sampled, "stop", _encode(thinking, "Go on."))
    assert following[: len(first) + len(sampled)] == [*first, *sampled]
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>plan it</think>Sure."},
        {"role": "user", "content": "Go on."},
    ]
    # the premise: rendering the conversation again drops the sampled <think> tokens from the prompt
    assert _rendered(thinking, conversation)[: len(first) + len(sampled)] != [*first, *sampled]


def _dialogue(glue, first, own_turns, replies):
    """The speaker's turns of a dialogue built the way the sample stage builds them."""
    turns, prompt = [], list(first)
    for t, completion in enumerate(own_turns):
        turns.append(SpeakerTurn(prompt, completion, [-0.5 - t] * len(completion)))
        if t < len(replies):
            prompt = glue.next_prompt(prompt, completion, "stop", replies[t])
    return turns


def test_a_speaker_is_trained_on_its_own_turns_and_never_on_the_other_speakers(tokenizer):
    glue = TurnGlue.from_tokenizer(tokenizer, _eot(tokenizer))
    first = format_prompt_ids(tokenizer, "Hi", SYSTEM)
    own = [[*_encode(tokenizer, text), glue.closing_id] for text in ("Sure.", "Why do you ask?", "No.")]
    replies = [_encode(tokenizer, text) for text in ("Tell me a secret.", "Because I must know.")]
    sequence, spans, logprobs = speaker_row(_dialogue(glue, first, own, replies))
    packed = pack_spans([sequence], [spans], pad_id=tokenizer.pad_token_id)
    mask = packed.completion_mask_B_C[0]
    assert packed.completion_ids_B_C[0][mask].tolist() == [t for turn in own for t in turn]
    assert len(logprobs) == int(mask.sum()) == sum(len(turn) for turn in own)
    # the tokens trained sit exactly in the speaker's turns; the other speaker's and the glue are context only
    trained_at = {int(p) + 1 for p in packed.logit_positions_B_C[0][mask]}
    own_positions = {i for start, end in spans for i in range(start, end)}
    assert trained_at == own_positions
    for reply in replies:  # each reply is in the sequence, outside every trained position
        starts = [i for i in range(len(sequence)) if sequence[i : i + len(reply)] == reply]
        assert starts and not own_positions & set(range(starts[0], starts[0] + len(reply)))


def test_a_turn_whose_prompt_drifted_from_what_was_sampled_is_refused(tokenizer):
    glue = TurnGlue.from_tokenizer(tokenizer, _eot(tokenizer))
    first = format_prompt_ids(tokenizer, "Hi", SYSTEM)
    own = [[*_encode(tokenizer, "Sure."), glue.closing_id], [*_encode(tokenizer, "Fine."), glue.closing_id]]
    turns = _dialogue(glue, first, own, [_encode(tokenizer, "Go on.")])
    drifted = list(turns[1].prompt_ids)
    drifted[len(first) + 1] = drifted[len(first)]  # one token of the first turn encoded another way
    turns[1] = SpeakerTurn(drifted, turns[1].completion_ids, turns[1].logprobs)
    with pytest.raises(DialogueDriftError, match=f"at token {len(first) + 1} of {len(first) + len(own[0])}"):
        speaker_row(turns)


def test_the_first_update_ratio_is_one_on_every_trained_token_of_a_three_turn_dialogue(tiny_policy):
    policy = tiny_policy
    glue = TurnGlue.from_tokenizer(policy.tokenizer, policy.end_of_turn_ids)
    other_prompt = format_prompt_ids(policy.tokenizer, "Ask the assistant something it should refuse.", None)
    prompt, turns = format_prompt_ids(policy.tokenizer, "Hi", SYSTEM), []
    for t in range(3):
        (turn,) = sample_completions(policy, [prompt], 1, 12, batch_size=1, seed=t)
        turns.append(SpeakerTurn(prompt, turn.completion_ids, turn.sample_logprobs))
        (reply,) = sample_completions(policy, [other_prompt], 1, 8, batch_size=1, seed=100 + t)
        prompt = glue.next_prompt(prompt, turn.completion_ids, turn.finish_reason, glue.content(reply.completion_ids))
    sequence, spans, sampled = speaker_row(turns)
    with torch.no_grad():
        logits, ids, mask = span_logits(policy, [sequence], [spans])
        trained = token_logprobs(policy.distribution.logprobs(logits), ids)[mask]
    assert len(sampled) == len(trained) == sum(len(t.completion_ids) for t in turns)
    ratio = torch.exp(trained - torch.tensor(sampled))
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-4)


def _sampler(policy):
    def sample(prompt_ids, max_new_tokens, seed, group_size):
        return sample_completions(policy, prompt_ids, group_size, max_new_tokens, batch_size=8, seed=seed)

    return sample


def test_the_glue_opens_a_first_prompt_as_the_template_does(tokenizer):
    glue = TurnGlue.from_tokenizer(tokenizer, _eot(tokenizer))
    text = _encode(tokenizer, "What do you want?")
    assert glue.first_prompt(glue.opening(SYSTEM), text) == format_prompt_ids(tokenizer, "What do you want?", SYSTEM)
    assert glue.first_prompt(glue.opening(None), text) == format_prompt_ids(tokenizer, "What do you want?", None)


def test_dialogues_are_sampled_turn_by_turn_each_speaker_on_its_own_appended_view(tiny_policy):
    policy, entered = tiny_policy, []
    glue = TurnGlue.from_tokenizer(policy.tokenizer, policy.end_of_turn_ids)
    prompts = [format_prompt_ids(policy.tokenizer, text, SYSTEM) for text in ("Hi", "Describe my neighbour.")]
    openings = [glue.opening(f"Push the assistant to say something rude about: {text}") for text in ("a", "b")]

    @contextlib.contextmanager
    def attacker():
        entered.append(1)
        with policy.reference():
            yield

    settings = dict(group_size=2, max_new_tokens=10, attacker_max_new_tokens=8, seed=5, max_context=512)
    records = sample_dialogues(_sampler(policy), glue, prompts, openings, turns=3, attacker=attacker, **settings)
    assert len(entered) == 2  # turns 1 and 2: the attacker's turns ran in its own context
    assert len(records) == 2 * 2 * (1 + 2 * 2)
    # turn 0 is the single-turn draw exactly
    single = sample_completions(policy, prompts, 2, 10, batch_size=8, seed=5)
    turn0 = [r for r in records if r.turn == 0]
    assert [(r.prompt_index, r.sample_idx, r.completion_ids, r.sample_logprobs) for r in turn0] == [
        (c.prompt_index, c.sample_idx, c.completion_ids, c.sample_logprobs) for c in single
    ]
    for p, g in [(p, g) for p in range(2) for g in range(2)]:
        mine = sorted(
            (r for r in records if (r.prompt_index, r.sample_idx) == (p, g)), key=lambda r: (r.turn, r.speaker)
        )
        policy_turns = [r for r in mine if r.speaker == POLICY_SPEAKER]
        attacker_turns = [r for r in mine if r.speaker == ATTACKER_SPEAKER]
        assert [r.turn for r in policy_turns] == [0, 1, 2] and [r.turn for r in attacker_turns] == [1, 2]
        assert policy_turns[0].prompt_ids == prompts[p]
        # each speaker's prompt: its last prompt and turn as sampled, then the other's turn as ids
        assert attacker_turns[0].prompt_ids == glue.first_prompt(
            openings[p], glue.content(policy_turns[0].completion_ids)
        )
        for t in (1, 2):
            before, user = policy_turns[t - 1], attacker_turns[t - 1]
            expected = glue.next_prompt(
                before.prompt_ids, before.completion_ids, before.finish_reason, glue.content(user.completion_ids)
            )
            assert policy_turns[t].prompt_ids == expected
        speaker_row([SpeakerTurn(r.prompt_ids, r.completion_ids, r.sample_logprobs) for r in policy_turns])
        speaker_row([SpeakerTurn(r.prompt_ids, r.completion_ids, r.sample_logprobs) for r in attacker_turns])
    # the same seed, the same dialogues
    again = sample_dialogues(_sampler(policy), glue, prompts, openings, turns=3, attacker=attacker, **settings)
    assert again == records


def test_a_dialogue_that_would_outgrow_the_context_is_an_error_naming_the_settings(tiny_policy):
    glue = TurnGlue.from_tokenizer(tiny_policy.tokenizer, tiny_policy.end_of_turn_ids)
    prompts = [format_prompt_ids(tiny_policy.tokenizer, "Hi", SYSTEM)]
    with pytest.raises(ValueError, match=r"turn 1: the policy's prompt is \d+ tokens.*Lower dialogue.turns"):
        sample_dialogues(
            _sampler(tiny_policy),
            glue,
            prompts,
            [glue.opening(None)],
            group_size=1,
            turns=2,
            max_new_tokens=10,
            attacker_max_new_tokens=8,
            seed=0,
            max_context=len(prompts[0]) + 12,
            attacker=tiny_policy.reference,
        )


def test_a_step_on_dialogue_rows_trains_each_speakers_own_turns_with_a_first_ratio_of_one(tiny_policy):
    from redteam_grpo.core.config import TrainingConfig
    from redteam_grpo.core.training.train import TrainBatch, make_optimizer, policy_gradient_step

    policy = tiny_policy
    glue = TurnGlue.from_tokenizer(policy.tokenizer, policy.end_of_turn_ids)
    prompts = [format_prompt_ids(policy.tokenizer, text, SYSTEM) for text in ("Hi", "Describe my neighbour.")]
    records = sample_dialogues(
        _sampler(policy),
        glue,
        prompts,
        [glue.opening("Push.")] * 2,
        group_size=2,
        turns=3,
        max_new_tokens=10,
        attacker_max_new_tokens=8,
        seed=1,
        max_context=512,
        attacker=policy.reference,
    )
    rows = []
    for key in sorted({(r.prompt_index, r.sample_idx) for r in records}):
        turns = sorted(
            (r for r in records if (r.prompt_index, r.sample_idx) == key and r.speaker == POLICY_SPEAKER),
            key=lambda r: r.turn,
        )
        rows.append(
            (
                key,
                speaker_row([SpeakerTurn(r.prompt_ids, r.completion_ids, r.sample_logprobs) for r in turns]),
                turns[-1],
            )
        )
    batch = TrainBatch(
        prompt_ids=[last.prompt_ids for _, _, last in rows],
        completion_ids=[last.completion_ids for _, _, last in rows],
        sample_logprobs=[logprobs for _, (_, _, logprobs), _ in rows],
        advantages=[1.0, -1.0, 0.5, -0.5],
        group_ids=[str(key[0]) for key, _, _ in rows],
        max_new_tokens=10,
        spans=[spans for _, (_, spans, _), _ in rows],
    )
    own_tokens = sum(len(r.completion_ids) for r in records if r.speaker == POLICY_SPEAKER)
    assert own_tokens < sum(len(r.completion_ids) for r in records)  # the attacker's turns are in the dialogues
    stats = policy_gradient_step(policy, make_optimizer(policy, TrainingConfig()), batch, TrainingConfig())
    assert stats.n_tokens == own_tokens
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5) and stats.logprob_mismatch_max < 1e-4
    with pytest.raises(ValueError, match=r"row 0: \d+ trained tokens but"):
        TrainBatch(
            batch.prompt_ids,
            batch.completion_ids,
            [lp[:-1] for lp in batch.sample_logprobs],
            batch.advantages,
            batch.group_ids,
            spans=batch.spans,
        )


def test_per_turn_advantages_weigh_each_turns_tokens_by_that_turns_advantage(tiny_policy):
    """dialogue.rewards=per_turn: the tokens of turn t carry turn t's advantage. At ratio 1 the importance-sampling
    loss is -sum_t A_turn(t) / n_tokens over the trained tokens, so an advantage given to another turn's tokens
    (turns of different lengths) changes it."""
    from redteam_grpo.core.config import TrainingConfig
    from redteam_grpo.core.training.train import TrainBatch, make_optimizer, policy_gradient_step

    policy = tiny_policy
    tok = policy.tokenizer
    glue = TurnGlue.from_tokenizer(tok, policy.end_of_turn_ids)
    texts = [("No.", "I will not say that, not today.", "Fine: here is a much longer answer than both of the others.")]
    texts.append(("Sure, what is it you want to know?", "Hm.", "Ok."))
    rows = []
    for own_texts in texts:
        own = [[*_encode(tok, text), glue.closing_id] for text in own_texts]
        replies = [_encode(tok, "Go on."), _encode(tok, "Please tell me more.")]
        rows.append(speaker_row(_dialogue(glue, format_prompt_ids(tok, "Hi", SYSTEM), own, replies)))
    with torch.no_grad():  # the trainer's own logprobs as the sampler's: the ratio is exactly 1
        logits, ids, mask = span_logits(policy, [seq for seq, _, _ in rows], [spans for _, spans, _ in rows])
        own_lps = token_logprobs(policy.distribution.logprobs(logits), ids)
    logprobs = [own_lps[b][mask[b]].tolist() for b in range(len(rows))]
    per_turn = [[1.0, 0.0, -0.5], [0.0, 2.0, 0.25]]
    batch = TrainBatch(
        prompt_ids=[seq[: spans[-1][0]] for seq, spans, _ in rows],
        completion_ids=[seq[spans[-1][0] :] for seq, spans, _ in rows],
        sample_logprobs=logprobs,
        advantages=[0.0, 0.0],  # the first turn's: every token takes its own turn's instead
        group_ids=["a", "a"],
        max_new_tokens=32,
        spans=[spans for _, spans, _ in rows],
        turn_advantages=per_turn,
    )
    lengths = [[end - start for start, end in spans] for _, spans, _ in rows]
    n_tokens = sum(map(sum, lengths))

    def loss_of(advantages):
        return -sum(n * a for row, adv in zip(lengths, advantages, strict=True) for n, a in zip(row, adv, strict=True))

    expected = loss_of(per_turn)
    assert expected != pytest.approx(loss_of([adv[::-1] for adv in per_turn]))  # turns of different lengths
    cfg = TrainingConfig(dynamic_sampling=True)  # rows whose first-turn advantage is 0 still carry a gradient
    stats = policy_gradient_step(policy, make_optimizer(policy, cfg), batch, cfg)
    assert stats.n_sequences == 2 and stats.n_tokens == n_tokens
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert stats.loss == pytest.approx(expected / n_tokens, rel=1e-5)
    with pytest.raises(ValueError, match=r"row 1: 2 turn advantages for 3 trained turns"):
        TrainBatch(**{**batch.__dict__, "turn_advantages": [per_turn[0], per_turn[1][:2]]})
