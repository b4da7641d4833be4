# ruff: noqa: E501  (each entry holds whole lines of code, so that they can be found by text)
"""Put each bug class of docs/bug-classes.md back into the code, one at a time, and check that its tests fail.

    python tests/bug_classes.py                       # all of them, one per CPU core at a time (~13 min on 2)
    python tests/bug_classes.py hidden-top-k mask-    # those whose name contains one of the texts
    python tests/bug_classes.py -j 1                  # one at a time

Each entry: (name, file, the correct code, the bug, the tests that must fail); the name is the heading of the
class in docs/bug-classes.md. One line per entry: "CAUGHT <name>" (the tests failed), "MISSED <name>" (a
guarantee is no longer tested: fix the test, not this list) or "STALE <name>" (the correct code changed: update
the entry). Exit status 1 on any MISSED or STALE.

The bugs are put into copies of the working tree, one copy per job, never into the tree itself: each copy
imports its own code (its `.import/` folder, first on PYTHONPATH, holds the package's folders as links into the
copy, ahead of the editable install that points at the tree), shares the tree's `.venv` and `.vllm`, and is
removed at the end. A copy is checked to import its own code before it is used.

Each class's pytest is a fork of one process that has imported the heavy libraries its tests use (torch,
transformers' model code, peft: about 10 s of each run on 2 cores; 79 classes took 16.2 min with a fresh
`python -m pytest` each, 12.7 min as forks, on a 2-core AMD EPYC):
multiprocessing's fork server, with the tests' process environment (tests/environment.py) set before it starts.
Nothing of the project, its tests or Prefect is imported there (Prefect reads its settings at import, before a
test's conftest has set PREFECT_HOME), so each fork imports the code of its copy, bug included.
"""

import argparse
import atexit
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__:  # imported as tests.bug_classes (tests/test_project.py reads its entries)
    from tests import environment
else:  # run as a script (and so in each fork): its folder is first on sys.path
    import environment

ROOT = Path(__file__).resolve().parents[1]
# Imported once by the fork server (module names: none of the project's, none that read settings at import).
PRELOADED = (
    "torch",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama",
    "peft",
    "safetensors.torch",
    "pandas",
    "pyarrow.parquet",
    "fastapi",
    "httpx",
    "hypothesis",
    "schemathesis",
    "pytest",
)
HARNESS_ERROR = 70  # a fork that failed outside pytest: never read as "its tests failed" (pytest's exit code 1)
NEW_JUDGE_TEST = (
    "tests/core/test_judges_on_real_tokenizers.py::test_each_format_reads_its_score_after_what_its_model_writes_first"
)
BUG_CLASSES = [
    (
        "damaged-checkpoint-trained-on",
        "tasks/resources.py",
        "            checkpoints.read_manifest(folder)  # complete, and every file matches its checksum",
        "            pass",
        "tests/tasks/test_stages.py::test_weights_whose_checkpoint_is_damaged_are_refused_when_loaded",
    ),
    (
        "resume-ignores-damaged-files",
        "flows/runner.py",
        "        run.verify_all()",
        "        pass",
        "tests/flows/test_attack_flow.py::test_a_damaged_checkpoint_is_never_trained_on_and_redo_recomputes_it_bit_for_bit",
    ),
    (
        "mask-off-by-one",
        "core/tokens/masks.py",
        "first_logit = offset + start - 1",
        "first_logit = offset + start",
        "tests/core/test_masks.py",
    ),
    (
        "logits-window-shift",
        "core/tokens/masks.py",
        "first = packed.input_ids_B_T.shape[1] - logits_B_K_V.shape[1]",
        "first = 0",
        "tests/core/test_masks.py::test_logits_of_the_window_alone_gather_what_the_logits_of_every_position_gather "
        "tests/core/test_policy_invariants.py::test_the_trainers_logits_are_those_of_a_forward_over_every_position_though_the_head_sees_the_window_only",
    ),
    (
        "stale-rollouts-trained-on",
        "tasks/train_step.py",
        "check_staleness(own_rows, iteration, max_staleness, learner.rollouts.name, starts_from)",
        "check_staleness([], iteration, max_staleness, learner.rollouts.name, starts_from)",
        "tests/tasks/test_stages.py::test_each_row_records_the_weights_that_drew_it_as_held_and_an_update_trains_on_those_alone",
    ),
    (
        "behaviour-logprobs-replaced",
        "core/training/train.py",
        "old_B_C, forward.sample_B_C, forward.mask_B_C, correction, low, high",
        "old_B_C, old_B_C, forward.mask_B_C, correction, low, high",
        "tests/core/test_train.py::test_a_batch_drawn_one_update_ago_trains_decoupled_against_its_behaviour_logprobs_without_the_check",
    ),
    (
        "resume-draws-with-the-wrong-version",
        "tasks/sample.py",
        "return drawing_version(iteration, steps) if steps else None",
        "return max(res.run.completed_iterations(), default=-1) if steps else None",
        "tests/e2e/test_off_policy.py::test_a_resume_with_iteration_1_sealed_and_no_rollouts_of_2_draws_them_with_the_adapter_after_0",
    ),
    (
        "engine-seed-shared-across-prompts",
        "server/vllm_client.py",
        '{**payload, "prompt": list(prompt_ids[p]), "seed": prompt_seed(seed, p)}',
        '{**payload, "prompt": list(prompt_ids[p]), "seed": seed}',
        "tests/server/test_vllm_client.py::test_every_prompt_of_a_call_draws_from_its_own_random_stream",
    ),
    (
        "rollouts-drawn-by-another-version",
        "tasks/sample.py",
        "res.ensure_version(iteration - 1)",
        "res.ensure_version(max(iteration - 2, -1))",
        "tests/tasks/test_stages.py::test_each_row_records_the_weights_that_drew_it_as_held_and_an_update_trains_on_those_alone",
    ),
    (
        "mask-from-token-values",
        "core/tokens/masks.py",
        "mask[b, c : c + end - start] = True",
        "mask[b, c : c + end - start] = torch.tensor(sequence[start:end], dtype=torch.long) != pad_id",
        "tests/core/test_masks.py",
    ),
    (
        "response-cut-by-non-pad-count",
        "core/rollouts/sampling.py",
        "pieces, reasons = split_generated(sequences, ids.shape[1], policy.end_of_turn_ids)",
        "pieces, reasons = split_generated(sequences, int(mask[0].sum()), policy.end_of_turn_ids)",
        "tests/core/test_policy_invariants.py::test_prompts_of_very_different_lengths_are_sampled_with_left_padding_and_cut_correctly",
    ),
    (
        "sft-turn-closed-with-wrong-token",
        "core/training/sft.py",
        "    end_of_turn = turn_closing_id(policy.tokenizer, policy.end_of_turn_ids)",
        "    end_of_turn = policy.end_of_turn_ids[0]",
        "tests/core/test_sft.py::test_sft_targets_end_with_the_token_the_chat_template_closes_a_turn_with",
    ),
    (
        "update-sees-another-roles-adapter",
        "tasks/train_step.py",
        "    with res.policy.role(learner.role):",
        '    with res.policy.role("default"):',
        "tests/flows/test_self_play.py::test_self_play_updates_both_adapters_each_on_its_own_rollouts",
    ),
    (
        "kl-skipped-for-a-trained-adapter",
        "core/models/policy.py",
        "if torch.count_nonzero(lora_b[active].weight):",
        "if torch.count_nonzero(lora_b[active].weight) and False:",
        "tests/core/test_kl.py::test_at_a_zero_adapter_one_forward_gives_both_sides_as_the_reference_forward_would_and_never_elsewhere",
    ),
    (
        "reference-carries-adapter",
        "core/models/policy.py",
        "with self.model.disable_adapter():",
        "with contextlib.nullcontext():",
        "tests/core/test_policy_invariants.py::test_reference_logprobs_do_not_change_when_the_adapter_trains",
    ),
    (
        "recomputed-old-logprobs",
        "core/training/train.py",
        "sample_B_C = pad_ragged([batch.sample_logprobs[i] for i in mb_rows], ids_B_C.shape[1]).to(policy.device)",
        "sample_B_C = logprobs_B_C.detach()",
        "tests/core/test_policy_invariants.py::test_ratio_moves_away_from_one_after_an_update_on_the_same_batch",
    ),
    (
        "trainer-ignores-temperature",
        "core/training/train.py",
        "logprobs_B_C_V = policy.distribution.logprobs(logits_B_C_V)",
        "logprobs_B_C_V = torch.log_softmax(logits_B_C_V, -1)",
        "tests/core/test_policy_invariants.py::test_first_update_ratio_is_one_and_kl_is_zero",
    ),
    (
        "sampler-keeps-every-steps-vocabulary",
        "core/rollouts/sampling.py",
        "self.model_logits_B_V = None  # each step's logits are used once",
        'self.__dict__.setdefault("kept", []).append(logprobs_B_V)',
        "tests/core/test_sampling_memory.py",
    ),
    (
        "sampler-serves-another-adapter",
        "server/vllm_client.py",
        'if body.get("model") != adapter:',
        'if not body.get("model"):',
        "tests/server/test_vllm_client.py::test_a_response_from_another_adapter_is_refused",
    ),
    (
        "cpu-engine-chunks-seeded-prompts",
        "server/vllm_client.py",
        'command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(2048, max_model_len))]',
        'command += ["--max-num-batched-tokens", str(max(2048, max_model_len))]',
        "tests/server/test_vllm_env.py::test_the_cpu_build_starts_from_its_environment_named_as_a_cpu_without_chunked_prefill tests/e2e/test_vllm_engine.py::test_a_seeded_batch_longer_than_one_prefill_step_is_sampled_and_the_engine_lives_on",
    ),
    (
        "inherited-sig-ign-overridden",
        "storage/interrupts.py",
        "        if signal.getsignal(signum) is not signal.SIG_IGN",
        "        if True",
        "tests/cli/test_signals.py::test_a_stop_signal_the_process_was_started_with_ignored_stays_ignored tests/storage/test_ownership.py::test_a_signal_ignored_stays_ignored_while_recording tests/e2e/test_cli.py::test_a_run_started_with_sigint_ignored_ignores_it_and_completes",
    ),
    (
        "active-attacker-not-restarted",
        "storage/modes.py",
        "    restarts=_after_a_hardening,",
        "    restarts=lambda cfg, role, iteration: False,",
        "tests/flows/test_active.py::test_the_attacker_starts_each_later_round_over_from_its_initial_checkpoint",
    ),
    (
        "restarted-role-trained-as-stale",
        "tasks/train_step.py",
        "        staleness=staleness_of(versions[0], iteration, starts_from) if versions else 0,",
        "        staleness=staleness_of(versions[0], iteration) if versions else 0,",
        "tests/flows/test_active.py::test_the_attacker_starts_each_later_round_over_from_its_initial_checkpoint "
        "tests/core/test_staleness.py::test_a_role_restarted_from_its_initial_checkpoint_trains_on_rows_of_those_weights_alone",
    ),
    (
        "hardened-on-failed-attacks",
        "tasks/harden.py",
        "            if h is not None and h >= threshold and text.strip() and text not in found:",
        "            if h is not None and text.strip() and text not in found:",
        "tests/flows/test_active.py::test_the_victim_is_hardened_at_each_rounds_end_on_the_attacks_found_and_is_unchanged_between",
    ),
    (
        "round-victim-pruned",
        "tasks/checkpoint.py",
        "            if not mode.keeps(cfg, old):",
        "            if True:",
        "tests/flows/test_active.py::test_a_run_resumed_across_a_restart_matches_an_uninterrupted_one",
    ),
    (
        "every-round-evaluated-as-the-final-victim",
        "tasks/evaluate_active.py",
        "            policy.load_adapter(run.checkpoint_dir(checkpoint) / checkpoints.ADAPTER_FILE)",
        "            policy.load_adapter(run.checkpoint_dir(iteration) / checkpoints.ADAPTER_FILE)",
        "tests/flows/test_active.py::test_evaluate_attacks_the_base_and_each_rounds_victim_with_the_final_attacker",
    ),
    (
        "cross-attack-victims-swapped",
        "tasks/evaluate_active.py",
        "harden_victim(policy, found[hardened_on.label], cfg,",
        'harden_victim(policy, found["own" if hardened_on.label == "against" else "against"], cfg,',
        "tests/flows/test_active.py::test_the_cross_attack_table_sets_each_attacker_against_a_victim_hardened_on_the_others_found_attacks",
    ),
    (
        "cross-attack-by-the-runs-own-attacker",
        "tasks/evaluate_active.py",
        "    policy.load_adapter_state(rival.state, ATTACKER)",
        "    pass",
        "tests/flows/test_active.py::test_the_cross_attack_table_sets_each_attacker_against_a_victim_hardened_on_the_others_found_attacks",
    ),
    (
        "evaluation-resumed-from-other-settings",
        "storage/evaluation_parts.py",
        "            if not same:",
        "            if False:",
        "tests/storage/test_evaluation_parts.py::test_parts_of_other_settings_are_discarded_first",
    ),
    (
        "evaluation-resumed-over-edited-prompts",
        "tasks/evaluate.py",
        "            name: digest_of([[p.prompt_id, p.text, p.behavior, p.context] for p in prompts])",
        "            name: digest_of([p.prompt_id for p in prompts])",
        "tests/storage/test_evaluation_parts.py::test_the_settings_see_a_prompt_set_edited_under_the_same_name_and_ignore_what_parts_never_read",
    ),
    (
        "sampler-engine-orphaned-on-stop",
        "cli/serve.py",
        "        os.execvpe(command[0], command, {**os.environ, **env})",
        '        raise typer.Exit(__import__("subprocess").call(command, env={**os.environ, **env}))',
        "tests/e2e/test_vllm_engine.py::test_serve_sampler_stopped_by_a_signal_stops_its_engine_within_seconds",
    ),
    (
        "adapter-name-outlives-its-weights",
        "server/vllm_client.py",
        'return f"{run_id}-v{version}-{digest}"',
        'return f"{run_id}-v{version}"',
        "tests/server/test_vllm_client.py::test_an_adapters_name_is_a_digest_of_its_weights",
    ),
    (
        "sampler-logprobs-in-the-kl",
        "tasks/score.py",
        "        res, DEFAULT_ROLE, iteration, prompt_ids, completion_ids, harm, repetition, novelty, refusal, spans\n    )",
        "        res, DEFAULT_ROLE, iteration, prompt_ids, completion_ids, harm, repetition, novelty, refusal, spans\n    )\n"
        "    terms.kl[:] = [float(sequence_kl(torch.tensor([lp]), torch.tensor([ref]), torch.ones(1, len(lp), dtype=torch.bool))) for lp, ref in zip(scored_rows.logprobs, terms.reference_logprobs, strict=True)]\n"
        "    reward = [composite_reward(RewardTerms(h, rep, k, nov, ref, ent), r.weights) for h, rep, k, nov, ref, ent in zip(harm, repetition, terms.kl, novelty, refusal, terms.entropy, strict=True)]",
        "tests/tasks/test_stages.py::test_every_stage_output_is_read_back_by_the_next_stage",
    ),
    (
        "hidden-top-k",
        "core/rollouts/sampling.py",
        'return torch.full_like(scores, float("-inf")).scatter_(-1, token_B_1, 0.0)',
        "return scores",
        "tests/core/test_policy_invariants.py::test_sampling_settings_of_the_models_generation_config_do_not_reach_the_draw",
    ),
    (
        "repetition-counts-prompt",
        "tasks/score.py",
        "repetition = repetition_ratios(own_ids, r.repetition_ngram)",
        "repetition = repetition_ratios([p + c for p, c in zip(prompt_ids, completion_ids)], r.repetition_ngram)",
        "tests/tasks/test_stages.py::test_repetition_is_measured_on_completion_tokens_only",
    ),
    (
        "nan-reward-poisons-group",
        "core/training/advantages.py",
        "valid = torch.isfinite(rewards)",
        "valid = torch.ones_like(rewards, dtype=torch.bool)",
        "tests/core/test_advantages.py",
    ),
    (
        "no-std-floor",
        "core/training/advantages.py",
        "centered / std_P.clamp(min=std_floor)",
        "centered / std_P.clamp(min=1e-12)",
        "tests/core/test_advantages.py",
    ),
    (
        "judge-score-read-off-its-answer",
        "core/scoring/judge.py",
        "                    at = answer_position(self.tokenizer, new_ids[row].tolist(), self.format.answer_prefix(verdict))",
        "                    at = 0",
        "tests/core/test_judges_on_real_tokenizers.py::test_each_format_reads_its_score_after_what_its_model_writes_first",
    ),
    (
        "judge-score-read-before-its-answer",
        "core/scoring/judge_formats.py",
        '        answer_prefix=lambda generated: "\\n\\n",',
        '        answer_prefix=lambda generated: "",',
        f"{NEW_JUDGE_TEST}[llama-guard-3] {NEW_JUDGE_TEST}[llama-guard-3-1b] tests/embedded/test_embedded_judge.py::test_judge_scores_marker_replies_unsafe_s10_and_clean_ones_safe",
    ),
    (
        "judge-typed-content-dropped",
        "core/scoring/judge_formats.py",
        'LLAMA_GUARD_3_1B = _llama_guard("llama-guard-3-1b", ("meta-llama/llama-guard-3-1b",), _render_typed_chat)',
        'LLAMA_GUARD_3_1B = _llama_guard("llama-guard-3-1b", ("meta-llama/llama-guard-3-1b",), _render_chat)',
        f"{NEW_JUDGE_TEST}[llama-guard-3-1b] tests/core/test_judges_on_real_tokenizers.py::test_the_1b_template_reads_typed_parts_and_the_8b_template_strings",
    ),
    (
        "judge-choices-share-a-token",
        "core/scoring/judge.py",
        "        ids = self.tokenizer.encode(after + word, add_special_tokens=False)",
        "        ids, after = self.tokenizer.encode(word, add_special_tokens=False), ''",
        f"{NEW_JUDGE_TEST}[harmbench] {NEW_JUDGE_TEST}[harmbench-mistral]",
    ),
    (
        "judge-told-the-attack-not-the-goal",
        "tasks/judge.py",
        '    goals = goals_of(res.run, mode_of(cfg).prompts, iteration, rollouts["prompt_id"])',
        "    goals = None",
        "tests/flows/test_defense.py::test_a_defense_iteration_runs_the_attackers_stage_first_on_one_base",
    ),
    (
        "judge-input-bos-missing-or-doubled",
        "core/scoring/judge.py",
        "                add_special_tokens=self.format.tokenizer_adds_special_tokens,  # a template may hold its BOS",
        "                add_special_tokens=False,",
        "tests/core/test_judges_on_real_tokenizers.py::test_each_format_reads_its_score_after_what_its_model_writes_first",
    ),
    (
        "judge-prompt-not-its-reference",
        "core/scoring/judge_formats.py",
        'HARMBENCH_LLAMA2_PROMPT = f"[INST] <<SYS>>\\n{_HARMBENCH_TASK}\\n<</SYS>>\\n\\n{_BEHAVIOR_AND_GENERATION}{_HARMBENCH_RULES}"',
        'HARMBENCH_LLAMA2_PROMPT = f"[INST]<<SYS>>\\n{_HARMBENCH_TASK}\\n<</SYS>>\\n\\n{_BEHAVIOR_AND_GENERATION}{_HARMBENCH_RULES}"',
        "tests/core/test_judge_formats.py::test_each_fixed_prompt_is_its_reference_byte_for_byte",
    ),
    (
        "judge-verdict-fields-misread",
        "core/scoring/judge_formats.py",
        "    request, refusal, harmful = (read[v] if v in options else None for v, options in zip(values, allowed, strict=True))",
        "    refusal, request, harmful = (read[v] if v in options else None for v, options in zip(values, allowed, strict=True))",
        "tests/core/test_judge_formats.py::test_each_documented_verdict_is_read_as_its_format_means_it",
    ),
    (
        "scorer-input-not-truncated",
        "core/scoring/scorers.py",
        "        self.max_length = input_limit(max_length, self.tokenizer, self.model)",
        "        self.max_length = max_length",
        "tests/core/test_scoring_parts.py::test_a_completion_longer_than_the_classifier_is_scored_on_its_beginning_and_flagged tests/server/test_openapi_fuzz.py::test_a_text_longer_than_the_classifier_is_scored_and_flagged_through_the_server tests/tasks/test_stages.py::test_a_completion_longer_than_the_classifier_is_scored_and_counted",
    ),
    (
        "dropout-in-training-forward",
        "core/models/policy.py",
        "    model.eval()\n    policy = _wrap",
        "    model.train()\n    policy = _wrap",
        "tests/core/test_policy_invariants.py::test_lora_dropout_does_not_make_the_first_ratio_noisy",
    ),
    (
        "training-mode-not-refused",
        "core/models/policy.py",
        "        if self.model.training:",
        "        if False:",
        "tests/core/test_policy_invariants.py::test_a_policy_left_in_training_mode_is_refused",
    ),
    (
        "no-trainable-parameters",
        "core/models/policy.py",
        "    if not params or sum(p.numel() for p in params) == 0:",
        "    if False:",
        "tests/core/test_policy_invariants.py::test_check_trainable_refuses_a_policy_whose_adapter_is_frozen",
    ),
    (
        "renamed-column-reads-as-zeros",
        "storage/schemas.py",
        "    if problems:\n        raise SchemaError",
        "    if False:\n        raise SchemaError",
        "tests/storage/test_schemas.py tests/tasks/test_stages.py::test_a_renamed_column_between_stages_is_an_error_not_zeros",
    ),
    (
        "end-of-turn-is-eos-only",
        "core/models/chat.py",
        "        if token in vocab and token in specials:",
        "        if False:",
        "tests/core/test_masks.py::test_end_of_turn_ids_include_the_chat_end_token_when_eos_is_another",
    ),
    (
        "sft-prompt-format-drift",
        "core/models/chat.py",
        "    return prompt_ids + list(response_ids) + [end_of_turn_id], len(prompt_ids)",
        "    plain = tokenizer(prompt + '\\n\\n', add_special_tokens=False)['input_ids']\n    return plain + list(response_ids) + [end_of_turn_id], len(plain)",
        "tests/core/test_policy_invariants.py::test_sft_tokenization_starts_with_exactly_the_rl_prompt_ids",
    ),
    (
        "suppression-not-replayed",
        "core/training/train.py",
        "logprobs_B_C_V = policy.distribution.logprobs(logits_B_C_V)",
        "logprobs_B_C_V = torch.log_softmax(logits_B_C_V.float() / policy.distribution.temperature, -1)",
        "tests/core/test_policy_invariants.py::test_trainer_replays_token_suppression_of_the_sampler",
    ),
    (
        "unreplayed-sampling-settings",
        "core/rollouts/sampling.py",
        "logprobs_B_V = self.distribution.logprobs(self.model_logits_B_V)",
        "logprobs_B_V = self.distribution.logprobs(scores)",
        "tests/core/test_policy_invariants.py::test_sampling_settings_of_the_models_generation_config_do_not_reach_the_draw",
    ),
    (
        "adapter-partly-optimized",
        "core/training/train.py",
        "        policy.trainable_parameters(),\n        lr=",
        "        policy.trainable_parameters()[::2],\n        lr=",
        "tests/core/test_policy_invariants.py::test_every_adapter_parameter_gets_a_gradient_and_nothing_outside_the_adapter_changes",
    ),
    (
        "judgements-of-other-rows",
        "tasks/score.py",
        "    if theirs != ours:",
        "    if len(theirs) != len(ours):",
        "tests/tasks/test_stages.py::test_the_score_stage_refuses_judgements_of_other_rows",
    ),
    (
        "drifted-column-name",
        "tasks/score.py",
        '"repetition_ratio": self.repetition,',
        '"repetition": self.repetition,',
        "tests/tasks/test_stages.py::test_every_stage_output_is_read_back_by_the_next_stage",
    ),
    (
        "trained-ids-differ-from-sampled",
        "core/training/train.py",
        "[[*batch.prompt_ids[i], *batch.completion_ids[i]] for i in mb_rows],",
        "[[*batch.prompt_ids[i][1:], *batch.completion_ids[i]] for i in mb_rows],",
        "tests/core/test_policy_invariants.py::test_training_forward_sees_exactly_the_ids_the_sampler_fed_and_drew",
    ),
    (
        "clip-higher-uses-the-low-epsilon",
        "core/training/loss.py",
        "clipped_B_C = ratio_B_C.clamp(1.0 - epsilon_low, 1.0 + epsilon_high) * adv_B_1",
        "clipped_B_C = ratio_B_C.clamp(1.0 - epsilon_low, 1.0 + epsilon_low) * adv_B_1",
        "tests/core/test_loss.py::test_ppo_clip_with_clip_higher_uses_separate_low_and_high_ranges",
    ),
    (
        "ppo-clip-high-epsilon-not-wired",
        "core/training/train.py",
        "ppo_clip_loss, epsilon_low=cfg.ppo_clip_epsilon_low, epsilon_high=cfg.ppo_clip_epsilon_high",
        "ppo_clip_loss, epsilon_low=cfg.ppo_clip_epsilon_low, epsilon_high=cfg.ppo_clip_epsilon_low",
        "tests/core/test_train.py::test_every_update_has_the_gradient_of_the_configured_loss_and_normalisation",
    ),
    (
        "gspo-ratio-per-token",
        "core/training/loss.py",
        "ratio_B_C = torch.exp(log_ratio_B_1).expand_as(log_ratio_B_C)",
        "ratio_B_C = torch.exp(log_ratio_B_C)",
        "tests/core/test_loss.py::test_gspo_clips_one_ratio_per_sequence_the_geometric_mean_of_its_token_ratios",
    ),
    (
        "constant-normaliser-counts-tokens",
        "core/training/loss.py",
        "return mask / (max(n_sequences, 1) * max_new_tokens)",
        "return mask / max(n_tokens, 1)",
        "tests/core/test_loss.py::test_constant_weights_divide_by_sequences_times_max_new_tokens tests/core/test_train.py::test_every_update_has_the_gradient_of_the_configured_loss_and_normalisation",
    ),
    (
        "micro-batch-normalised-alone",
        "core/training/train.py",
        "forward.mask_B_C, cfg.loss_normalization, n_tokens, n_sequences, batch.max_trained_tokens",
        "forward.mask_B_C, cfg.loss_normalization, int(forward.mask_B_C.sum()), forward.mask_B_C.shape[0], batch.max_trained_tokens",
        "tests/core/test_train.py::test_micro_batches_of_one_give_the_gradient_of_the_whole_batch",
    ),
    (
        "ratio-std-over-n",
        "core/training/loss.py",
        "return math.sqrt(max(squares, 0.0) / max(self.n_tokens - 1, 1))",
        "return math.sqrt(max(squares, 0.0) / self.n_tokens)",
        "tests/core/test_loss.py::test_loss_stats_add_up_exactly_over_micro_batches",
    ),
    (
        "dynamic-sampling-keeps-flat-groups",
        "core/training/train.py",
        "informative[group] = informative.get(group, False) or advantage != 0.0",
        "informative[group] = True",
        "tests/core/test_train.py::test_dynamic_sampling_drops_the_groups_whose_advantages_are_all_zero",
    ),
    (
        "mismatch-weight-unbounded",
        "core/training/loss.py",
        "weights_B_C = torch.exp(log_rho_B_C.clamp(min=log_low, max=log_high))",
        "weights_B_C = torch.exp(log_rho_B_C)",
        "tests/core/test_loss.py::test_mismatch_corrections_on_hand_worked_ratios tests/core/test_train.py::test_truncated_is_with_another_sampler_keeps_the_first_trainer_logprobs_and_caps_the_weight",
    ),
    (
        "mismatch-weight-not-detached",
        "core/training/loss.py",
        "log_rho_B_C = _log_ratio(trainer_logprobs_B_C, sampler_logprobs_B_C, mask_B_C).detach()",
        "log_rho_B_C = _log_ratio(trainer_logprobs_B_C, sampler_logprobs_B_C, mask_B_C)",
        "tests/core/test_loss.py::test_mismatch_corrections_on_hand_worked_ratios",
    ),
    (
        "mismatch-denominator-recomputed",
        "core/training/train.py",
        "old_B_C = trainer_old[k]",
        "old_B_C = forward.logprobs_B_C.detach()",
        "tests/core/test_train.py::test_truncated_is_with_another_sampler_keeps_the_first_trainer_logprobs_and_caps_the_weight",
    ),
    (
        "sequence-mask-per-token",
        "core/training/loss.py",
        "log_rho_B_C = log_rho_B_C.sum(-1, keepdim=True).expand_as(log_rho_B_C)",
        "log_rho_B_C = log_rho_B_C",
        "tests/core/test_loss.py::test_mismatch_corrections_on_hand_worked_ratios tests/core/test_loss.py::test_mismatch_corrections_give_trls_factors_on_random_logprobs",
    ),
    (
        "first-update-check-refuses-rounding-noise",
        "core/training/train.py",
        "failed = [g for g in FIRST_UPDATE_GATES if self.gates[g].items and not self.gates[g].value <= bounds[g]]",
        "failed = [g for g in FIRST_UPDATE_GATES if self.gates[g].items and not self.gates[g].value <= 1e-6]",
        "tests/core/test_first_update_check.py::test_noise_is_a_third_of_each_bound_and_each_misalignment_three_times_it[trained_deep_folder-0.7]",
    ),
    (
        "first-update-check-loosened",
        "core/training/train.py",
        "bounds = diagnostics.bounds(cfg, policy.compute_dtype, batch.sampler, policy.device.type)",
        "bounds = diagnostics.bounds(cfg.model_copy(update={'first_update_kl_tolerance': 0.05}), policy.compute_dtype, batch.sampler, policy.device.type)",
        "tests/core/test_first_update_check.py::test_noise_is_a_third_of_each_bound_and_each_misalignment_three_times_it[trained_deep_folder-1.0]",
    ),
    (
        "non-finite-update-applied",
        "core/training/train.py",
        "            _require_finite_weights(params, update)\n",
        "            pass\n",
        "tests/core/test_train.py::test_an_update_that_would_make_the_weights_non_finite_stops_with_the_way_out",
    ),
    (
        "non-finite-adapter-checkpointed",
        "storage/checkpoints.py",
        "    bad = [name for name, tensor in state.items() if not bool(torch.isfinite(tensor).all())]\n",
        "    bad = []\n",
        "tests/storage/test_atomic_and_checkpoints.py::test_an_adapter_with_non_finite_values_is_never_written_and_the_old_file_stays",
    ),
    (
        "first-update-tolerance-blind-to-depth",
        "core/training/train.py",
        "return layers * varentropy_B_C + KL_BOUND_WIDTH_COEF * hidden_size**2 * second_moment_B_C",
        "return varentropy_B_C + KL_BOUND_WIDTH_COEF * hidden_size**2 * second_moment_B_C",
        "tests/core/test_first_update_check.py::test_the_noise_scale_is_the_depth_times_the_varentropy_plus_the_width_times_the_logits_magnitude_squared tests/core/test_first_update_check.py::test_noise_is_a_third_of_each_bound_and_each_misalignment_three_times_it[trained_deep_folder-0.7]",
    ),
    (
        "first-update-bound-raised-by-the-trainer",
        "core/training/train.py",
        "sampled_with = batch.sampled_with or policy.distribution",
        "sampled_with = policy.distribution",
        "tests/core/test_first_update_check.py::test_the_bound_is_the_samplers_a_trainer_side_temperature_does_not_raise_it",
    ),
    (
        "first-token-error-diluted",
        "core/training/train.py",
        "        first[b, kept[0][0]] = True\n",
        "        pass\n",
        "tests/core/test_first_update_check.py::test_noise_is_a_third_of_each_bound_and_each_misalignment_three_times_it[trained_deep_folder-0.7]",
    ),
    (
        "eos-logprob-error-diluted",
        "core/training/train.py",
        "        last[b, kept[-1][1] - 1] = True\n",
        "        pass\n",
        "tests/core/test_first_update_check.py::test_a_last_logprob_recorded_as_zero_in_long_rows_is_refused_at_the_last_token[trained_deep_folder]",
    ),
    (
        "turn-boundary-error-diluted",
        "core/training/train.py",
        "            boundary[b, s] = boundary[b, e - 1] = True\n",
        "            pass\n",
        "tests/core/test_first_update_check.py::test_a_turn_boundary_error_is_refused_at_the_turn_boundary_gate",
    ),
    (
        "sequence-error-diluted",
        "core/training/train.py",
        "(0.5 * log_ratio_B_C.sum(-1).square())[rows_B], scale_B_C.sum(-1)[rows_B], mask_B_C.sum(-1)[rows_B]",
        "k3_B_C.sum(-1)[rows_B], scale_B_C.sum(-1)[rows_B], mask_B_C.sum(-1)[rows_B]",
        "tests/core/test_first_update_check.py::test_an_error_of_one_sign_at_every_token_is_refused_summed_over_the_row",
    ),
    (
        "other-engine-held-to-the-in-process-bound",
        "core/training/train.py",
        "factor = KL_BOUND_OTHER_ENGINE_FACTOR if other_engine else 1.0",
        "factor = 1.0",
        "tests/e2e/test_vllm_engine.py::test_on_the_engine_noise_is_a_third_of_each_bound_and_each_misalignment_three_times_it[0.7]",
    ),
    (
        "kl-untempered-at-temperature",
        "core/training/kl.py",
        "return token_logprobs(policy.distribution.logprobs(logits_B_C_V), ids_B_C), mask_B_C",
        "return token_logprobs(torch.log_softmax(logits_B_C_V, -1), ids_B_C), mask_B_C",
        "tests/core/test_kl.py::test_kl_estimate_is_unbiased_for_the_kl_between_the_distributions_sampled_at_any_temperature",
    ),
    (
        "concurrent-owners",
        "storage/ownership.py",
        "        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "        pass  # no lock: every process that runs stages owns the run\n",
        "tests/storage/test_ownership.py::test_a_second_owner_is_refused_at_once_naming_the_first_and_the_way_out tests/storage/test_ownership.py::test_a_lock_dies_with_its_process_and_the_next_owner_says_it_took_over",
    ),
    (
        "sharded-stage-reads-one-part",
        "storage/rundir.py",
        "return [self.root / rel for rel in parts] if parts else [self.path(stage, iteration)]",
        "return [self.root / parts[0]] if parts else [self.path(stage, iteration)]",
        "tests/storage/test_rundir.py::test_a_sharded_stage_is_read_as_one_table_of_its_parts_in_shard_order tests/flows/test_scale_out.py::test_shards_have_their_own_seeds_and_whole_groups",
    ),
    (
        "completed-shards-recomputed",
        "tasks/common.py",
        "missing = [k for k in range(runtime.shards) if run.completed_part(stage, iteration, k) is None]",
        "missing = list(range(runtime.shards))",
        "tests/flows/test_scale_out.py::test_a_failed_shard_is_retried_alone_and_a_resume_computes_only_missing_parts",
    ),
    (
        "data-parallel-gradients-not-summed",
        "core/training/train.py",
        "                data_parallel.sum_gradients(params)\n",
        "                pass\n",
        "tests/tasks/test_distributed_update.py::test_torchrun_update_equals_the_single_process_update",
    ),
    (
        "object-store-upload-seen-half-written",
        "storage/atomic.py",
        "            upload(local, remote_tmp)\n            move(remote_tmp, path)\n",
        "            upload(local, path)\n",
        "tests/storage/test_atomic_and_checkpoints.py::test_an_upload_cut_short_leaves_the_old_object_whole_and_no_temporary",
    ),
    (
        "object-store-checksum-cached-by-name",
        "storage/location.py",
        '    return (str(path), info.get("size"), *markers) if markers else ()',
        '    return (str(path), info.get("size"))',
        "tests/flows/test_object_storage.py::test_a_damaged_part_on_object_storage_is_named_with_the_redo_that_recomputes_it",
    ),
    (
        "stage-table-read-from-memory-after-its-file-changed",
        "storage/rundir.py",
        "        if found is not None and found[0] == version_of(path):",
        "        if found is not None:",
        "tests/storage/test_written_tables.py::test_a_file_replaced_by_another_writer_is_read_from_disk_not_from_memory",
    ),
    (
        "object-store-run-owned-twice",
        "storage/ownership.py",
        "previous, fd = _refuse_if_recorded(root, lock), -1",
        "previous, fd = _recorded_owner(root, lock), -1",
        "tests/storage/test_ownership.py::test_on_object_storage_a_record_from_another_host_is_refused_until_removed",
    ),
    (
        "reward-assembled-twice",
        "tasks/attack_score.py",
        "        terms, reward = learner_reward(\n            res, ATTACKER, iteration, prompt_ids, completion_ids, harm, repetition, novelty, refused\n        )",
        "        from redteam_grpo.core.training.rewards import RewardTerms, composite_reward\n"
        "        from redteam_grpo.tasks.score import policy_terms\n"
        "        res.ensure_role(ATTACKER, iteration - 1)\n"
        "        with res.policy.role(ATTACKER):\n"
        "            terms = policy_terms(res.policy, prompt_ids, completion_ids, cfg.training.micro_batch_size)\n"
        "        reward = [composite_reward(RewardTerms(h, rep, k, nov), cfg.reward_weights(ATTACKER)) for h, rep, k, nov in zip(harm, repetition, terms.kl, novelty, strict=True)]",
        "tests/flows/test_self_play.py::test_self_play_updates_both_adapters_each_on_its_own_rollouts",
    ),
    (
        "object-store-owner-record-raced",
        "storage/ownership.py",
        '        with path.open("xb") as handle:',
        '        with path.open("wb") as handle:',
        "tests/storage/test_ownership.py::test_on_object_storage_two_owners_that_both_found_no_record_are_not_both_let_in",
    ),
    (
        "dialogue-retokenised-between-turns",
        "core/rollouts/dialogue.py",
        "        return [*prompt_ids, *completion_ids, *closing, *self.after_assistant]",
        '        return [*prompt_ids, *self.tokenizer(self.tokenizer.decode(self.content(completion_ids)), add_special_tokens=False)["input_ids"], self.closing_id, *self.after_assistant]',
        "tests/core/test_dialogue.py::test_a_turn_is_carried_into_the_next_prompt_as_sampled_where_encoding_its_text_again_would_not",
    ),
    (
        "dialogue-loss-on-other-speakers-turns",
        "core/rollouts/dialogue.py",
        "    spans = [(len(turn.prompt_ids), len(turn.prompt_ids) + len(turn.completion_ids)) for turn in turns]",
        "    spans = [(len(turns[0].prompt_ids), len(sequence))]",
        "tests/core/test_dialogue.py::test_a_speaker_is_trained_on_its_own_turns_and_never_on_the_other_speakers tests/core/test_dialogue.py::test_the_first_update_ratio_is_one_on_every_trained_token_of_a_three_turn_dialogue",
    ),
    (
        "dialogue-judged-on-last-exchange-only",
        "tasks/judge.py",
        '    scored = scoring.score(texts, rollouts["prompt"] if messages is None else [m[:-1] for m in messages], goals)',
        '    scored = scoring.score(texts, rollouts["prompt"] if messages is None else [m[-2]["content"] for m in messages], goals)',
        "tests/flows/test_dialogues.py::test_a_three_turn_defense_iteration_lets_the_attacker_continue_its_first_turn",
    ),
    (
        "dialogue-turn-advantage-on-another-turn",
        "core/training/train.py",
        "float(a) for (start, end), a in zip(spans, self.turn_advantages[i], strict=True) for _ in range(end - start)",
        "float(a) for (start, end), a in zip(spans, self.turn_advantages[i][::-1], strict=True) for _ in range(end - start)",
        "tests/core/test_dialogue.py::test_per_turn_advantages_weigh_each_turns_tokens_by_that_turns_advantage",
    ),
    (
        "dialogue-turn-return-runs-forward",
        "core/training/rewards.py",
        "    for t in reversed(range(len(rewards))):",
        "    for t in range(len(rewards)):",
        "tests/flows/test_dialogues.py::test_per_turn_rewards_train_each_turn_on_its_discounted_return",
    ),
    (
        "evaluation-set-filter-ignored",
        "core/data/sources.py",
        "    for column, values in spec.where:",
        "    for column, values in spec.where[:0]:",
        "tests/core/test_data.py::test_a_source_string_keeps_only_the_rows_its_filters_name",
    ),
]


SHARED = (".venv", ".vllm")  # installed environments: the copies use the tree's own


def package_folders() -> dict[str, str]:
    """`redteam_grpo.<name>` -> its folder in the tree, for the top-level subpackages (pyproject's package-dir)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.split(".")[1]: folder for name, folder in mapping.items() if name.count(".") == 1}


def tree_files() -> list[str]:
    """The tree's files as git sees them: tracked, and untracked but not ignored (an uncommitted change counts)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [f for f in listed.split("\0") if f and (ROOT / f).is_file()]


def make_copy(parent: Path, number: int, files: list[str]) -> Path:
    """A copy of the tree that imports its own code; raises if it would import the tree's."""
    copy = parent / f"tree-{number}"
    for relative in files:
        (copy / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, copy / relative)
    for name in SHARED:
        if (ROOT / name).exists():
            (copy / name).symlink_to(ROOT / name)
    package = copy / ".import" / "redteam_grpo"
    package.mkdir(parents=True)
    for name, folder in package_folders().items():
        (package / name).symlink_to(copy / folder)
    probe = "import redteam_grpo.core as m; print(__import__('pathlib').Path(m.__path__[0]).resolve())"
    seen = subprocess.run([sys.executable, "-c", probe], cwd=copy, env=copy_env(copy), capture_output=True, text=True)
    if seen.returncode != 0 or Path(seen.stdout.strip()) != (copy / "core").resolve():
        raise RuntimeError(f"a copy of the tree in {copy} does not import its own code: {seen.stdout}{seen.stderr}")
    return copy


def copy_env(copy: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(copy / ".import"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _pytest_in_copy(copy: Path, tests: list[str], log: Path) -> None:
    """In a fork of the server: what `python -m pytest ... tests` run in `copy` would do, its output into `log`."""
    try:
        handle = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, 1)
        os.dup2(handle, 2)
        os.close(handle)
        os.chdir(copy)
        os.environ.update(copy_env(copy))  # for the processes its tests start
        # as `python -m` in the copy would have it: the copy, then its .import/, ahead of the editable install
        tree = {"", str(ROOT), str(ROOT / "tests")}
        sys.path[:] = [str(copy), str(copy / ".import"), *(p for p in sys.path if p not in tree)]
        sys.argv = ["pytest", *tests]
        found = importlib.util.find_spec("redteam_grpo.core")
        if found is None or Path(found.submodule_search_locations[0]).resolve() != (copy / "core").resolve():
            raise RuntimeError(f"the fork in {copy} does not import the copy's code: {found}")
        import pytest

        code = int(pytest.main(["-q", "-x", "-p", "no:warnings", "-p", "no:cacheprovider", *tests]))
        atexit._run_exitfuncs()  # what the end of the interpreter would run; a fork ends with os._exit
    except BaseException:  # any failure here is the harness's, reported as one
        traceback.print_exc()
        code = HARNESS_ERROR
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


# An entry's tests that run longer hang (the longest took 86 s in CI): they are stopped and the entry MISSED, so
# that one hang does not hold CI past its limit.
ENTRY_TIMEOUT_SECONDS = 600.0
# Held by a thread that starts a fork or reads one's exit code (run_in_fork says why).
FORK_EXIT_CODES = threading.Lock()


def run_in_fork(target: Callable[..., object], args: tuple, timeout: float | None = None) -> int:
    """`target(*args)` in a child of multiprocessing's fork server; its exit code, -9 (SIGKILL) where it ran past
    `timeout` seconds and was killed. Safe from several threads at once.

    Process.start() polls every live child of this process, other threads' included, and a fork server child's
    exit code is 8 bytes on a pipe: two threads reading it at once leave one an EOF, which multiprocessing
    reports as exit code 255 (a caught class reported MISSED; 45 of 600 forks from 4 threads in a bare script). The
    start and the read are serialised; the wait for the end is not.
    """
    fork = multiprocessing.get_context("forkserver").Process(target=target, args=args)
    with FORK_EXIT_CODES:
        fork.start()
    if not multiprocessing.connection.wait([fork.sentinel], timeout):
        fork.kill()
    with FORK_EXIT_CODES:
        fork.join()
    return fork.exitcode


def check(copy: Path, relative: str, correct: str, bug: str, tests: str) -> tuple[bool, str]:
    """Put the bug into `copy`, run its tests, put the correct code back; (caught, pytest's last line)."""
    path = copy / relative
    source = path.read_text()
    path.write_text(source.replace(correct, bug))
    log = copy.parent / f"{copy.name}.log"
    try:
        exitcode = run_in_fork(_pytest_in_copy, (copy, tests.split(), log), ENTRY_TIMEOUT_SECONDS)
    finally:
        path.write_text(source)
    output = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    summary = (output or ["(no output)"])[-1]
    if exitcode == -signal.SIGKILL:
        # killed here past its time, or by the kernel out of memory: the exit code cannot tell which
        summary = f"killed (past {ENTRY_TIMEOUT_SECONDS:.0f} s or out of memory): " + " | ".join(output[-5:])
    elif exitcode not in (0, 1):
        summary = f"pytest ended with {exitcode}: " + " | ".join(output[-5:])
    return exitcode == 1, summary  # 1: tests ran and failed (not a collection or usage error)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Put each bug class back and check that its tests fail.")
    parser.add_argument("names", nargs="*", help="run the classes whose name contains one of these texts")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="classes checked at once")
    args = parser.parse_args(argv)
    chosen = [entry for entry in BUG_CLASSES if not args.names or any(s in entry[0] for s in args.names)]
    failures = 0
    runnable = []
    for entry in chosen:
        name, relative, correct = entry[:3]
        if (ROOT / relative).read_text().count(correct) != 1:
            print(
                f"STALE {name}: the correct code is no longer found once in {relative}; update this entry", flush=True
            )
            failures += 1
        else:
            runnable.append(entry)
    environment.apply()  # before the fork server starts: it imports what reads these at import
    multiprocessing.set_forkserver_preload(list(PRELOADED))
    started, lock = time.monotonic(), threading.Lock()
    with tempfile.TemporaryDirectory(prefix="redteam-grpo-bug-classes-") as parent:
        files = tree_files()
        copies: queue.Queue[Path] = queue.Queue()
        jobs = max(1, min(args.jobs, len(runnable)))
        for number in range(jobs):
            copies.put(make_copy(Path(parent), number, files))

        def run(entry: tuple[str, str, str, str, str]) -> bool:
            name, relative, correct, bug, tests = entry
            copy, began = copies.get(), time.monotonic()
            try:
                caught, summary = check(copy, relative, correct, bug, tests)
            finally:
                copies.put(copy)
            with lock:
                print(
                    f"{'CAUGHT' if caught else 'MISSED'} {name} ({time.monotonic() - began:.0f} s): {summary}",
                    flush=True,
                )
            return caught

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            caught = list(pool.map(run, runnable))
    failures += caught.count(False)
    print(
        f"bug classes: {caught.count(True)} caught, {caught.count(False)} missed, {len(chosen) - len(runnable)} stale "
        f"of {len(chosen)}, in {(time.monotonic() - started) / 60:.1f} min, {jobs} at a time",
        flush=True,
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
