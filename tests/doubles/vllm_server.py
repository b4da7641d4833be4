"""A stand-in for `vllm serve`: the part of vLLM's OpenAI-compatible protocol that `server/vllm_client.py` uses,
served by transformers on the CPU, so the client and `sampling.backend=vllm` are tested where no GPU (or vLLM) is.

What it speaks, as vLLM does (see server/vllm_client.py for the sources of each behaviour):
- POST /v1/completions: `prompt` as token ids (one list or a list of lists), `n`, `max_tokens` (default 16),
  `temperature`, `seed` (child i of a request draws with seed + i), `logprobs: 0`, `return_token_ids`,
  `stop_token_ids` (the stop token is part of the returned ids), `allowed_token_ids`; `model` names the base or a
  loaded adapter (404 otherwise) and is echoed in the response; choices prompt by prompt, `n` each; logprobs of
  the distribution drawn from (vLLM's `--logprobs-mode processed_logprobs`). Sampling settings it does not
  implement (top-p, top-k, min-p, penalties) must be neutral: a request with others is refused (400), so a client
  that started sending them would fail here first.
- POST /v1/load_lora_adapter (400 when the name is taken), /v1/unload_lora_adapter (404 when unknown),
  GET /v1/models, GET /health.

`--logprob-noise D` adds D x sin(token id) to every reported logprob: another engine's kernels, whose logprobs
differ from the trainer's by a little.

    python tests/doubles/vllm_server.py --model embedded:tiny-qwen3 --port 8100 [--logprob-noise 0.01]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import threading
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from peft import PeftModel
from transformers import AutoModelForCausalLM

from redteam_grpo.core.config import ModelConfig
from redteam_grpo.core.models.policy import Policy, load_tokenizer, resolve_model_name
from redteam_grpo.core.rollouts.sampling import sample_completions
from redteam_grpo.core.tokens.logprobs import SamplingDistribution

NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def build_app(model: str, logprob_noise: float = 0.0) -> FastAPI:
    app = FastAPI(title="vLLM stand-in")
    tokenizer = load_tokenizer(ModelConfig(policy=model))
    base = AutoModelForCausalLM.from_pretrained(resolve_model_name(model), dtype=torch.float32).eval()
    model = resolve_model_name(model)  # the base's name, as `vllm serve PATH` (serve-sampler) names it
    state: dict[str, Any] = {"model": base, "adapters": {}}
    lock = threading.Lock()  # one generation at a time, as one engine

    @app.get("/health")
    def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/v1/models")
    def models() -> dict:
        cards = [{"id": model, "object": "model", "root": model, "parent": None}]
        cards += [{"id": n, "object": "model", "root": p, "parent": model} for n, p in state["adapters"].items()]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    def load(body: dict) -> Any:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _error(400, "lora_name and lora_path are required")
        if name in state["adapters"]:
            return _error(400, f"The lora adapter '{name}' has already been loaded.")
        with lock:
            if isinstance(state["model"], PeftModel):
                state["model"].load_adapter(path, adapter_name=name)
            else:
                state["model"] = PeftModel.from_pretrained(base, path, adapter_name=name).eval()
        state["adapters"][name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    def unload(body: dict) -> Any:
        name = body.get("lora_name")
        if name not in state["adapters"]:
            return _error(404, f"The lora adapter '{name}' cannot be found.")
        del state["adapters"][name]  # as vLLM: the name goes, the weights stay cached until evicted
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/v1/completions")
    def completions(body: dict) -> Any:
        name = body.get("model")
        if name != model and name not in state["adapters"]:
            return _error(404, f"The model `{name}` does not exist.")
        for key, neutral in NEUTRAL.items():
            if body.get(key, neutral) not in (neutral, None) and not (key == "top_k" and body[key] == -1):
                return _error(400, f"this stand-in samples with {key}={neutral} only (got {body[key]})")
        prompts = body.get("prompt")
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
            return _error(400, "prompt must be token ids: a list of ints or a list of lists of ints")
        n, max_tokens = int(body.get("n", 1)), int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        seed = int(body.get("seed") or 0)
        vocab = base.get_input_embeddings().num_embeddings
        allowed = body.get("allowed_token_ids")
        suppressed = tuple(sorted(set(range(vocab)) - set(allowed))) if allowed else ()
        bias = body.get("logit_bias") or {}
        if any(b > -100 for b in bias.values()):
            return _error(400, "this stand-in applies a logit bias of -100 (suppression) only")
        suppressed = tuple(sorted({*suppressed, *(int(k) for k in bias)}))
        stops = list(body.get("stop_token_ids") or [])
        if base.generation_config.eos_token_id is not None:  # vLLM stops on the model's eos too
            eos = base.generation_config.eos_token_id
            stops += [t for t in (eos if isinstance(eos, list) else [eos]) if t not in stops]
        choices, tokens = [], 0
        with lock:
            served = state["model"]
            adapters_on = isinstance(served, PeftModel)
            if adapters_on and name != model:
                served.set_adapter(name)
            policy = Policy(served, tokenizer, stops, [], SamplingDistribution(temperature, suppressed), served.device)
            for prompt in prompts:
                for g in range(n):  # vLLM: child g of a request draws with seed + g
                    with served.disable_adapter() if adapters_on and name == model else contextlib.nullcontext():
                        (drawn,) = sample_completions(policy, [prompt], 1, max_tokens, 1, seed + g)
                    ids = drawn.completion_ids
                    tokens += len(ids)
                    logprobs = [
                        lp + logprob_noise * math.sin(t) for lp, t in zip(drawn.sample_logprobs, ids, strict=True)
                    ]
                    choices.append(
                        {
                            "index": len(choices),
                            "text": tokenizer.decode(ids, skip_special_tokens=True),
                            "token_ids": ids if body.get("return_token_ids") else None,
                            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                            "logprobs": {
                                "tokens": [f"token_id:{t}" for t in ids],
                                "token_logprobs": [max(lp, -9999.0) for lp in logprobs],
                                "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, logprobs, strict=True)],
                                "text_offset": [0] * len(logprobs),
                            }
                            if body.get("logprobs") is not None
                            else None,
                            "finish_reason": drawn.finish_reason,
                            "stop_reason": ids[-1] if drawn.finish_reason == "stop" else None,
                        }
                    )
        return {
            "id": f"cmpl-{seed}",
            "object": "text_completion",
            "model": name,
            "choices": choices,
            "usage": {"prompt_tokens": sum(map(len, prompts)) * n, "completion_tokens": tokens},
        }

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded:tiny-qwen3")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--logprob-noise", type=float, default=0.0)
    args = parser.parse_args()
    uvicorn.run(build_app(args.model, args.logprob_noise), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
