"""Tokens: the lowest layer of core/, importing no other subfolder. Packing prompt + completion rows into one batch
and the masks of the tokens each row trains (masks.py); the sampling distribution a sampler draws from and the
trainer replays, and the logprobs, entropies and means over those tokens (logprobs.py)."""
