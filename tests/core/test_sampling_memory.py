"""The sampler's bookkeeping is O(batch x steps), not O(batch x steps x vocab): measured as the peak resident memory a
sampling call adds, in a fresh process, with a Qwen3-sized vocabulary (151,936) on a tiny random model.

glibc serves large blocks from its heap once one has been freed (its mmap threshold adapts), where a heap fragmented by
the growing KV cache keeps them resident: the same call then adds anything from 70 MiB to 1.3 GiB from run to run. A
fixed threshold hands every large block back when it is freed, so what is measured is what the sampler holds."""

import json
import os
import subprocess
import sys

PROBE = r"""
import json, resource, sys
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM
from redteam_grpo.core.config import ModelConfig
from redteam_grpo.core.models.policy import _wrap, load_tokenizer
from redteam_grpo.core.rollouts.sampling import sample_completions

torch.manual_seed(0)
torch.set_num_threads(1)
base = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16))
policy = _wrap(get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).eval(), load_tokenizer(ModelConfig()),
               1.0, torch.device("cpu"))
policy.end_of_turn_ids = [151935]  # a token the random model almost never draws: every row runs to the limit
prompts = [[1, 2, 3, 4]] * 2
sample_completions(policy, prompts, 2, 2, 4, seed=0)  # warm-up: allocator, kernels
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
completions = sample_completions(policy, prompts, 8, 96, 16, seed=0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
json.dump({"added_mib": (after - before) / 1024, "tokens": sum(len(c.completion_ids) for c in completions)}, sys.stdout)
"""


def test_sampling_memory_does_not_grow_with_steps_times_vocabulary(embedded_assets):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["tokens"] > 16 * 80  # the rows ran (nearly) to the limit, so every step was taken
    per_step_copy_mib = 16 * 96 * 151936 * 4 / 2**20  # one [steps, batch, vocab] float32 tensor: 890 MiB
    assert measured["added_mib"] < per_step_copy_mib / 4, measured
