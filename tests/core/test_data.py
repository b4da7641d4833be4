import json

import pandas as pd
import pytest

from redteam_grpo.core.config import DataConfig
from redteam_grpo.core.data import DataError, load_prompts, prompts_for_iteration


def test_bundled_prompts_load_with_stable_ids():
    prompts = load_prompts(DataConfig())
    assert len(prompts) >= 50
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert load_prompts(DataConfig()) == prompts


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_local_files_with_a_configurable_prompt_column(tmp_path, suffix):
    frame = pd.DataFrame({"question": ["a?", "b?", "a?", ""], "qid": [1, 2, 3, 4]})
    path = tmp_path / f"prompts{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in frame.to_dict("records")))
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    prompts = load_prompts(DataConfig(source=str(path), prompt_column="question", id_column="qid"))
    assert [(p.prompt_id, p.text) for p in prompts] == [("1", "a?"), ("2", "b?")]  # deduplicated, empty dropped


def test_missing_column_names_the_columns_there_are(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(DataError, match=r"data.prompt_column 'prompt' is not a column .* \['text'\]"):
        load_prompts(DataConfig(source=str(path)))


def test_missing_local_file_is_not_mistaken_for_a_hub_dataset(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(DataConfig(source=str(tmp_path / "nope.jsonl")))


def test_iteration_prompts_depend_only_on_iteration_and_seed_and_cover_every_prompt_per_epoch():
    prompts = load_prompts(DataConfig(max_prompts=10))
    first_epoch = [p for i in range(5) for p in prompts_for_iteration(prompts, i, 2, seed=1, shuffle=True)]
    assert sorted(p.prompt_id for p in first_epoch) == sorted(p.prompt_id for p in prompts)
    assert prompts_for_iteration(prompts, 3, 4, 1, True) == prompts_for_iteration(prompts, 3, 4, 1, True)
    assert prompts_for_iteration(prompts, 3, 4, 1, True) != prompts_for_iteration(prompts, 3, 4, 2, True)
    # a slice that crosses an epoch boundary is still full
    assert len(prompts_for_iteration(prompts, 2, 4, 1, True)) == 4
