"""Rollouts: drawing completions and dialogues, the sampling distribution the trainer replays, shards, rollout
statistics."""
