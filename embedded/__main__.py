"""`python -m redteam_grpo.embedded` regenerates the bundled prompts from the toy corpus."""

from redteam_grpo.embedded.corpus import write_prompts_file

print(f"wrote {write_prompts_file()}")
