"""The docstring examples run, and a module's examples cannot vanish unnoticed: each module below must keep at least
as many examples as it has today."""

from __future__ import annotations

import doctest
import importlib

import pytest

EXAMPLES_AT_LEAST = {
    "redteam_grpo.core.training.advantages": 2,
    "redteam_grpo.core.metrics.redteam": 12,
    "redteam_grpo.core.training.rewards": 7,
    "redteam_grpo.core.seeds": 1,
    "redteam_grpo.core.training.stopping": 2,
    "redteam_grpo.core.training.train": 1,
    "redteam_grpo.tasks.evaluate_defense": 2,
    "redteam_grpo.tasks.harden": 7,
    "redteam_grpo.core.evaluation": 3,
    "redteam_grpo.server.limits": 1,
    "redteam_grpo.core.hosts": 1,
    "redteam_grpo.core.training.staleness": 1,
    "redteam_grpo.server.vllm_client": 1,
    "redteam_grpo.core.config": 1,
    "redteam_grpo.core.rollouts.sampling": 1,
}


@pytest.mark.parametrize(("module_name", "minimum"), sorted(EXAMPLES_AT_LEAST.items()))
def test_docstring_examples_pass_and_are_still_there(module_name, minimum):
    result = doctest.testmod(importlib.import_module(module_name))
    assert result.failed == 0
    assert result.attempted >= minimum, f"{module_name} has {result.attempted} doctest examples, expected {minimum}"
