"""The Kubernetes example (deploy/kubernetes): every job variable a deployment sets is a variable of the pool's job
template, and every template variable reaches the job manifest (Prefect drops one that is declared but not
referenced, silently); the deployments' overrides are valid config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from redteam_grpo.core.config import load_config

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "deploy" / "kubernetes"


def _referenced(node) -> set[str]:
    text = json.dumps(node)
    return set(re.findall(r"\{\{\s*([a-z_]+)\s*\}\}", text))


def test_the_gpu_job_template_asks_for_gpus_and_mounts_runs_and_model_caches_apart_as_an_unprivileged_user():
    template = json.loads((FOLDER / "gpu-job-template.json").read_text())
    declared = set(template["variables"]["properties"])
    referenced = _referenced(template["job_configuration"])
    assert declared == referenced
    assert {"gpu", "runs_claim", "cache_claim"} <= referenced
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu }}"
    assert container["volumeMounts"] == [
        {"name": "runs", "mountPath": "/app/runs"},
        {"name": "model-cache", "mountPath": "/cache"},
    ]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    assert claims == {"runs": "{{ runs_claim }}", "model-cache": "{{ cache_claim }}"}
    # the Dockerfile's user; no root, no way back to it
    security = container["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] == _image_user()
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["fsGroup"] == _image_user()


def _image_user() -> int:
    (user,) = re.findall(r"^USER (\d+)", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)
    return int(user)


def test_no_model_cache_is_on_the_runs_volume():
    """Whoever may write runs must not be able to replace the models every later job loads."""
    for deployment in yaml.safe_load((FOLDER / "prefect.yaml").read_text())["deployments"]:
        home = deployment["work_pool"]["job_variables"]["env"]["HF_HOME"]
        assert home.startswith("/cache/"), (deployment["name"], home)


def test_the_deployments_set_only_template_variables_and_valid_overrides():
    template = json.loads((FOLDER / "gpu-job-template.json").read_text())
    declared = set(template["variables"]["properties"])
    deployments = yaml.safe_load((FOLDER / "prefect.yaml").read_text())["deployments"]
    assert deployments
    for deployment in deployments:
        assert set(deployment["work_pool"]["job_variables"]) <= declared, deployment["name"]
        assert (ROOT / deployment["entrypoint"].split(":")[0]).is_file()
        params = deployment["parameters"]
        cfg = load_config(ROOT / params["config_path"], params["overrides"])
        assert cfg.runtime.gpu_slot == "gpu"
        if cfg.training.launcher == "torchrun":
            assert deployment["work_pool"]["job_variables"]["gpu"] == cfg.training.nproc  # a process per GPU
