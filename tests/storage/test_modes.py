"""The mode records: what one iteration of each mode runs, in which order, and which stages write weights."""

import re
from pathlib import Path

import pytest

from redteam_grpo.core.config import ConfigError, load_config
from redteam_grpo.flows.iteration import STAGE_TASKS
from redteam_grpo.storage.modes import MODES, mode_named, mode_of
from redteam_grpo.storage.stages import ALL_STAGES

ROOT = Path(__file__).resolve().parents[2]


def _names(mode: str, *overrides: str) -> list[str]:
    cfg = load_config(None, list(overrides), mode=mode)
    return [s.name for s in mode_of(cfg).stages(cfg)]


def test_each_mode_runs_its_stages_in_the_order_of_the_pipeline():
    assert _names("attack") == ["sample", "judge", "score", "advantage", "train_step", "checkpoint"]
    assert _names("attack", "dialogue.turns=3") == ["sample", "judge", "score", "advantage", "train_step", "checkpoint"]
    assert _names("defense") == ["attack", "sample", "judge", "score", "advantage", "train_step", "checkpoint"]
    assert _names("defense", "defense.self_play=true", "defense.prompts_per_goal=2") == [
        "attack",
        "sample",
        "judge",
        "score",
        "advantage",
        "train_step",
        "attack_score",
        "attack_advantage",
        "attack_train_step",
        "checkpoint",
    ]
    assert _names("sft") == ["sft_train", "checkpoint"]
    order = [s.name for s in ALL_STAGES]
    for mode in MODES:
        names = _names(mode)
        assert names == sorted(names, key=order.index), mode  # one order serves the manifest and redo


def test_what_runs_ahead_of_an_update_needs_no_weights_it_writes():
    # one step off-policy runs these beside the update before (flows/iteration.py: SampleAhead): each must read
    # nothing that update writes, so they end where the first stage that needs the policy's weights (score) begins
    def ahead(mode: str, *overrides: str) -> list[str]:
        cfg = load_config(None, list(overrides), mode=mode)
        return [s.name for s in mode_of(cfg).ahead_stages(cfg)]

    assert ahead("attack") == ["sample", "judge"]
    assert ahead("attack", "dialogue.turns=3") == ["sample", "judge"]
    assert ahead("defense") == ["attack", "sample", "judge"]
    assert ahead("defense", "defense.self_play=true", "defense.prompts_per_goal=2") == ["attack", "sample", "judge"]


def test_the_stages_that_write_weights_are_each_learners_update():
    def updates(mode: str, *overrides: str) -> list[str]:
        cfg = load_config(None, list(overrides), mode=mode)
        return [s.name for s in mode_of(cfg).update_stages(cfg)]

    assert updates("attack") == ["train_step"]
    assert updates("defense") == ["train_step"]
    assert updates("defense", "defense.self_play=true", "defense.prompts_per_goal=2") == [
        "train_step",
        "attack_train_step",
    ]
    assert updates("sft") == ["sft_train"]


def test_every_stage_has_a_task_of_its_name():
    assert set(STAGE_TASKS) == {s.name for s in ALL_STAGES}
    for name, task in STAGE_TASKS.items():
        assert getattr(task, "name", name) == name  # a Prefect task is named for its stage


def test_an_unknown_mode_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match="attack, defense, sft"):
        mode_named("rehardened")


def test_no_stage_task_or_flow_compares_the_mode_by_name():
    """A mode's differences live in its record: a `mode ==` elsewhere is a branch a new mode would have to find."""
    found = []
    for folder in ("storage", "tasks", "flows"):
        for path in (ROOT / folder).glob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"mode\s*(==|!=)|is ATTACKER_LEARNER|is POLICY\b", line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, found


def test_each_record_names_the_adapters_on_its_base_and_those_that_learn():
    from redteam_grpo.core.models.roles import ATTACKER, DEFAULT_ROLE

    def roles(mode: str, *overrides: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        cfg = load_config(None, list(overrides), mode=mode)
        return mode_of(cfg).roles, mode_of(cfg).learning_roles(cfg)

    assert roles("attack") == ((DEFAULT_ROLE,), (DEFAULT_ROLE,))
    assert roles("sft") == ((DEFAULT_ROLE,), (DEFAULT_ROLE,))  # its own update trains the policy
    assert roles("defense") == ((DEFAULT_ROLE, ATTACKER), (DEFAULT_ROLE,))  # the attacker frozen beside it
    self_play = roles("defense", "defense.self_play=true", "defense.prompts_per_goal=2")
    assert self_play == ((DEFAULT_ROLE, ATTACKER), (DEFAULT_ROLE, ATTACKER))


def test_self_play_is_read_by_the_defense_record_alone():
    """Self-play is the defense mode with two learners: a task or flow that reads the setting itself is a branch the
    record no longer decides."""
    found = []
    for folder in ("storage", "tasks", "flows"):
        for path in (ROOT / folder).glob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\w\.defense\.self_play\b", line) and path.name != "modes.py":
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, found


ENGINE = ["sampling.backend=vllm", "sampling.vllm_url=http://127.0.0.1:8100"]


@pytest.mark.parametrize(
    ("mode", "overrides", "why"),
    [
        ("attack", ENGINE, None),
        ("attack", [*ENGINE, "dialogue.turns=3"], None),
        ("defense", [*ENGINE, "defense.self_play=true", "defense.prompts_per_goal=2"], None),
        ("attack", [], "the in-process sampler draws with the trainer's own weights"),
        ("defense", [], "the in-process sampler draws with the trainer's own weights"),
        ("attack", [*ENGINE, "runtime.task_runner=ray"], None),  # the shards drawn ahead run on Ray's workers
        ("sft", [], "it samples nothing"),
    ],
)
def test_one_step_off_policy_where_the_run_can_overlap_and_else_synchronous_with_the_reason(mode, overrides, why):
    cfg = load_config(None, ["training.max_staleness=1", *overrides], mode=mode)
    steps, line = mode_of(cfg).staleness(cfg)
    if why is None:
        assert (steps, line) == (1, None)
    else:
        assert steps == 0 and line.startswith(f"training.max_staleness=1: {mode} runs synchronously: ") and why in line
    synchronous = load_config(None, overrides, mode=mode)
    assert mode_of(synchronous).staleness(synchronous) == (0, None)  # the default asks for nothing else
