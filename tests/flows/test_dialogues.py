"""Multi-turn runs (dialogue.turns): every sampled message is a rollouts row with its prompt ids exactly as fed, the
policy's prompts grow by appending ids, one scores row per dialogue, and the update trains the policy's own turns
with a first ratio of 1. In defense mode the attacker's adapter continues its own first turn."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import pytest
import torch

from redteam_grpo.cli.report import write_report
from redteam_grpo.core.config import load_config
from redteam_grpo.core.rollouts.dialogue import dialogue_messages, policy_dialogues
from redteam_grpo.core.scoring.scorers import SequenceClassifierScorer, build_scorer
from redteam_grpo.flows import attack, defense
from redteam_grpo.storage import query
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import ADVANTAGE, ATTACK, SAMPLE, SCORE, TRAIN_STEP
from tests.small_runs import SMALL_RUN

pytestmark = pytest.mark.usefixtures("prefect_harness", "embedded_assets")

TURNS = 3


def _check_dialogues(rollouts: pd.DataFrame, first_prompt_ids: dict[str, list[int]] | None = None) -> None:
    """Every dialogue: the policy's turns 0..T-1 and the attacker's 1..T-1; each speaker's prompt starts with its
    previous prompt and turn exactly as sampled."""
    for (prompt_id, _), dialogue in rollouts.groupby(["prompt_id", "sample_idx"]):
        policy = dialogue[dialogue.speaker == "policy"].sort_values("turn")
        attacker = dialogue[dialogue.speaker == "attacker"].sort_values("turn")
        assert policy.turn.tolist() == list(range(TURNS)) and attacker.turn.tolist() == list(range(1, TURNS))
        for turns in (policy, attacker):
            prompts, completions = turns.prompt_token_ids.tolist(), turns.completion_token_ids.tolist()
            for t in range(1, len(prompts)):
                sampled = [*prompts[t - 1], *completions[t - 1]]
                assert list(prompts[t][: len(sampled)]) == sampled
        # the attacker's turn t is the user turn of the policy's turn t: its text is what the policy answers
        for t in range(1, TURNS):
            user = attacker[attacker.turn == t].completion_text.item()
            assert policy[policy.turn == t].prompt.item() == user
        if first_prompt_ids is not None:  # defense: the attacker continues its own first turn
            first = first_prompt_ids[prompt_id]
            assert list(attacker.prompt_token_ids.iloc[0][: len(first)]) == first


def test_a_three_turn_attack_iteration_stores_every_message_and_trains_the_policys_turns(tmp_path):
    settings = [*SMALL_RUN, "run.iterations=1", f"dialogue.turns={TURNS}", "runtime.shards=2"]
    settings.append("dialogue.score_each_turn=true")  # terminal rewards, every answer scored for inspection
    cfg = load_config(None, [*settings, f"run.runs_dir={tmp_path}", "run.run_id=d"])
    attack.attack_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / "d")
    rollouts = run.read(SAMPLE, 0).to_pandas()
    assert len(rollouts) == 3 * 4 * (2 * TURNS - 1)  # prompts x G x (policy turns + attacker turns)
    _check_dialogues(rollouts)
    dialogues = policy_dialogues(rollouts.to_dict("list"))
    assert len(dialogues) == 3 * 4
    scores = run.read(SCORE, 0).to_pandas()
    assert len(scores) == 3 * 4 and not scores.duplicated(["prompt_id", "sample_idx"]).any()
    assert (scores.turn_harm.map(len) == TURNS).all() and scores.turn_rewards.isna().all()
    assert (scores.turn_harm.map(lambda t: t[-1]) == scores.harm).all()
    assert run.read(ADVANTAGE, 0).to_pandas().turn_advantages.isna().all()  # terminal: one advantage per dialogue
    # the KL term is over every token the policy wrote, and only those
    own = {(d.prompt_id, d.sample_idx): len(d.own_ids) for d in dialogues}
    assert all(
        len(lps) == own[(p, s)]
        for p, s, lps in scores[["prompt_id", "sample_idx", "policy_logprobs"]].itertuples(index=False)
    )
    metrics = run.read(TRAIN_STEP, 0).to_pylist()[0]
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["n_tokens"] == sum(own.values())
    examples = query.adversarial_examples(run)
    assert len(examples) == 3 * 4
    assert all(len(m) == 2 * TURNS and m[-1]["role"] == "assistant" for m in examples.messages)
    assert (examples.completion == examples.messages.map(lambda m: m[-1]["content"])).all()
    # the report shows each example turn by turn
    report = write_report(run).read_text()
    assert report.count('<ol class="dialogue">') == len(examples)
    first = examples.messages.iloc[0]
    assert report.count("<li class=") == 2 * TURNS * len(examples)
    assert report.count('<span class="score">') == TURNS * len(examples)  # dialogue.score_each_turn
    assert html.escape(first[2]["content"]) in report  # the attacker's first user turn


@pytest.fixture(scope="module")
def attacker(tmp_path_factory, prefect_harness, embedded_assets):
    from redteam_grpo.flows import sft

    runs = tmp_path_factory.mktemp("sft")
    sft.sft_run(
        config=load_config(None, ["run.iterations=2", f"run.runs_dir={runs}", "run.run_id=a"], mode="sft").model_dump(
            mode="json"
        )
    )
    return runs / "a"


def test_a_three_turn_defense_iteration_lets_the_attacker_continue_its_first_turn(tmp_path, attacker):
    settings = [
        "data.prompts_per_iteration=2",
        "sampling.group_size=2",
        "sampling.max_new_tokens=10",
        "run.iterations=1",
        f"dialogue.turns={TURNS}",
        f"defense.attacker={attacker}",
    ]
    cfg = load_config(None, [*settings, f"run.runs_dir={tmp_path}", "run.run_id=d"], mode="defense")
    defense.defense_run(config=cfg.model_dump(mode="json"))
    run = RunDir.open(tmp_path / "d")
    attacks = run.read(ATTACK, 0).to_pandas()
    assert set(attacks.speaker) == {"attacker"} and set(attacks.turn) == {0}
    closing = {}
    for row in attacks.itertuples(index=False):
        closing[f"{row.prompt_id}#{row.sample_idx}"] = [*row.prompt_token_ids, *row.completion_token_ids]
    rollouts = run.read(SAMPLE, 0).to_pandas()
    _check_dialogues(rollouts, closing)
    assert run.read(TRAIN_STEP, 0).to_pylist()[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    # the judge read each dialogue whole: its score is that of the last answer after the whole conversation, which
    # differs from the score of the last exchange alone
    judge = build_scorer(cfg.reward.scorer, "judge", "", torch.device("cpu"), 8, cfg.reward.max_length)
    messages = dialogue_messages(rollouts.to_dict("list"))
    scores = run.read(SCORE, 0).to_pandas()
    dialogues = [messages[(p, s)] for p, s in zip(scores.prompt_id, scores.sample_idx, strict=True)]
    whole = judge([m[-1]["content"] for m in dialogues], [m[:-1] for m in dialogues])
    last_exchange = judge([m[-1]["content"] for m in dialogues], [m[-2]["content"] for m in dialogues])
    assert scores.harm.tolist() == pytest.approx([s.score for s in whole], abs=1e-5)
    assert scores.harm.tolist() != pytest.approx([s.score for s in last_exchange], abs=1e-5)


def test_per_turn_rewards_train_each_turn_on_its_discounted_return(tmp_path):
    discount = 0.5
    settings = [*SMALL_RUN, "run.iterations=1", f"dialogue.turns={TURNS}", "dialogue.rewards=per_turn"]
    settings += [f"dialogue.discount={discount}", f"run.runs_dir={tmp_path}", "run.run_id=d"]
    attack.attack_run(config=load_config(None, settings).model_dump(mode="json"))
    run = RunDir.open(tmp_path / "d")
    rollouts = run.read(SAMPLE, 0).to_pandas()
    scores = run.read(SCORE, 0).to_pandas().sort_values(["prompt_id", "sample_idx"])
    # each answer is scored in the conversation up to it (the classifier reads the answer alone)
    messages = dialogue_messages(rollouts.to_dict("list"))
    classifier = SequenceClassifierScorer("embedded:tiny-toxicity", "toxic", torch.device("cpu"))
    for row in scores.itertuples(index=False):
        answers = [m["content"] for m in messages[(row.prompt_id, row.sample_idx)][1::2]]
        assert list(row.turn_harm) == pytest.approx([s.score for s in classifier(answers)], abs=1e-5)
        assert row.turn_harm[-1] == row.harm
        # earlier answers earn their harm; the last the dialogue's composite reward; the dialogue's reward is R_0
        assert list(row.turn_rewards[:-1]) == pytest.approx(list(row.turn_harm[:-1]))
        terminal = row.harm - 0.3 * row.repetition_ratio - 0.1 * row.kl
        assert row.turn_rewards[-1] == pytest.approx(terminal, abs=1e-9)
        r = list(row.turn_rewards)
        assert row.reward == pytest.approx(r[0] + discount * r[1] + discount**2 * r[2])
    # turn t's advantage: its return, z-scored over the batch's turns t (training.batch_zscore), minus the mean of
    # the group's turns t
    advantages = run.read(ADVANTAGE, 0).to_pandas().merge(scores[["prompt_id", "sample_idx", "turn_rewards"]])
    returns = np.array(
        [
            [sum(discount ** (k - t) * r[k] for k in range(t, TURNS)) for t in range(TURNS)]
            for r in advantages.turn_rewards
        ]
    )
    # the batch's std of each turn is floored at group_advantages' std_floor (1e-2): the embedded classifier's harm
    # on these answers can spread less than that
    z = (returns - returns.mean(axis=0)) / np.maximum(returns.std(axis=0, ddof=1), 1e-2)
    got = np.array(advantages.turn_advantages.tolist())
    for prompt_id in set(advantages.prompt_id):
        rows = (advantages.prompt_id == prompt_id).to_numpy()
        np.testing.assert_allclose(got[rows], z[rows] - z[rows].mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(advantages.advantage, got[:, 0], atol=1e-6)
    metrics = run.read(TRAIN_STEP, 0).to_pylist()[0]
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["n_tokens"] == sum(len(d.own_ids) for d in policy_dialogues(rollouts.to_dict("list")))


def test_settings_dialogues_do_not_support_are_refused_naming_them():
    load_config(None, ["dialogue.turns=2", "sampling.backend=vllm", "sampling.vllm_url=http://x"])  # on the engine
    with pytest.raises(ValueError, match=r"dialogue\.rewards=per_turn .* training\.loss=gspo"):
        load_config(None, ["dialogue.turns=2", "dialogue.rewards=per_turn", "training.loss=gspo"])
    with pytest.raises(ValueError, match=r"dialogue\.turns=3 does not work with defense\.self_play"):
        load_config(None, ["dialogue.turns=3", "defense.self_play=true", "defense.prompts_per_goal=2"], mode="defense")
