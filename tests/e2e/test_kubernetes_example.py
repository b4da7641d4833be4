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


def test_the_gpu_job_template_asks_for_gpus_and_mounts_the_runs_volume():
    template = json.loads((FOLDER / "gpu-job-template.json").read_text())
    declared = set(template["variables"]["properties"])
    referenced = _referenced(template["job_configuration"])
    assert declared == referenced
    assert {"gpu", "runs_claim"} <= referenced
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu }}"
    assert container["volumeMounts"] == [{"name": "runs", "mountPath": "/app/runs"}]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "{{ runs_claim }}"


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
