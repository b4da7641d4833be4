"""Training: advantages, rewards, the losses, KL, micro-batches, the GRPO update (data-parallel too), SFT, early
stopping."""
