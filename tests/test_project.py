"""The README's promises that a fresh machine depends on."""

import os
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command():
    readme_lines = (ROOT / "README.md").read_text().splitlines()
    block = readme_lines[readme_lines.index("```bash") + 1 : readme_lines.index("```bash") + 3]
    assert len(block) == 2 and block[0].endswith("redteam-grpo run")
    assert block[1].endswith(".venv/bin/pytest -n auto && .venv/bin/python tests/bug_classes.py")
    # .ci/run runs the command as timed phases (`phase NAME 'COMMAND'`): joined with &&, they are the command.
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    phases = [shlex.split(line) for line in ci_lines if line.startswith("phase ")]
    assert all(len(p) == 3 for p in phases) and len(phases) >= 2
    assert " && ".join(command for _, _, command in phases) == block[1]


def test_the_network_guard_refuses_and_records_non_loopback_connections():
    import socket

    import pytest

    from tests import netguard

    before = len(netguard.attempted_connections)
    with pytest.raises(netguard.NetworkAccessError):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    with pytest.raises(netguard.NetworkAccessError):
        socket.socket().connect(("8.8.8.8", 53))
    assert len(netguard.attempted_connections) == before + 2
    del netguard.attempted_connections[before:]  # the e2e tests assert this list stays empty


ALLOWED_IMPORTS = {  # package -> the project packages (or modules) it may import
    "embedded": {"embedded"},
    "core": {"core", "embedded"},
    "storage": {"storage", "core"},
    "server": {"server", "core"},
    "tasks": {"tasks", "storage", "core", "server.client", "server.vllm_client"},
    "flows": {"flows", "tasks", "storage", "core"},
    "cli": {"cli", "flows", "tasks", "server", "storage", "core"},
}


def _project_imports(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_dependencies_point_one_way_and_prefect_stays_in_flows_and_tasks():
    root = Path(__file__).resolve().parents[1]
    problems = []
    for package, allowed in ALLOWED_IMPORTS.items():
        for path in sorted((root / package).rglob("*.py")):
            for name in _project_imports(path):
                if name.split(".")[0] == "prefect" and package not in ("flows", "tasks"):
                    problems.append(f"{path.relative_to(root)} imports {name}")
                if not name.startswith("redteam_grpo."):
                    continue
                target = name.removeprefix("redteam_grpo.")
                if not any(target == a or target.startswith(a + ".") for a in allowed):
                    problems.append(f"{path.relative_to(root)} imports {name}")
    assert not problems, "imports against the layering of ARCHITECTURE.md:\n" + "\n".join(problems)


def _core_subfolder_imports() -> dict[str, set[str]]:
    """core/'s subfolders and the other subfolders each imports, anywhere in its files (in functions too)."""
    graph: dict[str, set[str]] = {}
    for folder in sorted(p for p in (ROOT / "core").iterdir() if (p / "__init__.py").is_file()):
        graph[folder.name] = set()
        for path in folder.rglob("*.py"):
            for name in _project_imports(path):
                parts = name.split(".")
                if parts[:2] == ["redteam_grpo", "core"] and len(parts) > 2 and (ROOT / "core" / parts[2]).is_dir():
                    graph[folder.name].add(parts[2])
        graph[folder.name].discard(folder.name)
    return graph


def test_core_subfolders_import_each_other_without_a_cycle():
    """The subfolders are layers (tokens, then models, then rollouts, scoring and training): a cycle would make
    every one of them need the others to be read, tested or imported first."""
    from graphlib import CycleError, TopologicalSorter

    graph = _core_subfolder_imports()
    assert graph["tokens"] == set(), "tokens/ is the bottom layer: it imports no other subfolder"
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as cycle:
        raise AssertionError(f"core/ subfolders import each other in a cycle: {' -> '.join(cycle.args[1])}") from None
    assert order.index("models") < order.index("rollouts") < order.index("training")


def test_k3_is_computed_in_one_place():
    """k3 = exp(r) - 1 - r (Schulman 2020) is written once, in core/training/kl.py: the KL term of the reward, the
    update's KL(old || new) statistic and the first update's gates all call it, so they cannot drift apart. Found
    elsewhere: exp(r) or expm1(r), or a name bound to one in the same function, minus something."""
    import ast

    def exponential(node) -> bool:
        called = node.func if isinstance(node, ast.Call) else None
        return called is not None and (getattr(called, "attr", None) or getattr(called, "id", None)) in ("exp", "expm1")

    found = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            bound = {
                target.id
                for node in ast.walk(function)
                if isinstance(node, ast.Assign) and exponential(node.value)
                for target in node.targets
                if isinstance(target, ast.Name)
            }
            for node in ast.walk(function):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub):
                    left = node.left
                    if exponential(left) or (isinstance(left, ast.Name) and left.id in bound):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found and all(f.startswith("core/training/kl.py:") for f in found), sorted(set(found))


def test_core_imports_from_the_embedded_package_only_the_resolution_of_embedded_model_names():
    import ast

    root = Path(__file__).resolve().parents[1]
    allowed = {"redteam_grpo.embedded.is_embedded", "redteam_grpo.embedded.resolve_model_path"}
    problems = []
    for path in sorted((root / "core").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            bad = [n for n in names if n.startswith("redteam_grpo.embedded") and n not in allowed]
            problems += [f"{path.relative_to(root)} imports {n}" for n in bad]
    assert not problems, f"core may import only {sorted(allowed)} of the embedded package:\n" + "\n".join(problems)


def test_the_bug_class_catalogue_and_the_harness_name_the_same_classes_and_tests():
    import re

    from tests.bug_classes import BUG_CLASSES

    text = (ROOT / "docs" / "bug-classes.md").read_text()
    # Every `###` heading is a class; the text up to the next heading is its entry.
    parts = re.split(r"^(#{1,3}) (.+?)\s*$", text, flags=re.MULTILINE)
    headings = [(level, title, body) for level, title, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True)]
    sections = {title: body for level, title, body in headings if level == "###"}
    names = [name for name, *_ in BUG_CLASSES]
    assert len(set(names)) == len(names), "a class name is used twice in tests/bug_classes.py"
    assert len(sections) == sum(level == "###" for level, _, _ in headings), "a heading is used twice"
    assert [n for n in names if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", n)] == [], "names are kebab-case"
    assert sorted(set(names) - set(sections)) == [], "harness entries without a section in docs/bug-classes.md"
    assert sorted(set(sections) - set(names)) == [], "sections of docs/bug-classes.md without a harness entry"
    unnamed = [
        f"{name}: {test}"
        for name, _, _, _, tests in BUG_CLASSES
        for test in tests.split()
        if name in sections and f"`{test}`" not in sections[name]
    ]
    assert unnamed == [], "tests the harness runs for a class that its section does not name"


def test_the_bug_class_harness_reads_a_forks_exit_code_alone_while_another_thread_starts_a_fork(monkeypatch):
    """A fork's exit code read as 255 reports a caught class MISSED (a CI run was refused for it).

    multiprocessing's Process.start() polls every live child of the process, other threads' too, and a fork
    server child's exit code is 8 bytes on a pipe: two threads reading them at once leave one an EOF, read as
    255. Left to chance that meeting is rare (1 or 2 of 400 forks from 4 threads here); this test arranges it:
    the first fork's own read of its exit code waits for a second reader, which another thread's start() would
    be, and lets that one read first.
    """
    import multiprocessing.forkserver
    import sys
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tests.bug_classes import run_in_fork

    read_signed = multiprocessing.forkserver.read_signed
    first_thread, first_sentinel = threading.get_ident(), []
    first_reading, other_has_read = threading.Event(), threading.Event()
    two_readers = threading.Barrier(2, timeout=1.0)

    def read_signed_meeting(fd: int) -> int:
        caller = sys._getframe(1).f_code.co_name  # "_launch" reads the child's pid, "poll" its exit code
        if caller != "poll" or first_sentinel != [fd]:
            if caller == "_launch" and threading.get_ident() == first_thread:
                first_sentinel.append(fd)
            return read_signed(fd)
        if threading.get_ident() == first_thread:  # the first fork's own read of its exit code
            first_reading.set()
            try:
                two_readers.wait()
            except threading.BrokenBarrierError:  # no other reader came: the harness's way
                return read_signed(fd)
            else:
                other_has_read.wait(timeout=5)
                time.sleep(0.05)  # the other reader's poll stores what it read before this one reads the EOF
                return read_signed(fd)
            finally:
                first_sentinel.clear()  # its number may be the next fork's
        two_readers.wait()
        try:
            return read_signed(fd)
        finally:
            other_has_read.set()

    monkeypatch.setattr(multiprocessing.forkserver, "read_signed", read_signed_meeting)

    def second_fork() -> int:
        assert first_reading.wait(timeout=60), "the first fork never ended"
        return run_in_fork(sys.exit, (8,))

    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(second_fork)
        first = run_in_fork(sys.exit, (7,))
        assert (first, second.result()) == (7, 8)


def test_the_bug_class_harness_stops_a_fork_that_runs_past_its_time():
    import signal
    import time

    from tests.bug_classes import run_in_fork

    began = time.monotonic()
    assert run_in_fork(time.sleep, (120,), timeout=1.0) == -signal.SIGKILL
    assert time.monotonic() - began < 60  # not the 120 s it would sleep


def test_each_test_process_has_a_prefect_home_of_its_own(session_tmp):
    # under `pytest -n`, a worker's home, inherited from the process that started it, would be that process's
    assert Path(os.environ["PREFECT_HOME"]) == session_tmp / "prefect"


def test_every_shipped_config_is_valid_for_its_mode():
    import yaml

    from redteam_grpo.core.config import load_config

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        mode = (yaml.safe_load(path.read_text()).get("run") or {}).get("mode", "attack")
        assert load_config(path, mode=mode).run.mode == mode, path
