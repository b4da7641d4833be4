"""Rollouts: drawing completions and dialogues, shards, rollout statistics."""
