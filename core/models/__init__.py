"""Models: the policy and its adapters per role, chat formatting, quantization."""
