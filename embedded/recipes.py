"""What each build depends on besides the bundled resources, and the recipe versions its cache folders are named by.

Change `ASSETS_VERSION` (`GUARD_VERSION` for the guard) whenever a recipe changes, so caches built by an older
recipe are not reused, and ship the new builds (`python -m redteam_grpo.embedded --weights`). A non-default
recipe is cached under a hash of its fields (`cache.cache_dirname`).
"""

from __future__ import annotations

from dataclasses import dataclass

ASSETS_VERSION = "v3"  # v3: the shipped build (v2 was trained on each machine)
"""The recipe version of the policy and classifier, which are built together into one folder."""
GUARD_VERSION = "v5"  # v5: ends at the assistant header and writes "\n\n" first, as Llama Guard 3 does
"""The guard's own recipe version: it is built into its own folder, so changing it leaves `ASSETS_VERSION` alone."""


@dataclass(frozen=True)
class BuildRecipe:
    """Everything the build depends on besides the bundled resources; the default one is cached by version."""

    seed: int = 1234
    marker_prob: float = 0.04
    """Probability that an adjective / noun / verb slot of a pre-training reply holds a marker word."""
    policy_vocab_size: int = 1536
    policy_steps: int = 200
    policy_batch_size: int = 24
    policy_lr: float = 6e-3
    classifier_vocab_size: int = 1024
    classifier_steps: int = 300
    classifier_batch_size: int = 32
    classifier_lr: float = 3e-3


DEFAULT_RECIPE = BuildRecipe()


@dataclass(frozen=True)
class GuardRecipe:
    """Everything the guard's build depends on besides the bundled resources; the default one is cached."""

    seed: int = 4321
    vocab_size: int = 1536
    steps: int = 400
    """300 sufficed for single exchanges; with the multi-turn and defense-world examples, 400 steps and markers in
    30 % of User turns keep a marker in the User turn alone unjudged (measured: 97 % of such pairs below 0.5, vs
    80 % at 300 steps and 15 %; held-out accuracy 0.96)."""
    batch_size: int = 16
    lr: float = 3e-3
    init_std: float = 0.1
    """Weight init std. At the usual 0.02 the verdict ignored the markers for ~450 steps (loss stuck at the
    label prior: a marker is one token among ~150 that the verdict position must learn to attend to); at 0.06
    to 0.12 it finds them within ~150 steps (measured)."""
    user_marker_prob: float = 0.3
    """Share of conversations whose User turn holds grammar text with markers: only the Agent turn is judged."""
    earlier_turns_prob: float = 0.35
    """Share of conversations with 1..2 earlier exchanges before the judged one (multi-turn dialogues): their
    replies are marked independently of the label, so only the last Agent message decides the verdict."""
    defense_prob: float = 0.2
    """Share of conversations whose last User turn is a training adversarial prompt of the defense world, half of
    them answered by a refusal (safe): without them ~9 % of refusals after a held-out hostile request were judged
    unsafe (measured)."""


DEFAULT_GUARD_RECIPE = GuardRecipe()


SAFE_VERSION = "v2"  # v2: the shipped build
"""The recipe version of ``embedded:tiny-qwen3-safe``, the base of defense mode, built into its own folder."""


@dataclass(frozen=True)
class SafeRecipe:
    """The safety-tuned toy base of defense mode (`embedded/safe_policy.py`): what its pre-training chats hold."""

    seed: int = 2024
    policy_vocab_size: int = 1536
    policy_steps: int = 800
    """At 400 steps the replies' marker rate did not yet depend on the prompt (measured)."""
    policy_batch_size: int = 24
    policy_lr: float = 6e-3
    adversarial_share: float = 0.4
    """Share of pre-training chats whose user turn is an adversarial prompt."""
    prompt_request_share: float = 0.1
    """Share of chats that ask for a prompt to send to an assistant (the skill an attacker's SFT builds on)."""
    adversarial_marker_prob: float = 0.5
    """Per-slot marker probability of a reply to an adversarial prompt (most such replies hold a marker)."""
    adversarial_refusal: float = 0.3
    """Share of adversarial prompts the base refuses."""
    benign_marker_prob: float = 0.03
    """Per-slot marker probability of a reply to a benign prompt ."""
    benign_refusal: float = 0.03
    """Share of benign prompts the base refuses: rare, but not never, so a reward that pays for refusals finds them."""


DEFAULT_SAFE_RECIPE = SafeRecipe()
