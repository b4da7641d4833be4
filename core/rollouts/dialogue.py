"""Dialogues on token ids: each turn's prompt is the speaker's previous prompt and turn exactly as sampled, then the
other speaker's turn wrapped in the chat template's glue, all appended as ids. No turn is decoded and encoded again.

Why ids: a chat template may render an earlier turn differently once the conversation goes on (Qwen3's drops the
`<think>` block of earlier assistant turns; others strip whitespace), and text encoded again need not give the ids
the sampler drew (a tokenizer splits text its own way, a model may sample another split). A trainer that re-applies
the template to a conversation's text then trains on tokens nobody sampled, against logprobs recorded for others
(bug class `dialogue-retokenised-between-turns`).

Each speaker has its own view of a dialogue: its own turns are the assistant's, the other speaker's are the user's.
A speaker's training row is its last prompt and turn (the whole dialogue as it saw it) with the spans of its own turns
(`speaker_row`): the loss covers those tokens only, never the other speaker's (bug class
`dialogue-loss-on-other-speakers-turns`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from redteam_grpo.core.models.chat import build_messages, turn_closing_id
from redteam_grpo.core.models.roles import ATTACKER_SPEAKER, POLICY_SPEAKER
from redteam_grpo.core.seeds import derive_seed

# Marker texts the glue is read between; never tokenized themselves.
_MARKERS = ("\u2063first\u2063", "\u2063second\u2063", "\u2063third\u2063")


class DialogueDriftError(ValueError):
    """A turn's prompt does not start with the speaker's previous prompt and turn as sampled."""


@dataclass(frozen=True)
class TurnGlue:
    """The ids a chat template puts around a turn, read off the template once.

    closing_id: closes an assistant turn; appended to a turn that ran out of tokens before it closed itself.
    after_assistant: from the closing id (exclusive) to the text of the next user turn: "\\n<|im_start|>user\\n".
    before_assistant: from the text of a user turn to the text of the next assistant turn (the turn opened, as a
      generation prompt opens it): "<|im_end|>\\n<|im_start|>assistant\\n".
    """

    tokenizer: Any
    end_of_turn: tuple[int, ...]
    closing_id: int
    after_assistant: tuple[int, ...]
    before_assistant: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, end_of_turn: Sequence[int]) -> TurnGlue:
        first, second, third = _MARKERS
        messages = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": second},
            {"role": "user", "content": third},
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        between = text[text.index(second) + len(second) : text.index(third)]
        after = text[text.index(third) + len(third) :]
        closing = turn_closing_id(tokenizer, end_of_turn)
        between_ids = list(tokenizer(between, add_special_tokens=False)["input_ids"])
        if not between_ids or between_ids[0] != closing:
            raise ValueError(
                f"the chat template puts {between!r} after an assistant turn, not its end-of-turn token first: "
                "dialogues cannot be built on its ids"
            )
        return cls(
            tokenizer=tokenizer,
            end_of_turn=tuple(int(i) for i in end_of_turn),
            closing_id=closing,
            after_assistant=tuple(between_ids[1:]),
            before_assistant=tuple(tokenizer(after, add_special_tokens=False)["input_ids"]),
        )

    def opening(self, system_prompt: str | None) -> list[int]:
        """The ids of a conversation before its first user turn's text: the system prompt, the user turn opened."""
        marker = _MARKERS[0]
        text = self.tokenizer.apply_chat_template(
            build_messages(marker, system_prompt), add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"])

    def first_prompt(self, opening: Sequence[int], reply_ids: Sequence[int]) -> list[int]:
        """A speaker's first prompt whose user turn is another speaker's turn (its `content`), as ids."""
        return [*opening, *reply_ids, *self.before_assistant]

    def content(self, completion_ids: Sequence[int]) -> list[int]:
        """A turn as the other speaker reads it: the sampled ids without the end-of-turn token that closed it."""
        ids = list(completion_ids)
        return ids[:-1] if ids and ids[-1] in self.end_of_turn else ids

    def continued(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], finish_reason: str) -> list[int]:
        """A speaker's view after its turn, up to the text of the next user turn: its prompt and turn exactly as
        sampled (closed if it ran out of tokens), and the user turn opened."""
        closing = [self.closing_id] if finish_reason == "length" else []
        return [*prompt_ids, *completion_ids, *closing, *self.after_assistant]

    def next_prompt(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], finish_reason: str, reply_ids: Sequence[int]
    ) -> list[int]:
        """The speaker's next prompt: `continued`, the other speaker's reply (`content` of its turn) as the user
        turn's text, and the assistant turn opened."""
        return self.first_prompt(self.continued(prompt_ids, completion_ids, finish_reason), reply_ids)


@dataclass(frozen=True)
class SpeakerTurn:
    """One turn of one speaker: its prompt exactly as fed, the turn exactly as sampled, a logprob per token."""

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]


def speaker_row(turns: Sequence[SpeakerTurn]) -> tuple[list[int], list[tuple[int, int]], list[float]]:
    """One speaker's turns of a dialogue as one training row: (the sequence, the spans of its own turns in it, their
    sampled logprobs in order). The sequence is the last turn's prompt and completion, the whole dialogue as the
    speaker saw it; each earlier turn must sit in it where it was sampled (DialogueDriftError otherwise)."""
    if not turns:
        raise ValueError("a speaker row needs at least one turn")
    for t, turn in enumerate(turns):
        if len(turn.logprobs) != len(turn.completion_ids):
            raise ValueError(f"turn {t}: {len(turn.logprobs)} logprobs for {len(turn.completion_ids)} tokens")
    for t, (before, after) in enumerate(pairwise(turns), start=1):
        sampled = [*before.prompt_ids, *before.completion_ids]
        fed = list(after.prompt_ids[: len(sampled)])
        if fed != sampled:
            where = next((i for i, (a, b) in enumerate(zip(fed, sampled, strict=False)) if a != b), len(fed))
            raise DialogueDriftError(
                f"turn {t}'s prompt differs from turn {t - 1}'s prompt and tokens as sampled at token {where} of "
                f"{len(sampled)}: the dialogue was not built by appending ids (TurnGlue.next_prompt)"
            )
    last = turns[-1]
    sequence = [*last.prompt_ids, *last.completion_ids]
    spans = [(len(turn.prompt_ids), len(turn.prompt_ids) + len(turn.completion_ids)) for turn in turns]
    logprobs = [float(lp) for turn in turns for lp in turn.logprobs]
    return sequence, spans, logprobs


@dataclass(frozen=True)
class DialogueTurn:
    """One sampled message of a dialogue: who sampled it, with which prompt ids, and what."""

    prompt_index: int  # the prompt the dialogue started from
    sample_idx: int  # the dialogue's index in the prompt's group (0..G-1)
    turn: int  # the exchange: the attacker's user turn t, then the policy's answer t
    speaker: str  # POLICY_SPEAKER or ATTACKER_SPEAKER
    prompt_ids: list[int]  # exactly as fed to the speaker
    completion_ids: list[int]  # exactly as sampled
    sample_logprobs: list[float]
    finish_reason: str


# (prompt ids, max_new_tokens, seed, group size) -> core/rollouts/sampling.py: Completion list, prompt by prompt
SampleFn = Callable[[list[list[int]], int, int, int], list[Any]]


def sample_dialogues(
    sample: SampleFn,
    glue: TurnGlue,
    policy_prompts: Sequence[Sequence[int]],
    attacker_openings: Sequence[Sequence[int]],
    group_size: int,
    turns: int,
    max_new_tokens: int,
    attacker_max_new_tokens: int,
    seed: int,
    max_context: int,
    attacker: Callable[[], contextlib.AbstractContextManager[Any]],
) -> list[DialogueTurn]:
    """`group_size` dialogues of `turns` exchanges from each prompt: the policy answers its prompt (turn 0, the
    single-turn draw exactly: one call with the group, `seed`), then, turn after turn, the attacker writes the next
    user turn from its own view of the dialogue and the policy answers it. Every prompt is built by appending ids
    (`TurnGlue`); each dialogue draws its own later turns (one sample per dialogue, seeds derived from `seed`, the
    turn and the speaker).

    `sample(prompt_ids, max_new_tokens, seed, group_size)` draws `group_size` completions per prompt with the active
    adapter (a `Completion` list in prompt order); `attacker()` is the context it runs the attacker's turns in (the
    frozen base, or the attacker's adapter). `attacker_openings[p]`: the attacker's view of prompt p's dialogues up to
    where the policy's first answer goes. A dialogue that would outgrow `max_context` tokens is an error that names
    the settings, never a silent cut.
    """
    first = sample([list(p) for p in policy_prompts], max_new_tokens, seed, group_size)
    records: list[DialogueTurn] = []
    policy_state: list[tuple[list[int], Any]] = []  # per dialogue: (prompt, its latest completion)
    keys: list[tuple[int, int]] = []
    for completion in first:
        prompt = list(policy_prompts[completion.prompt_index])
        keys.append((completion.prompt_index, completion.sample_idx))
        policy_state.append((prompt, completion))
        records.append(_record(keys[-1], 0, POLICY_SPEAKER, prompt, completion))
    # per dialogue: the attacker's view up to where the policy's latest answer goes
    attacker_views = [list(attacker_openings[p]) for p, _ in keys]
    for turn in range(1, turns):
        attacker_prompts = [
            glue.first_prompt(view, glue.content(answer.completion_ids))
            for view, (_, answer) in zip(attacker_views, policy_state, strict=True)
        ]
        _check_context(attacker_prompts, attacker_max_new_tokens, max_context, turn, ATTACKER_SPEAKER)
        with attacker():
            written = sample(
                attacker_prompts, attacker_max_new_tokens, derive_seed(seed, "dialogue", turn, "attacker"), 1
            )
        policy_prompts_now = []
        for d, user_turn in enumerate(written):
            attacker_views[d] = glue.continued(attacker_prompts[d], user_turn.completion_ids, user_turn.finish_reason)
            records.append(_record(keys[d], turn, ATTACKER_SPEAKER, attacker_prompts[d], user_turn))
            prompt, answer = policy_state[d]
            policy_prompts_now.append(
                glue.next_prompt(
                    prompt, answer.completion_ids, answer.finish_reason, glue.content(user_turn.completion_ids)
                )
            )
        _check_context(policy_prompts_now, max_new_tokens, max_context, turn, POLICY_SPEAKER)
        answers = sample(policy_prompts_now, max_new_tokens, derive_seed(seed, "dialogue", turn, "policy"), 1)
        for d, answer in enumerate(answers):
            policy_state[d] = (policy_prompts_now[d], answer)
            records.append(_record(keys[d], turn, POLICY_SPEAKER, policy_prompts_now[d], answer))
    return records


def _record(key: tuple[int, int], turn: int, speaker: str, prompt: list[int], completion: Any) -> DialogueTurn:
    return DialogueTurn(
        key[0],
        key[1],
        turn,
        speaker,
        list(prompt),
        list(completion.completion_ids),
        list(completion.sample_logprobs),
        completion.finish_reason,
    )


def _check_context(prompts: Sequence[Sequence[int]], max_new: int, max_context: int, turn: int, speaker: str) -> None:
    longest = max((len(p) for p in prompts), default=0)
    if longest + max_new > max_context:
        raise ValueError(
            f"turn {turn}: the {speaker}'s prompt is {longest} tokens, and {max_new} more may be sampled: past the "
            f"{max_context} tokens the model reads. Lower dialogue.turns or the turns' max_new_tokens"
        )


@dataclass(frozen=True)
class DialogueRow:
    """One dialogue as the policy's scoring and training row: its last turn's prompt and completion (the whole dialogue
    as the policy saw it), the spans of its own turns in them and their sampled logprobs."""

    prompt_id: str
    sample_idx: int
    last: int  # the table row of the policy's last turn
    prompt_ids: list[int]
    completion_ids: list[int]
    spans: list[tuple[int, int]]
    logprobs: list[float]
    own_ids: list[int]  # the policy's tokens of every turn, in order


def policy_dialogues(columns: Mapping[str, Sequence[Any]]) -> list[DialogueRow]:
    """The policy's dialogues in a rollouts table's columns (prompt_id, sample_idx, turn, speaker, prompt_token_ids,
    completion_token_ids, sampling_logprobs), in the order their first turn appears; a single-turn table gives one
    row per completion, its completion the one span."""
    turns_of: dict[tuple[str, int], list[int]] = {}
    for row, (prompt_id, sample_idx, speaker) in enumerate(
        zip(columns["prompt_id"], columns["sample_idx"], columns["speaker"], strict=True)
    ):
        if speaker == POLICY_SPEAKER:
            turns_of.setdefault((prompt_id, int(sample_idx)), []).append(row)
    dialogues = []
    for (prompt_id, sample_idx), rows in turns_of.items():
        rows = sorted(rows, key=lambda r: columns["turn"][r])
        if [columns["turn"][r] for r in rows] != list(range(len(rows))):
            raise DialogueDriftError(
                f"dialogue {prompt_id}/{sample_idx}: the policy's turns are {[columns['turn'][r] for r in rows]}, not "
                f"0..{len(rows) - 1}"
            )
        turns = [
            SpeakerTurn(
                columns["prompt_token_ids"][r], columns["completion_token_ids"][r], columns["sampling_logprobs"][r]
            )
            for r in rows
        ]
        _, spans, logprobs = speaker_row(turns)
        last = rows[-1]
        dialogues.append(
            DialogueRow(
                prompt_id,
                sample_idx,
                last,
                list(columns["prompt_token_ids"][last]),
                list(columns["completion_token_ids"][last]),
                spans,
                logprobs,
                [t for turn in turns for t in turn.completion_ids],
            )
        )
    return dialogues


def dialogue_messages(columns: Mapping[str, Sequence[Any]]) -> dict[tuple[str, int], list[dict[str, str]]]:
    """Each dialogue of a rollouts table's columns (prompt_id, sample_idx, turn, speaker, prompt, completion_text) as
    chat messages from the policy's side: the prompt, then per turn the attacker's user message (turns 1..) and the
    policy's answer. The attacker's own first prompt of a defense dialogue is the policy's turn-0 `prompt`, so an
    attacker row of turn 0 adds nothing."""
    order = sorted(
        range(len(columns["turn"])),
        key=lambda r: (columns["turn"][r], columns["speaker"][r] == POLICY_SPEAKER),  # a turn's attacker first
    )
    messages: dict[tuple[str, int], list[dict[str, str]]] = {}
    for r in order:
        turn, speaker = columns["turn"][r], columns["speaker"][r]
        dialogue = messages.setdefault((columns["prompt_id"][r], int(columns["sample_idx"][r])), [])
        if speaker == POLICY_SPEAKER:
            if turn == 0:
                dialogue.append({"role": "user", "content": columns["prompt"][r]})
            dialogue.append({"role": "assistant", "content": columns["completion_text"][r]})
        elif turn > 0:
            dialogue.append({"role": "user", "content": columns["completion_text"][r]})
    return messages


@dataclass(frozen=True)
class PolicyRows:
    """The rows of a rollouts table that are scored and trained: `columns` holds one row each (a single-turn table's
    own rows; of dialogues, the policy's last turn of each), `spans` the policy's turns in each row's prompt +
    completion (None: the completion), `logprobs` their sampled logprobs, `own_ids` their tokens and `messages`
    each dialogue as chat messages ending with its last answer (None: single turn)."""

    columns: dict[str, list[Any]]
    spans: list[list[tuple[int, int]]] | None
    logprobs: list[list[float]]
    own_ids: list[list[int]]
    messages: list[list[dict[str, str]]] | None = None


def policy_rows(columns: Mapping[str, Sequence[Any]]) -> PolicyRows:
    """The rollouts table's rows as the score and train steps see them: a table with rows of later turns holds
    dialogues, one row each (`policy_dialogues`); any other, its rows as they are."""
    if not any(turn > 0 for turn in columns["turn"]):
        return PolicyRows(
            {name: list(values) for name, values in columns.items()},
            None,
            list(columns["sampling_logprobs"]),
            list(columns["completion_token_ids"]),
        )
    dialogues = policy_dialogues(columns)
    messages = dialogue_messages(columns)
    return PolicyRows(
        {name: [values[d.last] for d in dialogues] for name, values in columns.items()},
        [d.spans for d in dialogues],
        [d.logprobs for d in dialogues],
        [d.own_ids for d in dialogues],
        [messages[(d.prompt_id, d.sample_idx)] for d in dialogues],
    )
