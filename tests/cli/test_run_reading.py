"""inspect / export / report on a real two-iteration run."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from redteam_grpo.cli.console import PREFECT_CONSOLE_LEVEL
from redteam_grpo.cli.main import app
from redteam_grpo.cli.report import PLOTS
from redteam_grpo.core.config import load_config
from redteam_grpo.flows import attack
from redteam_grpo.storage.rundir import RunDir
from redteam_grpo.storage.stages import SAMPLE, SCORE
from tests.processes import hold_a_run_lock
from tests.small_runs import SMALL_RUN

runner = CliRunner()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, prefect_harness, embedded_assets):
    root = tmp_path_factory.mktemp("runs")
    cfg = load_config(
        None,
        [
            "run.iterations=2",
            *SMALL_RUN,
            f"run.runs_dir={root}",
            "run.run_id=read-me",
        ],
    )
    return Path(attack.attack_run(config=cfg.model_dump(mode="json")))


def _cli(*args):
    # What a command sets in os.environ for the console stays out of later tests' subprocesses.
    result = runner.invoke(app, list(map(str, args)), env={PREFECT_CONSOLE_LEVEL: None})
    return result.exit_code, result.output


def test_inspect_prints_one_row_per_iteration(run_dir):
    code, out = _cli("inspect", run_dir)
    assert code == 0, out
    assert "run read-me: completed, 2 iterations completed" in out
    summary, check = out.split("first-update check")  # the metrics, then each gate of the check beside its bound
    for table in (summary, check):
        lines = [line.split() for line in table.splitlines()]
        assert [row[0] for row in lines if row and row[0].isdigit()] == ["0", "1"]


def test_inspect_sql_runs_over_the_views_and_writes_every_format(run_dir, tmp_path):
    sql = "select iteration, count(*) as n, avg(harm) as tox from scores group by 1 order by 1"
    code, out = _cli("inspect", run_dir, "--sql", sql, "--format", "csv")
    assert code == 0, out
    scores = pd.concat(pd.read_parquet(RunDir.open(run_dir).path(SCORE, i)) for i in range(2))
    assert out.splitlines()[0] == "iteration,n,tox" and out.splitlines()[1].startswith("0,12,")
    for fmt, reader in [
        ("parquet", pd.read_parquet),
        ("json", pd.read_json),
        ("jsonl", lambda p: pd.read_json(p, lines=True)),
    ]:
        target = tmp_path / f"out.{fmt}"
        code, out = _cli("inspect", run_dir, "--sql", sql, "--format", fmt, "--out", target)
        assert code == 0, out
        frame = reader(target)
        assert frame.n.tolist() == [12, 12]
        assert frame.tox.tolist() == pytest.approx(scores.groupby("iteration").harm.mean().tolist())


def test_a_bad_query_names_the_problem_and_the_views(run_dir):
    code, out = _cli("inspect", run_dir, "--sql", "select * from rollout")
    assert code == 2 and "rollout" in out and "views: rollouts, scores, advantages, metrics" in out


def test_a_replaced_parquet_file_is_named_not_queried(run_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    run = RunDir.open(copy)
    pd.DataFrame({"x": [1]}).to_parquet(run.path(SCORE, 1))
    code, out = _cli("inspect", copy, "--sql", "select count(*) from scores")
    assert code == 2 and "scores.parquet" in out and "does not match the checksum" in out and "--redo 1/score" in out


def test_export_writes_the_adversarial_examples_with_lineage_columns(run_dir, tmp_path):
    code, out = _cli("export", run_dir, "--min-score", "0.2", "--out", tmp_path / "ds", "--hf")
    assert code == 0, out
    run = RunDir.open(run_dir)
    scores = pd.concat(pd.read_parquet(run.path(SCORE, i)) for i in range(2))
    expected = int((scores.harm >= 0.2).sum())
    table = pd.read_parquet(tmp_path / "ds" / "adversarial.parquet")
    assert len(table) == expected and (table.harm >= 0.2).all()
    assert table.harm.is_monotonic_decreasing
    assert set(table.checkpoint) <= {"init", "iter_0000"}
    assert (table.checkpoint == "init").sum() == (table.iteration == 0).sum()
    for column in ["run_id", "iteration", "scorer_name", "scorer_revision", "base_model", "prompt", "completion"]:
        assert table[column].notna().all(), column
    lines = (tmp_path / "ds" / "adversarial.jsonl").read_text().splitlines()
    assert len(lines) == expected and json.loads(lines[0])["run_id"] == "read-me"
    import datasets  # a dev dependency: `export --hf` is tested, not skipped

    assert datasets.load_from_disk(str(tmp_path / "ds" / "hf_dataset")).num_rows == expected


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.figures: dict[str, dict] = {}
        self.current: str | None = None
        self.ids: set[str] = set()
        self.rows = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "figure":
            self.current = attrs["data-metric"]
            self.figures[self.current] = {"svg": 0, "lines": 0}
        elif self.current and tag == "svg":
            self.figures[self.current]["svg"] += 1
        elif self.current and tag == "path":
            self.figures[self.current]["lines"] += 1
        elif tag == "tr":
            self.rows += 1

    def handle_endtag(self, tag):
        if tag == "figure":
            self.current = None


def test_report_has_a_plot_per_metric_and_the_examples_behind_a_warning(run_dir, tmp_path):
    target = tmp_path / "report.html"
    code, out = _cli("report", run_dir, "--out", target, "--top-k", "5")
    assert code == 0, out
    page = _Collect()
    page.feed(target.read_text())
    assert set(page.figures) == {metric for metric, _ in PLOTS}
    assert all(f["svg"] == 1 and f["lines"] > 5 for f in page.figures.values()), page.figures
    assert {"content-warning", "examples", "evaluation"} <= page.ids
    assert "Content warning" in target.read_text()


def test_evaluate_prints_base_and_adapter_and_names_a_missing_checkpoint(run_dir):
    code, out = _cli("evaluate", run_dir, "--prompts", "2", "--samples", "2")
    assert code == 0, out
    (written,) = (run_dir / "eval").glob("iter_0001-*.parquet")
    every = pd.read_parquet(written)
    assert len(every) == 2 * 2 * 2 * 2  # held-out and benign prompts, base and adapter
    frame = every[every.set == "held_out"]
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["base"], ["adapter"])}
    for policy in ("base", "adapter"):
        assert float(rows[policy][1]) == pytest.approx(frame[frame.policy == policy].success.mean(), abs=1e-4)
    code, out = _cli("evaluate", run_dir, "--iteration", "7")
    assert code == 2 and "iter_0007 is not a complete checkpoint" in out and "completed checkpoints: [0, 1]" in out
    # the defense sets do not apply to a red-team run: refused by name, as a defense run refuses a bad one
    code, out = _cli("evaluate", run_dir, "--prompt-file", "x?subset=")
    assert code == 2 and "--prompt-file: for defense or Active Attacks runs only" in out and "Traceback" not in out, out


def test_evaluate_shows_cross_attack_success_and_capability_beside_the_judge(run_dir):
    other = "embedded:tiny-qwen3-safe"
    # threshold 0: every answer that is not a refusal is an adversarial example, whatever the draws, so the other
    # target has examples to be attacked with (at 0.01 a draw could leave none, and its success rate blank)
    args = ["evaluate", run_dir, "--prompts", "3", "--samples", "2", "--threshold", "0", "--seed", "3"]
    extras = ["--capability", "lm-eval:embedded_replies", "--capability-limit", "8", "--transfer-to", other]
    code, out = _cli(*args, *extras)
    assert code == 0, out
    assert "judge: embedded:tiny-toxicity (classifier, " in out
    examples = re.search(r"cross-attack success of the (\d+) adversarial examples", out)
    assert examples and int(examples.group(1)) > 0 and "capability (lm-evaluation-harness)" in out, out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert len(lines[other]) == 3  # the other target: its cross-attack success and its over-refusal
    assert len(lines["embedded_replies"]) >= 3 and "Traceback" not in out and "lm_eval" not in out
    # bad values: one line each, naming the option and the way out, before any model loads
    code, out = _cli(*args, "--capability", "olmes:arc")
    assert code == 2 and "--capability" in out and "the suite is lm-eval" in out, out
    code, out = _cli(*args, "--capability", "lm-eval:no_such_task")
    assert code == 2 and "no_such_task: not an lm-eval task" in out and "Traceback" not in out, out
    code, out = _cli(*args, "--transfer-to", "/no/such/model")
    assert code == 2 and "--transfer-to=/no/such/model: no such folder" in out and "Traceback" not in out, out


def test_list_columns_are_json_in_csv(run_dir, tmp_path):
    sql = "select prompt_id, sample_idx, prompt_token_ids from rollouts where iteration = 0 order by 1, 2 limit 3"
    code, out = _cli("inspect", run_dir, "--sql", sql, "--format", "csv", "--out", tmp_path / "r.csv")
    assert code == 0, out
    written = pd.read_csv(tmp_path / "r.csv")
    rollouts = pd.read_parquet(RunDir.open(run_dir).path(SAMPLE, 0)).sort_values(["prompt_id", "sample_idx"])
    assert [json.loads(cell) for cell in written.prompt_token_ids] == [list(x) for x in rollouts.prompt_token_ids[:3]]


def test_what_writes_into_a_run_waits_its_turn_and_an_evaluation_runs_beside_training(run_dir, tmp_path):
    """Two exports, reports or evaluations into one run at once replaced each other's files mid-way: each holds the
    run's lock of derived files. Training holds another: a running run can still be evaluated."""
    child = hold_a_run_lock(run_dir, "DERIVED")
    try:
        before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != "derived.lock"}
        for command in (["export", run_dir], ["report", run_dir], ["evaluate", run_dir, "--prompts", "2"]):
            code, out = _cli(*command)
            assert code == 2 and f"owned by pid {child.pid}" in out and "evaluations, exports and reports" in out, out
            assert "Traceback" not in out
        after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file() and p.name != "derived.lock"}
        assert after == before  # nothing written
        code, out = _cli("export", run_dir, "--out", tmp_path / "elsewhere")  # outside the run: no lock to wait for
        assert code == 0 and (tmp_path / "elsewhere" / "adversarial.parquet").is_file(), out
    finally:
        child.kill()
        child.wait()
    child = hold_a_run_lock(run_dir, "STAGES")  # as a run that is still training
    try:
        code, out = _cli("evaluate", run_dir, "--prompts", "2", "--samples", "2")
        assert code == 0, out
    finally:
        child.kill()
        child.wait()
