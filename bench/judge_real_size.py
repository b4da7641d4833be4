"""The defense judges at their real size: Llama-Guard-3-1B (configs/defense-qwen3-4b.yaml's) and Llama-Guard-3-8B,
random weights of their shapes in bfloat16 with Llama 3's real tokenizer and their published chat templates
(tests/real_tokenizers.py), scoring pairs through `SafetyJudgeScorer` as a run's score stage does.

    python bench/judge_real_size.py --out OUT                           # cuda: 1B and 8B
    python bench/judge_real_size.py --out OUT --device cpu --shapes small   # the script's code, on a CPU

A random judge writes no verdict. As in tests/core/test_judges_on_real_tokenizers.py, a logits processor makes it
write what Llama Guard 3 writes, "\\n\\nunsafe\\nS1" then <|eot_id|>, so the verdict is generated and parsed and
P(unsafe) is read after the "\\n\\n", on the model's raw logits, as on the real model. Per judge it prints: the
seconds to load, the peak device memory while scoring, pairs per second with the verdict generated (the run's path,
reward.judge_max_new_tokens=16) and with the score alone (one forward over the pair and the "\\n\\n": what
generating the verdict costs, side by side), and the largest difference between the scorer's P(unsafe) and that
independent forward's. The tokenizer files must be in the cache (XDG_CACHE_HOME) on a machine without the package
index. Figures: OUT/judge_real_size.json; the last measured ones in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

SHAPES = {"1b": "LLAMA_GUARD_3_1B", "8b": "LLAMA_GUARD_3_8B", "small": "SMALL_GUARD"}
"""bench/real_size.py's shapes of Llama-Guard-3-1B (Llama 3.2 1B) and -8B (Llama 3.1 8B), and a small one."""
TEMPLATES = {"1b": "llama_guard_3_1b.jinja", "8b": "llama_guard_3_8b.jinja", "small": "llama_guard_3_1b.jinja"}
WRITES = "\n\nunsafe\nS1"


def judge_tokenizer(shape: str, saved: Path | None):
    """Llama 3's real tokenizer with the judge's published template: built (tests/real_tokenizers.py), or as saved by
    --save-tokenizers on a machine that could build it."""
    from transformers import PreTrainedTokenizerFast

    from tests import real_tokenizers as real

    if saved is not None:
        return PreTrainedTokenizerFast.from_pretrained(saved / TEMPLATES[shape].removesuffix(".jinja"))
    return real.with_template(real.llama3(), TEMPLATES[shape])


def build(folder: Path, shape: str, device: str, saved: Path | None) -> Path:
    sys.path.insert(0, str(HERE))
    import real_size

    tokenizer = judge_tokenizer(shape, saved)
    return real_size.build_judge(folder, getattr(real_size, SHAPES[shape]), TEMPLATES[shape], device, tokenizer)


def pairs(n: int, response_words: int) -> tuple[list[str], list[str]]:
    """The bundled harmful prompts and responses of about `response_words` words."""
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "core/resources/harmful_prompts.jsonl").open()][:n]
    prompts = (prompts * (n // len(prompts) + 1))[:n]
    sentence = "First gather the parts, then follow each step with care and check the result before going on. "
    words = sentence.split()
    responses = [" ".join((words * (response_words // len(words) + 1))[: response_words - i % 7]) for i in range(n)]
    return prompts, responses


def measure(shape: str, args) -> dict:
    import torch

    from redteam_grpo.core.scoring import judge_formats as jf
    from redteam_grpo.core.scoring.judge import SafetyJudgeScorer
    from tests import real_tokenizers as real

    device = torch.device(args.device)
    folder = build(args.models / f"llama-guard-3-{shape}-random", shape, args.device, args.tokenizers)
    started = time.perf_counter()
    fmt = jf.LLAMA_GUARD_3 if TEMPLATES[shape].endswith("8b.jinja") else jf.LLAMA_GUARD_3_1B
    judge = SafetyJudgeScorer(str(folder), device, batch_size=args.batch, max_length=2048, judge_format=fmt)
    judge.model.to(torch.bfloat16)
    load_seconds = time.perf_counter() - started
    tokenizer = judge.tokenizer
    writes = tokenizer.encode(WRITES, add_special_tokens=False)
    real.make_write(judge.model, writes, tokenizer.eos_token_id)
    prompts, responses = pairs(args.pairs, args.response_words)
    judge(responses[: args.batch], prompts[: args.batch])  # warm up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    scores = judge(responses, prompts)
    if device.type == "cuda":
        torch.cuda.synchronize()
    verdict_seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None

    # the score alone: one forward over each rendered pair and the "\n\n", left-padded like the scorer's batches
    prefix = writes[:1]
    texts = [judge.render(p, r) for p, r in zip(prompts, responses, strict=True)]
    started = time.perf_counter()
    alone: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), args.batch):
            ids = [tokenizer.encode(t, add_special_tokens=False) + prefix for t in texts[start : start + args.batch]]
            width = max(map(len, ids))
            input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids], device=device)
            mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left-padded rows
            logits = judge.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
            logits = logits.logits[:, -1].float()
            alone.extend(logits.softmax(-1)[:, judge.unsafe_id].tolist())
    if device.type == "cuda":
        torch.cuda.synchronize()
    forward_seconds = time.perf_counter() - started
    read = [s.score for s in scores]
    assert all(s is not None for s in read), "the scorer read no score: the verdict was not written as scripted"
    difference = max(abs(a - b) for a, b in zip(read, alone, strict=True))
    tokens = [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    return {
        "shape": shape,
        "template": TEMPLATES[shape],
        "parameters": sum(p.numel() for p in judge.model.parameters()),
        "load_seconds": round(load_seconds, 1),
        "pairs": len(texts),
        "mean_pair_tokens": round(sum(tokens) / len(tokens)),
        "peak_device_gb": None if peak is None else round(peak / 1e9, 2),
        "pairs_per_s_with_verdict": round(len(texts) / verdict_seconds, 1),
        "pairs_per_s_score_only": round(len(texts) / forward_seconds, 1),
        "verdict_cost_ratio": round(verdict_seconds / forward_seconds, 2),
        "max_abs_difference_vs_forward": difference,
        "categories": sorted({c for s in scores for c in s.categories}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="1b,8b")
    parser.add_argument("--pairs", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="reward.batch_size of configs/defense-qwen3-4b.yaml")
    parser.add_argument("--response-words", type=int, default=200)
    parser.add_argument("--models", type=Path, default=Path("/tmp/redteam-grpo-judges"))
    parser.add_argument("--tokenizers", type=Path, help="the tokenizers as --save-tokenizers saved them")
    parser.add_argument("--save-tokenizers", type=Path, help="save the judges' tokenizers there, then stop")
    args = parser.parse_args()
    if args.save_tokenizers:
        for name in sorted(set(TEMPLATES.values())):
            judge_tokenizer("8b" if "8b" in name else "1b", None).save_pretrained(
                args.save_tokenizers / name.removesuffix(".jinja")
            )
        return
    args.out.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in args.shapes.split(","):
        result = measure(shape, args)
        print(json.dumps(result), flush=True)
        results.append(result)
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    (args.out / "judge_real_size.json").write_text(json.dumps({"device": device, "judges": results}, indent=2))


if __name__ == "__main__":
    main()
