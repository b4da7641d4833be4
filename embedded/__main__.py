"""`python -m redteam_grpo.embedded` regenerates the bundled prompts and defense data from the toy corpus;
`--weights` trains the default builds of the embedded models and ships them (`embedded/shipped/`, see
`shipped.py`): run it after a change to a recipe or a build module, and commit what it writes."""

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

from redteam_grpo.embedded import cache, shipped
from redteam_grpo.embedded.corpus import write_prompts_file
from redteam_grpo.embedded.defense import write_defense_files

parser = argparse.ArgumentParser(prog="python -m redteam_grpo.embedded", description=__doc__)
parser.add_argument("--weights", action="store_true", help="train the default builds into embedded/shipped/")
args = parser.parse_args()
if not args.weights:
    print(f"wrote {write_prompts_file()}")
    for path in write_defense_files():
        print(f"wrote {path}")
else:
    with tempfile.TemporaryDirectory() as scratch:
        for name, (train, recipe) in cache.default_trainers().items():
            print(f"training {name} ...", flush=True)
            out = Path(scratch) / name
            out.mkdir()
            train(out, recipe)
            manifest_path = out / "manifest.json"
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            assert manifest["recipe"] == dataclasses.asdict(recipe)
            manifest |= {"source_digest": shipped.source_digest(), **shipped.build_facts()}
            manifest_path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(shipped.SHIPPED_DIR, ignore_errors=True)
        shutil.copytree(scratch, shipped.SHIPPED_DIR)
    print(f"wrote {shipped.write_checksums()}")
