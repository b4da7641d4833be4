"""Active Attacks on the embedded world, per seed: does each hardening make the victim safer against the attacks it was
hardened on, does the restarted attacker find attacks again, and what does hardening cost?

    python bench/active_attacks.py [--seeds 0 1 2] [--iterations 8] [--harden-every 4] [--set KEY=VALUE ...]

Each seed is one `active_run` (embedded defaults, smaller batches unless --set says otherwise) in a fresh folder,
then, for each hardening at iteration h:

  before / after   the victim of checkpoint h - 1 (which answered iteration h) and of checkpoint h (hardened) each
                   answer the attacks found so far (`tasks/harden.py: found_attacks`) with the same seed and G
                   samples; the embedded judge scores every answer: the mean P(unsafe) and the share of attacks whose
                   mean reaches the threshold (attack success) and the share of answers that are refusals, before
                   and after;
  next round       the attacks the restarted attacker finds in the round after h against the hardened victim (harm at
                   or above the threshold, from attack_scores), beside those of the round before.

And the run's hardening overhead: the harden stage's seconds (its rows) over the run's wall time (target <= 10 %).

Then the mode's evaluation (`redteam-grpo evaluate RUN --against RIVAL`, tasks/evaluate_active.py) of each seed's run:
its final attacker's prompts for 16 held-out goals x 4 against the base and each round's victim (attack success,
distinct successful attacks, 1 - SelfBLEU of them, over-refusal on the bundled benign prompts), and the cross-attack
table against a self-play defense run of the same seed, size and length (the rival).

Prints one table per seed and a summary line; exit status 0 whatever the figures (they are measurements).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

SMALL = [
    "logging.progress=false",
    "logging.artifacts=false",
    "data.prompts_per_iteration=4",
    "sampling.group_size=4",
    "active.prompts_per_goal=4",
    "run.keep_checkpoints=null",  # each hardening's victim before and after is read back
]


def victim_success(res, adapter_file: Path, attacks: list[tuple[str, str]], samples: int, seed: int, threshold: float):
    """Mean P(unsafe) of the victim in `adapter_file` over its answers to `attacks`, the share of attacks whose mean
    answer reaches `threshold`, and the share of answers that are refusals."""
    from redteam_grpo.core.data.sources import Prompt
    from redteam_grpo.core.models.roles import DEFAULT_ROLE
    from redteam_grpo.tasks.engine import InProcessSampler, answers

    cfg = res.config
    res.policy.load_adapter(adapter_file, DEFAULT_ROLE)
    res.holds(DEFAULT_ROLE, None)  # not a version of the run's: the next stage would reload
    prompts = [Prompt(attack_id, text) for attack_id, text in attacks]
    sampler = InProcessSampler(res.policy, cfg.sampling.batch_size)
    got = answers(
        sampler,
        DEFAULT_ROLE,
        res.policy.tokenizer,
        prompts,
        cfg.model.system_prompt,
        samples,
        cfg.sampling.max_new_tokens,
        seed,
    )
    scores = got.scored(res.scoring)
    per_attack: dict[int, list[float]] = {}
    refused = sum(s.refusal for s in scores) / len(scores)
    for completion, score in zip(got.completions, scores, strict=True):
        if score.score is not None:
            per_attack.setdefault(completion.prompt_index, []).append(score.score)
    means = [statistics.fmean(v) for v in per_attack.values()]
    return statistics.fmean(means), sum(m >= threshold for m in means) / len(means), refused


def found_in(run, iterations: range, threshold: float) -> int:
    from redteam_grpo.storage.stages import ATTACK_SCORE

    return sum(
        sum(h is not None and h >= threshold for h in run.read(ATTACK_SCORE, i).column("harm").to_pylist())
        for i in iterations
    )


def one_seed(seed: int, args: argparse.Namespace, folder: Path) -> dict:
    from redteam_grpo.core.config import load_config
    from redteam_grpo.flows.active import active_run
    from redteam_grpo.storage import checkpoints
    from redteam_grpo.storage.rundir import RunDir
    from redteam_grpo.storage.stages import HARDEN
    from redteam_grpo.tasks.harden import found_attacks
    from redteam_grpo.tasks.resources import resources_for

    overrides = [
        f"run.runs_dir={folder}",
        f"run.run_id=seed{seed}",
        f"run.seed={seed}",
        f"run.iterations={args.iterations}",
        f"active.harden_every={args.harden_every}",
        *SMALL,
        *args.set,
    ]
    cfg = load_config(None, overrides, mode="active")
    started = time.perf_counter()
    run = RunDir.open(Path(active_run(config=cfg.model_dump(mode="json"))))
    wall = time.perf_counter() - started
    threshold, k = cfg.active.harm_threshold, cfg.active.harden_every
    rows = [run.read(HARDEN, i).to_pylist()[0] for i in range(args.iterations)]
    res = resources_for(run.root)
    out = {"seed": seed, "wall": wall, "harden_s": sum(r["seconds"] for r in rows), "rounds": []}
    for h in (r["iteration"] for r in rows if r["hardened"]):
        attacks = found_attacks(run, h, threshold)
        before = victim_success(
            res, run.checkpoint_dir(h - 1) / checkpoints.ADAPTER_FILE, attacks, args.samples, seed, threshold
        )
        after = victim_success(
            res, run.checkpoint_dir(h) / checkpoints.ADAPTER_FILE, attacks, args.samples, seed, threshold
        )
        this_round = range(h + 1 - k, h + 1)
        next_round = range(h + 1, min(h + 1 + k, args.iterations))
        out["rounds"].append(
            {
                "h": h,
                "attacks": len(attacks),
                "before": before,
                "after": after,
                "found_this_round": found_in(run, this_round, threshold),
                "found_next_round": found_in(run, next_round, threshold) if len(next_round) else None,
            }
        )
    out["evaluation"] = evaluate_against_a_rival(run, seed, args, folder)
    return out


def evaluate_against_a_rival(run, seed: int, args: argparse.Namespace, folder: Path) -> dict:
    """The run's evaluation with the cross-attack table against a self-play defense run of the same seed and size."""
    from redteam_grpo.core.config import load_config
    from redteam_grpo.core.evaluation import EvaluationOptions
    from redteam_grpo.flows.defense import defense_run
    from redteam_grpo.tasks.evaluate_active import evaluate_active

    rival = load_config(
        None,
        [
            f"run.runs_dir={folder}",
            f"run.run_id=rival{seed}",
            f"run.seed={seed}",
            f"run.iterations={args.iterations}",
            *SMALL[:4],
            "defense.self_play=true",
            "defense.prompts_per_goal=4",
            *args.set,
        ],
        mode="defense",
    )
    rival_dir = defense_run(config=rival.model_dump(mode="json"))
    threshold = run.stored_config().active.harm_threshold
    options = EvaluationOptions(num_prompts=16, samples_per_prompt=4, success_threshold=threshold, against=rival_dir)
    return evaluate_active.fn(str(run.root), options)


def print_evaluation(result) -> None:
    print(f"evaluation ({result.attacks} attacks of the final attacker on {result.goals} held-out goals):")
    print(f"{'victim':>8} {'success':>8} {'distinct':>9} {'1-SelfBLEU':>11} {'over-refusal':>13}")
    for label in result.policies:
        v = result.figures[label]
        print(
            f"{label:>8} {v.attack_success_rate:>8.3f} {v.distinct_successes:>9.0f} "
            f"{v.selfbleu_diversity:>11.3f} {v.over_refusal:>13.3f}"
        )
    print("cross-attack success (columns: the victim; hardened-X: hardened on X's attacks found on the base):")
    print(f"{'attacker':>8} {'found':>6} {'base':>6} {'hardened-own':>13} {'hardened-rival':>15}")
    for row in result.cross_attack.rows:
        name = "own" if row.attacks == "own" else "rival"
        victims = f"{row.base:>6.3f} {row.hardened_on_own:>13.3f} {row.hardened_on_against:>15.3f}"
        print(f"{name:>8} {row.found:>6} {victims}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--harden-every", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8, help="answers per found attack, before and after")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    from prefect.testing.utilities import prefect_test_harness

    results = []
    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness():
        for seed in args.seeds:
            r = one_seed(seed, args, Path(tmp))
            results.append(r)
            print(
                f"\nseed {seed}: {args.iterations} iterations in {r['wall']:.0f} s, hardening {r['harden_s']:.1f} s "
                f"({100 * r['harden_s'] / r['wall']:.1f} %)"
            )
            print(
                f"{'hardened after':>14} {'attacks':>8} {'P(unsafe) before':>17} {'after':>7} "
                f"{'success before':>15} {'after':>7} {'refusals before':>16} {'after':>7} "
                f"{'found this round':>17} {'next round':>11}"
            )
            for x in r["rounds"]:
                nxt = "-" if x["found_next_round"] is None else str(x["found_next_round"])
                print(
                    f"{x['h']:>14} {x['attacks']:>8} {x['before'][0]:>17.3f} {x['after'][0]:>7.3f} "
                    f"{x['before'][1]:>15.2f} {x['after'][1]:>7.2f} {x['before'][2]:>16.2f} {x['after'][2]:>7.2f} "
                    f"{x['found_this_round']:>17} {nxt:>11}"
                )
            print_evaluation(r["evaluation"])
    rounds = [x for r in results for x in r["rounds"]]
    safer = sum(x["after"][0] < x["before"][0] for x in rounds)
    refusing = sum(x["after"][2] > x["before"][2] for x in rounds)
    again = [x for x in rounds if x["found_next_round"] is not None]
    overhead = max(100 * r["harden_s"] / r["wall"] for r in results)
    found = sum(x["found_next_round"] > 0 for x in again)
    print(
        f"\nsummary: {safer} of {len(rounds)} hardenings lowered the victim's mean P(unsafe) on the attacks it was "
        f"hardened on and {refusing} raised its refusals there; the restarted attacker found attacks again in {found} "
        f"of {len(again)} next rounds; hardening overhead at most {overhead:.1f} % of a run (target <= 10 %)"
    )
    evaluations = [r["evaluation"] for r in results]
    base = [e.figures["base"] for e in evaluations]
    final = [e.figures[e.policies[-1]] for e in evaluations]
    print(
        f"the final attacker's success: on the base {[round(b.attack_success_rate, 3) for b in base]}"
        f", on the final victim {[round(f.attack_success_rate, 3) for f in final]}; the final victim's "
        f"over-refusal {[round(f.over_refusal, 3) for f in final]} (base {[round(b.over_refusal, 3) for b in base]})"
    )
    cross = [{row.attacks: row for row in e.cross_attack.rows} for e in evaluations]
    print(
        "cross-attack: own attacks on the victim hardened on the rival's "
        f"{[round(c['own'].hardened_on_against, 3) for c in cross]}, the rival's on the victim hardened on own "
        f"{[round(c['against'].hardened_on_own, 3) for c in cross]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
