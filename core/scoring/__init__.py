"""Scoring: harm scorers and judges, refusal detection, novelty, and the backend protocol that serves them."""
