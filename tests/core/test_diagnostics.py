from dataclasses import asdict

from redteam_grpo.core.rollouts.diagnostics import health_warnings, rollout_stats

EOT, HEADER = 2, 1


def test_rollout_stats_count_ends_truncation_and_header_leaks():
    completions = [[5, 6, EOT], [5, EOT, 7, EOT], [HEADER, 5], [5, 5, 5, 5]]
    reasons = ["stop", "stop", "length", "length"]
    d = asdict(rollout_stats(completions, reasons, [EOT], [HEADER]))
    assert d["length_mean"] == 3.25 and d["length_min"] == 2 and d["length_max"] == 4
    assert d["truncated_fraction"] == 0.5
    assert d["eos_per_response_max"] == 2 and d["multi_eos_responses"] == 1
    assert d["header_violations"] == 1


def test_health_warnings_name_the_cause():
    healthy = {"entropy": 1.2, "length_mean": 15.0, "multi_eos_responses": 0, "header_violations": 0}
    assert health_warnings(healthy, 3) == []
    sick = {
        "entropy": 0.01,
        "length_mean": 1.5,
        "multi_eos_responses": 2,
        "header_violations": 1,
        "last_ratio_std": 0.0,
        "n_invalid_rewards": 3,
    }
    text = "\n".join(health_warnings(sick, 7))
    for cause in (
        "entropy is 0.010",
        "collapsed",
        "more than one end-of-turn",
        "chat-header tokens",
        "did not move after the first update",
        "3 completions had no valid reward",
    ):
        assert cause in text
    assert text.startswith("iteration 7:")
