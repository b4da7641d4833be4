"""The CLI of the three modes: each command's defaults, and what is refused before any work starts."""

from __future__ import annotations

import typing

import yaml
from typer.testing import CliRunner

from redteam_grpo.cli.main import app
from redteam_grpo.core.config import ATTACKER_SYSTEM_PROMPT, load_config
from redteam_grpo.embedded.defense import defense_corpus

runner = CliRunner()


def test_config_show_prints_each_modes_defaults():
    shown = {
        mode: yaml.safe_load(runner.invoke(app, ["config", "show", "--mode", mode]).stdout)
        for mode in ("sft", "defense")
    }
    assert shown["defense"]["run"]["mode"] == "defense"
    assert shown["defense"]["reward"]["scorer"] == "embedded:tiny-guard"
    assert shown["defense"]["reward"]["safety_weight"] == 1.0 and shown["defense"]["reward"]["harm_weight"] == 0.0
    assert shown["sft"]["model"]["system_prompt"] == ATTACKER_SYSTEM_PROMPT
    assert shown["sft"]["data"]["source"] == "bundled:attack_pairs.jsonl"


def test_the_embedded_attacker_prompt_is_the_configs():
    # The toy world's tokenizer learns the attacker's system prompt; a drift would only cost merges, but say so.
    assert defense_corpus()["attacker_system_prompt"] == ATTACKER_SYSTEM_PROMPT


def test_a_flow_refuses_a_config_of_another_mode(tmp_path):
    from redteam_grpo.core.config import ConfigError
    from redteam_grpo.flows.runner import requested_config
    from redteam_grpo.storage.modes import DEFENSE_MODE

    cfg = load_config(None, [f"run.runs_dir={tmp_path}"], mode="sft")
    try:
        requested_config(cfg.model_dump(mode="json"), None, None, None, DEFENSE_MODE)
    except ConfigError as exc:
        assert "redteam-grpo sft" in str(exc)
    else:
        raise AssertionError("a sft config was accepted by the defense flow")


def test_push_to_hub_is_refused_on_an_offline_run_before_anything_runs(tmp_path):
    result = runner.invoke(app, ["defense", "--set", f"run.runs_dir={tmp_path}", "--push-to-hub", "org/defender"])
    assert result.exit_code == 2
    assert "--push-to-hub needs the network" in result.output
    assert not any(tmp_path.iterdir())


def test_evaluating_an_sft_run_says_where_its_measure_is(tmp_path):
    import json

    from redteam_grpo.core.evaluation import EvaluationOptions
    from redteam_grpo.storage.rundir import RunDir
    from redteam_grpo.tasks.evaluate import EvaluationError, evaluate_checkpoint

    cfg = load_config(None, [f"run.runs_dir={tmp_path}", "run.run_id=attacker"], mode="sft")
    run = RunDir.create(cfg)
    assert json.loads(run.config_path.read_text())["run"]["mode"] == "sft"
    try:
        evaluate_checkpoint.fn(str(run.root), EvaluationOptions(num_prompts=2, samples_per_prompt=2))
    except EvaluationError as exc:
        assert "SFT run" in str(exc) and "sft_metrics.parquet" in str(exc)
    else:
        raise AssertionError("an SFT run was evaluated as a red-team run")


def test_every_evaluation_a_mode_names_is_run_by_the_flow_and_printed_by_the_cli():
    from redteam_grpo.cli.runs import PRINTERS
    from redteam_grpo.flows.evaluate import EVALUATIONS
    from redteam_grpo.storage.modes import MODES

    named = {mode.evaluation for mode in MODES.values() if mode.evaluation is not None}
    assert named == set(EVALUATIONS)
    for name, evaluation in EVALUATIONS.items():  # each returns its typed result, which the CLI has a printer for
        result = typing.get_type_hints(evaluation.fn)["return"]
        assert result in PRINTERS and result.model_fields["evaluation"].default == name, (name, result)
    assert len(PRINTERS) == len(named)
