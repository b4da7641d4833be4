"""Replay what SECURITY.md promises against untrusted input, and print each case and its outcome.

    python bench/security_probe.py

Each case builds its input in a temporary folder (bad run ids and names, crafted manifests, planted symlinks, a
config that grants model code, the reward server's exposure rules and requests without or with a token), runs the
project's own code on it, and prints `held` when the input was refused or left nothing behind, `BROKEN` otherwise.
Exit status 1 if any case is BROKEN. Needs no model, network or Prefect server (about 10 s).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _refused(action: Callable[[], object], *errors: type[BaseException]) -> tuple[bool, str]:
    try:
        action()
    except errors as exc:
        return True, f"refused: {str(exc).splitlines()[0][:110]}"
    return False, "accepted"


def run_folder_cases(tmp: Path) -> list[tuple[str, bool, str]]:
    from redteam_grpo.core.config import ConfigError, load_config
    from redteam_grpo.storage import atomic, checkpoints, ownership
    from redteam_grpo.storage.rundir import OWNER_FILE, RunDir, RunDirError

    runs = tmp / "runs"
    cases = []
    for setting in ("run.run_id=../../escaped", "run.run_id=/tmp/elsewhere", "run.name=../up"):
        held, outcome = _refused(lambda s=setting: load_config(None, [f"run.runs_dir={runs}", s]), ConfigError)
        cases.append((f"config {setting}", held, outcome))
    held, outcome = _refused(lambda: load_config(None, ["model.trust_remote_code=true"]), ConfigError)
    cases.append(("config model.trust_remote_code=true", held, outcome))

    run = RunDir.create(load_config(None, [f"run.runs_dir={runs}", "run.run_id=probe"]))
    pristine = run.manifest_path.read_text()
    for label, change in [
        ("a file ../../etc/passwd", lambda m: m["stages"].update({"0000/sample": {"files": {"../../etc/passwd": ""}}})),
        ("a part /etc/passwd", lambda m: m["stages"].update({"0000/sample": {"files": {}, "parts": ["/etc/passwd"]}})),
        ("parent_run ../other", lambda m: m.update({"parent_run": "../other"})),
    ]:
        manifest = json.loads(pristine)
        change(manifest)
        run.manifest_path.write_text(json.dumps(manifest))
        held, outcome = _refused(run.manifest, RunDirError)
        cases.append((f"run manifest naming {label}", held, outcome))
    run.manifest_path.write_text(pristine)

    folder = tmp / "checkpoint"
    folder.mkdir()
    checkpoints.write_manifest(folder, {"iteration": 0})
    manifest = json.loads((folder / checkpoints.MANIFEST_FILE).read_text())
    manifest["files"]["../../etc/hostname"] = "0" * 64
    (folder / checkpoints.MANIFEST_FILE).write_text(json.dumps(manifest))
    held, outcome = _refused(lambda: checkpoints.read_manifest(folder), checkpoints.CheckpointError)
    cases.append(("checkpoint manifest naming ../../etc/hostname", held, outcome))

    victim = tmp / "victim.txt"
    victim.write_text("keep me")
    target = run.root / "notes.json"
    (run.root / f"{atomic.TMP_PREFIX}{os.getpid()}-{target.name}").symlink_to(victim)
    atomic.write_json_atomic(target, {"written": True})
    held = victim.read_text() == "keep me"
    cases.append(("symlink planted at a temporary name", held, "target untouched" if held else "target overwritten"))

    (run.root / OWNER_FILE).unlink(missing_ok=True)
    (run.root / OWNER_FILE).symlink_to(victim)
    held, outcome = _refused(lambda: ownership.acquire(run.root), RunDirError)
    held = held and victim.read_text() == "keep me"
    cases.append(("owner.lock planted as a symlink", held, outcome))

    import pandas as pd

    from redteam_grpo.storage.export import write_hf_dataset

    taken = tmp / "taken"
    taken.mkdir()
    out = tmp / "exported" / "hf_dataset"
    out.parent.mkdir()
    (out.parent / f"{atomic.TMP_PREFIX}{os.getpid()}-{out.name}").symlink_to(taken, target_is_directory=True)
    try:
        write_hf_dataset(pd.DataFrame({"prompt": ["a"]}), out)
        held = not any(taken.iterdir())
        cases.append(("symlink planted at an export's folder", held, "target untouched" if held else "dataset in it"))
    except Exception as exc:  # `datasets` not installed: nothing written anywhere
        cases.append(("symlink planted at an export's folder", not any(taken.iterdir()), f"refused: {exc}"[:110]))

    # two processes that both found no owner record on object storage (the check, then the write)
    remote = RunDir.create(load_config(None, [f"run.runs_dir=memory://probe-{os.getpid()}/runs", "run.run_id=raced"]))
    checked, ownership._refuse_if_recorded = ownership._refuse_if_recorded, lambda root, lock: None
    try:
        first = ownership.acquire(remote.root)
        held, outcome = _refused(lambda: ownership.acquire(remote.root), RunDirError)
        first.release()
    finally:
        ownership._refuse_if_recorded = checked
    cases.append(("two owners racing on object storage", held, outcome))

    from redteam_grpo.cli.main import _refuse_stored_servers_beyond_loopback

    stored = load_config(None, ["reward.url=http://10.0.0.9:50050"])
    held, outcome = _refused(lambda: _refuse_stored_servers_beyond_loopback(stored, []), RunDirError)
    cases.append(("resume of a run naming a remote reward server", held, outcome))
    return cases


def server_cases() -> list[tuple[str, bool, str]]:
    """The reward server's exposure rule (shared with the vLLM sampler) and its answers to callers without a token."""
    from fastapi.testclient import TestClient
    from pydantic import SecretStr

    from redteam_grpo.server.app import create_app
    from redteam_grpo.server.settings import REWARD_TOKEN_ENV, SAMPLER_TOKEN_ENV, ServerSettings, check_exposure

    cases = []
    for label, token in [("no token", None), ("an empty token", ""), ("a 15-character token", "x" * 15)]:
        for variable in (REWARD_TOKEN_ENV, SAMPLER_TOKEN_ENV):
            held, outcome = _refused(lambda t=token, v=variable: check_exposure("0.0.0.0", t, v), ValueError)
            cases.append((f"bind 0.0.0.0 with {label} ({variable})", held, outcome))

    def never_loaded():
        raise RuntimeError("no model in the probe")

    token = "a-token-of-32-characters-for-the-probe"
    with TestClient(create_app(ServerSettings(token=SecretStr(token)), never_loaded), base_url="http://localhost") as c:
        answer = c.post("/score", json={"texts": ["hi"]})
        cases.append(("POST /score without the token", answer.status_code == 401, f"HTTP {answer.status_code}"))
        answer = c.post("/score", json={"texts": ["hi"]}, headers={"Authorization": "Bearer wrong"})
        cases.append(("POST /score with a wrong token", answer.status_code == 401, f"HTTP {answer.status_code}"))
        answer = c.get("/ready")
        hidden = "error" not in answer.text and "never_loaded" not in answer.text and "no model" not in answer.text
        cases.append(("GET /ready without the token", hidden, f"HTTP {answer.status_code} {answer.text[:60]}"))
        answer = c.get("/health", headers={"Host": "rebound.example.com"})
        rebound = answer.status_code == 421
        cases.append(("a request for another Host on loopback", rebound, f"HTTP {answer.status_code}"))
    return cases


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="redteam-grpo-probe-") as folder:
        os.environ.setdefault("REDTEAM_GRPO_CACHE", str(Path(folder) / "cache"))
        cases = run_folder_cases(Path(folder)) + server_cases()
    table = Table(title="security probe: untrusted input and its outcome")
    for column in ("case", "", "outcome"):
        table.add_column(column)
    for case, held, outcome in cases:
        table.add_row(case, "held" if held else "[red]BROKEN[/red]", outcome)
    Console(width=150).print(table)
    broken = sum(not held for _, held, _ in cases)
    print(f"{len(cases) - broken} of {len(cases)} held")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
