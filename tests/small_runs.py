"""The settings of the small runs that flow and end-to-end tests start: 3 prompts x 4 samples of up to 12
tokens per iteration, no early stop (the iteration count is each test's own)."""

SMALL_RUN = [
    "data.prompts_per_iteration=3",
    "sampling.group_size=4",
    "sampling.max_new_tokens=12",
    "run.early_stop_reward=null",
]
