"""The README's promises that a fresh machine depends on."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_exactly_the_readme_test_command():
    readme_lines = (ROOT / "README.md").read_text().splitlines()
    block = readme_lines[readme_lines.index("```bash") + 1 : readme_lines.index("```bash") + 3]
    assert len(block) == 2 and block[0].endswith("redteam-grpo run") and block[1].endswith("pytest")
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert block[1] in ci_lines
