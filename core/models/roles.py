"""The names of the adapters a policy carries (peft adapter names), in a module light enough for the stage records
(`storage/stages.py: Learner`) to share them with `core/models/policy.py`."""

DEFAULT_ROLE = "default"  # the adapter a run trains (peft's default adapter name): the attacked model or the defender
ATTACKER = "attacker"  # defense mode: the attacker's adapter on the same base

# The `speaker` of a rollouts row: who drew it (a dialogue holds both; core/rollouts/dialogue.py).
POLICY_SPEAKER = "policy"
ATTACKER_SPEAKER = "attacker"
