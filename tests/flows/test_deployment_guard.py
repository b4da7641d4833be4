"""What a deployment's caller may not ask for (flows/deployment_guard.py, SECURITY.md): whoever can create a flow run
on the Prefect API is not the person who set up the worker. The command line is not checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from redteam_grpo.core.config import ConfigError
from redteam_grpo.flows import deployment_guard
from redteam_grpo.flows.deployment_guard import check_evaluation_request, check_run_request
from tests.small_runs import SMALL_RUN


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["runtime.ray_address=ray://10.0.0.9:10001"], "runtime.ray_address"),
        (["run.runs_dir=/home/someone/elsewhere"], "run.runs_dir"),
        (["sampling.vllm_url=http://collector.example.com:8100"], "sampling.vllm_url"),
        (["reward.url=http://collector.example.com"], "reward.url"),
        (["data.source=s3://their-bucket/prompts.jsonl"], "s3:// URL"),
    ],
)
def test_a_caller_may_not_choose_where_runs_go_what_servers_they_reach_or_a_remote_url(overrides, named):
    with pytest.raises(ConfigError, match=named):
        check_run_request(None, None, overrides, None)
    key = overrides[0].split("=")[0]
    with pytest.raises(ConfigError, match=named):  # nor through a config dict
        check_run_request({key.split(".")[0]: {key.split(".")[1]: overrides[0].split("=", 1)[1]}}, None, None, None)


def test_the_worker_may_allow_a_setting_or_a_url_scheme(monkeypatch, tmp_path):
    monkeypatch.setenv(deployment_guard.ALLOW_ENV, "run.runs_dir")
    monkeypatch.setenv(deployment_guard.SCHEMES_ENV, "s3")
    check_run_request(None, None, [f"run.runs_dir={tmp_path}", "data.source=s3://bucket/prompts.jsonl"], None)
    check_evaluation_request(str(tmp_path / "anywhere" / "run"))  # the caller chooses the runs folder
    with pytest.raises(ConfigError, match=r"runtime\.ray_address"):
        check_run_request(None, None, ["runtime.ray_address=ray://x:1"], None)


@pytest.mark.parametrize("config_path", ["/etc/redteam.yaml", "../other/config.yaml", "configs/x.py"])
def test_a_config_file_outside_the_deployed_folder_is_refused(config_path):
    with pytest.raises(ConfigError, match="deployed folder"):
        check_run_request(None, config_path, None, None)


def test_a_run_of_the_runs_folder_is_resumed_and_one_elsewhere_is_not(tmp_path, monkeypatch):
    from redteam_grpo.core.config import load_config
    from redteam_grpo.storage.rundir import RunDir

    monkeypatch.chdir(tmp_path)
    RunDir.create(load_config(None, ["run.run_id=mine"]))
    check_run_request(None, None, [*SMALL_RUN, "run.iterations=2"], str(tmp_path / "runs" / "mine"))
    # a run of the folder that names a Ray cluster: its replies are unpickled, and the caller may not choose it
    RunDir.create(
        load_config(None, ["run.run_id=clustered", "runtime.task_runner=ray", "runtime.ray_address=ray://x:1"])
    )
    with pytest.raises(ConfigError, match="names the Ray cluster ray://x:1"):
        check_run_request(None, None, None, str(tmp_path / "runs" / "clustered"))
    (tmp_path / "runs" / "link").symlink_to(tmp_path / "other-user", target_is_directory=True)
    outside = (tmp_path / "runs" / "..", tmp_path / "runs" / "link", Path("runs") / "mine" / "..")
    for elsewhere in (tmp_path / "other-user" / "run", tmp_path / "runs" / "a" / "b", *outside):
        with pytest.raises(ConfigError, match="may only resume a run of its runs folder"):
            check_run_request(None, None, None, str(elsewhere))
        with pytest.raises(ConfigError, match="may only evaluate a run of its runs folder"):
            check_evaluation_request(str(elsewhere))
        # the run an Active Attacks evaluation is set against is read: one of the folder's too
        with pytest.raises(ConfigError, match="may only evaluate --against a run of its runs folder"):
            check_evaluation_request("runs/mine", against=str(elsewhere))
    check_evaluation_request("runs/mine", against="runs/clustered")


def test_a_callable_is_not_a_deployment_parameter():
    with pytest.raises(ConfigError, match="on_iteration"):
        check_run_request(None, None, None, None, on_iteration="print")


def test_a_deployment_flow_run_is_refused_before_its_run_folder_exists(prefect_harness, tmp_path, monkeypatch):
    """The check is wired into the run flows: a flow run of a deployment (as Prefect's runtime reports it) asking
    for a Ray cluster of its choice fails before anything is created; the same flow called from the command line
    is not checked."""
    from redteam_grpo.flows.attack import attack_run
    from redteam_grpo.flows.retrain import retrain

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", "00000000-0000-0000-0000-000000000001")
    with pytest.raises(ConfigError, match=r"runtime\.ray_address"):
        attack_run(overrides=[*SMALL_RUN, "runtime.ray_address=ray://10.0.0.9:10001", "run.run_id=x"])
    with pytest.raises(ConfigError, match=r"run\.runs_dir"):
        retrain(lineage="weekly", overrides=[f"run.runs_dir={tmp_path / 'elsewhere'}"])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv("PREFECT__RUNTIME__DEPLOYMENT__ID")
    assert not deployment_guard.from_a_deployment()


@pytest.mark.parametrize("prefect_file", ["prefect.yaml", "deploy/kubernetes/prefect.yaml"])
def test_the_shipped_deployments_own_parameters_pass_the_check(prefect_file):
    import yaml

    from tests.e2e.test_kubernetes_example import ROOT

    for deployment in yaml.safe_load((ROOT / prefect_file).read_text())["deployments"]:
        parameters = deployment.get("parameters") or {}
        if deployment["entrypoint"].endswith(":evaluate"):
            continue
        check_run_request(None, parameters.get("config_path"), parameters.get("overrides"), None)


def test_a_run_resumed_from_the_command_line_leaves_its_stored_ray_cluster_unless_named_again():
    from redteam_grpo.cli.main import _without_a_stored_ray_cluster
    from redteam_grpo.core.config import load_config

    stored = load_config(None, ["runtime.task_runner=ray", "runtime.ray_address=ray://10.0.0.9:10001"])
    assert _without_a_stored_ray_cluster(stored, None) == ["runtime.ray_address=null"]
    named = ["runtime.ray_address=ray://10.0.0.9:10001"]
    assert _without_a_stored_ray_cluster(stored, named) == named
    assert _without_a_stored_ray_cluster(load_config(None, []), ["run.iterations=3"]) == ["run.iterations=3"]


@pytest.mark.parametrize("prefect_file", ["prefect.yaml", "deploy/kubernetes/prefect.yaml"])
def test_every_shipped_deployment_bounds_its_runs_at_once_and_queues_the_rest(prefect_file):
    """A caller of the API could start any number of runs on one worker: every deployment has a limit, and runs
    past it wait (ENQUEUE) instead of being dropped."""
    import yaml

    from tests.e2e.test_kubernetes_example import ROOT

    for deployment in yaml.safe_load((ROOT / prefect_file).read_text())["deployments"]:
        limit = deployment.get("concurrency_limit")
        assert isinstance(limit, dict) and limit.get("collision_strategy") == "ENQUEUE", deployment["name"]
        assert isinstance(limit.get("limit"), int) and 1 <= limit["limit"] <= 8, deployment["name"]
