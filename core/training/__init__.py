"""Training: advantages, rewards, the losses, KL, masks, micro-batches, the GRPO update (data-parallel too), SFT, early
stopping."""
