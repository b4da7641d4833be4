"""`python -m redteam_grpo.embedded` regenerates the bundled prompts and defense data from the toy corpus."""

from redteam_grpo.embedded.corpus import write_prompts_file
from redteam_grpo.embedded.defense import write_defense_files

print(f"wrote {write_prompts_file()}")
for path in write_defense_files():
    print(f"wrote {path}")
