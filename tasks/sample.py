"""Stage 1: sample G completions per prompt from the current policy; record token ids and logprobs.

In defense mode the prompts are the attacker's, read from this iteration's attacks file (`tasks/attack.py`), and
the policy is the defender; the stage is otherwise the same.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute
from prefect import task
from prefect.cache_policies import NO_CACHE

from redteam_grpo.core.data.sources import Prompt, check_prompt_lengths, prompts_for_iteration
from redteam_grpo.core.models.chat import format_prompt_ids
from redteam_grpo.core.models.policy import Policy, resolve_model_name
from redteam_grpo.core.models.roles import ATTACKER, DEFAULT_ROLE
from redteam_grpo.core.rollouts.diagnostics import RolloutStats, rollout_stats
from redteam_grpo.core.rollouts.dialogue import (
    ATTACKER_SPEAKER,
    POLICY_SPEAKER,
    DialogueTurn,
    TurnGlue,
    sample_dialogues,
)
from redteam_grpo.core.rollouts.sampling import Completion, sample_completions
from redteam_grpo.core.rollouts.shards import shard_seed, shard_span
from redteam_grpo.core.training.staleness import drawing_version
from redteam_grpo.storage import schemas
from redteam_grpo.storage.modes import mode_of
from redteam_grpo.storage.rundir import INIT_VERSION, RunDir
from redteam_grpo.storage.stages import SAMPLE, Stage
from redteam_grpo.tasks.common import run_sharded_stage
from redteam_grpo.tasks.logs import stage_logger
from redteam_grpo.tasks.resources import RunResources, resources_for

ATTACK_PROMPT_SEPARATOR = "#"
"""Defense: the defender's prompt id is `<goal id>#<attacker sample>`, so every row joins back to its goal."""


def sample_rollouts(
    policy: Policy,
    run_id: str,
    iteration: int,
    prompts: Sequence[Prompt],
    system_prompt: str | None,
    max_prompt_tokens: int,
    samples_per_prompt: int,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    policy_version: int,
    draw: Callable[[list[list[int]]], list[Completion]] | None = None,
    speaker: str = POLICY_SPEAKER,
) -> pa.Table:
    """Sample `samples_per_prompt` completions of every prompt with the active adapter; the rollouts table (prompt
    ids exactly as fed, completion ids exactly as drawn, one sampling logprob per token), every row turn 0 of
    `speaker`. `policy_version`: the version of the active adapter's weights, as the run's resources hold them.
    `draw(prompt_ids)`: another sampler of the same contract (the vLLM server's client) instead of the in-process
    one."""
    tokenizer = policy.tokenizer
    prompt_ids = [format_prompt_ids(tokenizer, p.text, system_prompt) for p in prompts]
    check_prompt_lengths(list(prompts), prompt_ids, max_prompt_tokens)
    if draw is None:
        completions = sample_completions(policy, prompt_ids, samples_per_prompt, max_new_tokens, batch_size, seed)
    else:
        completions = draw(prompt_ids)
    return rollouts_table(
        policy,
        run_id,
        iteration,
        seed,
        completions,
        prompt_id=[prompts[c.prompt_index].prompt_id for c in completions],
        prompt=[prompts[c.prompt_index].text for c in completions],
        prompt_token_ids=[prompt_ids[c.prompt_index] for c in completions],
        turn=[0] * len(completions),
        speaker=[speaker] * len(completions),
        policy_version=[policy_version] * len(completions),
    )


def rollouts_table(
    policy: Policy,
    run_id: str,
    iteration: int,
    seed: int,
    messages: Sequence[Completion | DialogueTurn],
    **per_row: list,
) -> pa.Table:
    """The rollouts table of sampled `messages` (completions, or a dialogue's turns) drawn with `seed`; `per_row`:
    the columns that depend on the message's prompt or speaker (prompt_id, prompt, prompt_token_ids, turn, speaker,
    policy_version: the weights that drew it, as held, never the iteration's arithmetic: the trainer checks it,
    core/training/staleness.py), and completion_text when the caller decoded it already."""
    n = len(messages)
    completion_ids = [m.completion_ids for m in messages]
    if "completion_text" not in per_row:
        per_row["completion_text"] = policy.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return schemas.to_table(
        {
            "run_id": [run_id] * n,
            "iteration": [iteration] * n,
            "sample_idx": [m.sample_idx for m in messages],
            "completion_token_ids": completion_ids,
            "sampling_logprobs": [m.sample_logprobs for m in messages],
            "finish_reason": [m.finish_reason for m in messages],
            "completion_length": [len(ids) for ids in completion_ids],
            "sampling_seed": [seed] * n,
            "temperature": [policy.distribution.temperature] * n,
            **per_row,
        },
        schemas.ROLLOUTS,
        "rollouts",
    )


def engine_turns(res: RunResources, iteration: int, stale: int | None, attacker_stale: int | None):
    """sampling.backend=vllm: the `sample` function and `attacker` context of `sample_dialogues` on the engine. The
    policy's turns use its adapter; inside `attacker()` the turns use the attacker's adapter (defense) or the served
    base without one (attack mode's frozen attacker). The ids go as they are, one request per turn. `stale`,
    `attacker_stale`: one step off-policy, the versions whose checkpoints the adapters are served from."""
    cfg, policy = res.config, res.policy
    names = {POLICY_SPEAKER: res.vllm_adapter(iteration - 1) if stale is None else res.vllm_checkpoint_adapter(stale)}
    if ATTACKER in mode_of(cfg).roles:  # the attacker speaks through its adapter on the base
        names[ATTACKER_SPEAKER] = (
            res.vllm_adapter(iteration - 1, ATTACKER)
            if attacker_stale is None
            else res.vllm_checkpoint_adapter(attacker_stale, ATTACKER)
        )
    else:  # the served base's name: the model the server was started with
        names[ATTACKER_SPEAKER] = resolve_model_name(cfg.model.policy)
    speaking = [POLICY_SPEAKER]

    @contextlib.contextmanager
    def attacker() -> Iterator[None]:
        speaking.append(ATTACKER_SPEAKER)
        try:
            yield
        finally:
            speaking.pop()

    def sample(prompt_ids: list[list[int]], max_new_tokens: int, turn_seed: int, group_size: int) -> list[Completion]:
        return res.vllm.sample(
            names[speaking[-1]],
            prompt_ids,
            group_size,
            max_new_tokens,
            cfg.sampling.temperature,
            turn_seed,
            policy.end_of_turn_ids,
            policy.distribution.suppressed_ids,
        )

    return sample, attacker


def sample_dialogue_rollouts(
    res: RunResources, iteration: int, prompts: Sequence[Prompt], seed: int, stale: int | None = None
) -> pa.Table:
    """dialogue.turns > 1: `sampling.group_size` dialogues from every prompt (core/rollouts/dialogue.py:
    sample_dialogues), one row per sampled message, the policy's and the attacker's, each with its prompt ids exactly as
    fed. The attacker is the frozen base with dialogue.attacker_system_prompt (attack mode), or the attacker's adapter
    continuing its own first turn, read from this iteration's attacks (defense mode). `stale`: the policy speaks with
    the adapter of that earlier version, served from its checkpoint (training.max_staleness), not from memory."""
    cfg, policy = res.config, res.policy
    tokenizer = policy.tokenizer
    glue = TurnGlue.from_tokenizer(tokenizer, policy.end_of_turn_ids)
    policy_prompts = [format_prompt_ids(tokenizer, p.text, cfg.model.system_prompt) for p in prompts]
    check_prompt_lengths(list(prompts), policy_prompts, cfg.model.max_prompt_tokens)
    first_turns = mode_of(cfg).prompts  # the stage whose rows are each dialogue's first turn, or none
    if first_turns is not None:
        attacks = res.run.read(first_turns, iteration).to_pydict()
        first_turn = {
            f"{goal}{ATTACK_PROMPT_SEPARATOR}{idx}": glue.continued(prompt, completion, finish)
            for goal, idx, prompt, completion, finish in zip(
                attacks["prompt_id"],
                attacks["sample_idx"],
                attacks["prompt_token_ids"],
                attacks["completion_token_ids"],
                attacks["finish_reason"],
                strict=True,
            )
        }
        openings = [first_turn[p.prompt_id] for p in prompts]
        attacker = functools.partial(policy.role, ATTACKER)
        attacker_stale = attacker_drawing_version(res, iteration)
        attacker_version = held_version(res, ATTACKER) if attacker_stale is None else attacker_stale
    else:
        instructions = cfg.dialogue.attacker_system_prompt
        openings = [glue.opening(instructions.replace("{prompt}", p.text)) for p in prompts]
        attacker = policy.reference
        attacker_version, attacker_stale = INIT_VERSION, None  # the base: no update made its weights
    policy_version = held_version(res, DEFAULT_ROLE) if stale is None else stale
    drawn_by = {POLICY_SPEAKER: policy_version, ATTACKER_SPEAKER: attacker_version}

    def sample(prompt_ids: list[list[int]], max_new_tokens: int, turn_seed: int, group_size: int) -> list[Completion]:
        return sample_completions(policy, prompt_ids, group_size, max_new_tokens, cfg.sampling.batch_size, turn_seed)

    if cfg.sampling.backend == "vllm":  # every turn a round trip to the engine, with the speaker's adapter
        sample, attacker = engine_turns(res, iteration, stale, attacker_stale)

    records = sample_dialogues(
        sample,
        glue,
        policy_prompts,
        openings,
        group_size=cfg.sampling.group_size,
        turns=cfg.dialogue.turns,
        max_new_tokens=cfg.sampling.max_new_tokens,
        attacker_max_new_tokens=cfg.dialogue.attacker_max_new_tokens,
        seed=seed,
        max_context=getattr(policy.model.config, "max_position_embeddings", None) or 1 << 30,
        attacker=attacker,
    )
    # dialogue by dialogue, turn by turn, the attacker's user turn before the policy's answer
    records.sort(key=lambda r: (r.prompt_index, r.sample_idx, r.turn, r.speaker != ATTACKER_SPEAKER))
    texts = tokenizer.batch_decode([r.completion_ids for r in records], skip_special_tokens=True)
    answered: dict[tuple[int, int, int, str], str] = {}  # the text each row answers
    for r, text in zip(records, texts, strict=True):
        if r.speaker == ATTACKER_SPEAKER:
            answered[(r.prompt_index, r.sample_idx, r.turn, POLICY_SPEAKER)] = text
        else:
            answered[(r.prompt_index, r.sample_idx, r.turn + 1, ATTACKER_SPEAKER)] = text
    return rollouts_table(
        policy,
        res.run.run_id,
        iteration,
        seed,
        records,
        prompt_id=[prompts[r.prompt_index].prompt_id for r in records],
        prompt=[
            answered.get((r.prompt_index, r.sample_idx, r.turn, r.speaker), prompts[r.prompt_index].text)
            for r in records
        ],
        prompt_token_ids=[r.prompt_ids for r in records],
        completion_text=texts,
        turn=[r.turn for r in records],
        speaker=[r.speaker for r in records],
        policy_version=[drawn_by[r.speaker] for r in records],
    )


def drawing_stale_version(res: RunResources, iteration: int) -> int | None:
    """One step off-policy (`Mode.staleness`): the version of the policy's adapter that draws `iteration`
    (`core/training/staleness.py: drawing_version`), served from its checkpoint; None when the run is synchronous."""
    steps, _ = mode_of(res.config).staleness(res.config)
    return drawing_version(iteration, steps) if steps else None


def attacker_drawing_version(res: RunResources, iteration: int) -> int | None:
    """As `drawing_stale_version`, for the attacker's adapter: its own drawing version where it learns (self-play),
    else its initial checkpoint's, which it keeps."""
    stale = drawing_stale_version(res, iteration)
    if stale is None or ATTACKER in mode_of(res.config).learning_roles(res.config):
        return stale
    return INIT_VERSION


def held_version(res: RunResources, role: str) -> int:
    """The version of `role`'s weights in memory, which its rows record as the weights that drew them."""
    version = res.roles[role].version
    if version is None:
        raise RuntimeError(f"the {role!r} adapter in memory is not one of the run's checkpoints: load one first")
    return version


def rollouts_stats(table: pa.Table, policy: Policy) -> RolloutStats:
    """The statistics of a rollouts table (every part of a sharded stage at once): lengths, truncation, turn ends of
    the trained speaker's messages (a dialogue's attacker turns are not counted)."""
    speakers = set(table.column("speaker").to_pylist())
    if len(speakers) > 1:
        table = table.filter(pa.compute.equal(table.column("speaker"), POLICY_SPEAKER))
    return rollout_stats(
        table.column("completion_token_ids").to_pylist(),
        table.column("finish_reason").to_pylist(),
        policy.end_of_turn_ids,
        policy.turn_header_ids,
    )


def vllm_draw(
    res: RunResources,
    version: int,
    seed: int,
    role: str = DEFAULT_ROLE,
    group_size: int | None = None,
    max_new_tokens: int | None = None,
    from_checkpoint: bool = False,
) -> Callable[[list[list[int]]], list[Completion]]:
    """The vLLM server's sampler with `role`'s adapter of `version` loaded; the same contract as the in-process one.
    `group_size` and `max_new_tokens`: sampling's unless given (the attacker's are defense settings).
    `from_checkpoint`: the adapter is exported from its checkpoint, the weights in memory left alone (one step
    off-policy: an update changes them meanwhile)."""
    cfg, policy = res.config, res.policy
    adapter = res.vllm_checkpoint_adapter(version, role) if from_checkpoint else res.vllm_adapter(version, role)

    def draw(prompt_ids: list[list[int]]) -> list[Completion]:
        stage_logger().info("sampling with the vLLM server at %s, adapter %s", cfg.sampling.vllm_url, adapter)
        return res.vllm.sample(
            adapter,
            prompt_ids,
            group_size or cfg.sampling.group_size,
            max_new_tokens or cfg.sampling.max_new_tokens,
            cfg.sampling.temperature,
            seed,
            policy.end_of_turn_ids,
            policy.distribution.suppressed_ids,
        )

    return draw


def stage_prompts(run: RunDir, stage: Stage, iteration: int) -> list[Prompt]:
    """The completions `stage` wrote in `iteration` as prompts, one per row (defense: the attacker's prompts, which
    the defender answers); a prompt's id names its row (`goal#index`)."""
    attacks = run.read(stage, iteration).to_pydict()
    return [
        Prompt(f"{goal}{ATTACK_PROMPT_SEPARATOR}{idx}", text)
        for goal, idx, text in zip(attacks["prompt_id"], attacks["sample_idx"], attacks["completion_text"], strict=True)
    ]


def iteration_prompts(res: RunResources, iteration: int) -> list[Prompt]:
    """The prompts of `iteration`, in order: a draw of the prompt source, or what the mode's prompt stage wrote
    (defense: the attacker's prompts)."""
    cfg = res.config
    source = mode_of(cfg).prompts
    if source is not None:
        return stage_prompts(res.run, source, iteration)
    return prompts_for_iteration(res.prompts, iteration, cfg.data.prompts_per_iteration, cfg.run.seed, cfg.data.shuffle)


@task(name="sample-shard", task_run_name="sample-{iteration}-shard-{shard}", cache_policy=NO_CACHE)
def sample_shard(run_dir: str, iteration: int, shard: int, session: str | None = None) -> tuple[str, int]:
    """Sample shard `shard` of the iteration's prompts with the weights after iteration - 1 and the shard's own seed;
    write its part of the rollouts table. Returns the part's path and rows. One step off-policy
    (training.max_staleness): with the adapter after iteration - 2, served from its checkpoint, the weights in memory
    left to the update that runs meanwhile (`core/training/staleness.py: drawing_version`)."""
    res = resources_for(run_dir, session)
    cfg = res.config
    stale = drawing_stale_version(res, iteration)
    if stale is None:
        res.ensure_version(iteration - 1)
    prompts = iteration_prompts(res, iteration)
    prompts = [prompts[i] for i in shard_span(len(prompts), cfg.runtime.shards, shard)]
    seed = shard_seed(cfg.run.seed, "sample", iteration, shard, cfg.runtime.shards)
    if cfg.dialogue.turns > 1:
        table = sample_dialogue_rollouts(res, iteration, prompts, seed, stale)
        path = res.run.write(SAMPLE, iteration, table, res.run.part_path(SAMPLE, iteration, shard, cfg.runtime.shards))
        return str(path), table.num_rows
    if stale is not None:
        draw, version = vllm_draw(res, stale, seed, from_checkpoint=True), stale
    else:
        draw = vllm_draw(res, iteration - 1, seed) if cfg.sampling.backend == "vllm" else None
        version = held_version(res, DEFAULT_ROLE)
    table = sample_rollouts(
        res.policy,
        res.run.run_id,
        iteration,
        prompts,
        cfg.model.system_prompt,
        cfg.model.max_prompt_tokens,
        cfg.sampling.group_size,
        cfg.sampling.max_new_tokens,
        cfg.sampling.batch_size,
        seed,
        version,
        draw,
    )
    path = res.run.write(SAMPLE, iteration, table, res.run.part_path(SAMPLE, iteration, shard, cfg.runtime.shards))
    return str(path), table.num_rows


def sample_stage(run_dir: str, iteration: int) -> str:
    """Stage 1 in `runtime.shards` shards (`tasks/common.py: run_sharded_stage`), recorded with its statistics."""
    res = resources_for(run_dir)
    return run_sharded_stage(
        res.run,
        SAMPLE,
        iteration,
        res.config.runtime,
        sample_shard,
        lambda t: rollouts_stats(t, res.policy),
        res.session,
    )
