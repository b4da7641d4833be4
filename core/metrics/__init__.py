"""Metrics: the per-iteration registry and the red-teaming evaluation metrics."""
