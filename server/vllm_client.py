"""Client of a vLLM sampler: `vllm serve` (its OpenAI-compatible server) in its own process, with LoRA loaded at
runtime. It fills the rollouts contract of the in-process sampler (`core/rollouts/sampling.py: Completion`):

- token ids both ways: prompts go as ids (`prompt: [[...]]`), completions come back as ids (`return_token_ids`),
  never as text to re-tokenise; the server's echo of the prompt ids must equal what was sent;
- one logprob per completion token, of the distribution it was drawn from: the server must run with
  `--logprobs-mode processed_logprobs` (after temperature and the token mask), and the request sets every sampling
  setting explicitly and neutral (the server's `--generation-config vllm` keeps the model's own defaults out);
  suppressed tokens are left out through `logit_bias` at vLLM's bound (-100): the same logprobs as `allowed_token_ids`
  to float32, and free, where a list of every other id costs per request (12 % of the throughput at Qwen3's 151,936
  ids, bench 5);
- the end-of-turn token, when drawn, ends the completion and is part of it (finish reason `stop`), else `length`;
- the adapter: each policy version is loaded under its own name (`adapter_name`: run, version and a digest of the
  weights), so the server's prefix cache never mixes versions; every response names the adapter it used
  (`model`), and a response from another adapter is refused (`SamplerError`).

`redteam-grpo serve-sampler` starts a server with these settings. The client retries what waiting can fix
(connection errors, 502/503/504) with the reward server's client's loop (`server/retry.py`).

The server loads any adapter folder it can read on request (VLLM_ALLOW_RUNTIME_LORA_UPDATING), so it takes an API key,
REDTEAM_GRPO_SAMPLER_TOKEN (required beyond loopback): `serve-sampler` hands it to the engine as VLLM_API_KEY, in the
environment rather than on the command line, where any user of the machine could read it (`ps`); the client sends
it as a bearer token on every request. vLLM itself requires the key only under /v1 and a few other prefixes, not on
routes that sample (/invocations) or load adapters (/adapters): the engine also runs the middleware of
`engine_guard/redteam_grpo_api_key_guard.py`, which requires it on every path but /health.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from redteam_grpo.core.rollouts.sampling import Completion
from redteam_grpo.core.seeds import derive_seed
from redteam_grpo.server.retry import RETRIED_ERRORS, RetriesExhausted, send_with_retries
from redteam_grpo.server.settings import SAMPLER_TOKEN_ENV, no_empty_token, sampler_token, warn_token_in_clear
from redteam_grpo.server.vllm_env import Engine

log = logging.getLogger("redteam_grpo.vllm_client")

ZERO_PROBABILITY = -9999.0  # vLLM's JSON for a logprob of -inf
# The bias that suppresses a token: vLLM clamps logit_bias to [-100, 100]. A suppressed token keeps at most
# e^(x - 100) of the mass where x is how far its logit lies above the others' (tens at most): below float32's
# resolution of the normaliser, so the other tokens' logprobs are those of the trainer, which sets it to -inf
# (tested against allowed_token_ids on the real engine); a suppressed token that is drawn anyway is refused.
SUPPRESSING_BIAS = -100.0
PEFT_ADAPTER_FILE = "adapter_model.safetensors"  # in the folder PEFT's save_pretrained writes, which vLLM loads


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values `vllm serve --max-lora-rank` accepts
API_KEY_ENV = "VLLM_API_KEY"  # the engine's API key, as its --api-key would set it
# The key on every path of the engine, loaded by vLLM's --middleware from this folder (its module alone: nothing else
# of this project can shadow the engine's own imports).
ENGINE_GUARD_DIR = Path(__file__).resolve().parent / "engine_guard"
ENGINE_GUARD = "redteam_grpo_api_key_guard.RequireApiKey"
SECRET_ENV = {API_KEY_ENV: SAMPLER_TOKEN_ENV}  # shown by name, never by value


def serve_command(
    engine: Engine,
    model: str,
    revision: str | None,
    dtype: str,
    lora_rank: int,
    max_model_len: int,
    host: str,
    port: int,
    seed: int,
    extra: list[str],
    kv_cache_gib: int = 4,
    api_key: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line (and its environment) of a vLLM server that samples as this project's client expects: LoRA
    loaded at runtime, logprobs of the distribution drawn from (after temperature and the token mask), none of the
    model's own generation defaults, and `api_key` (if any) required on its API, given in the environment: a
    command line is readable by every user of the machine. The CPU build also gets its platform, its KV cache size,
    no chunked prefill and the allocator and OpenMP runtime its documentation asks to preload (server/vllm_env.py
    says why). Show the result with `shown_command`, which leaves the key out."""
    rank = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), None)
    if rank is None:
        raise SamplerError(f"model.lora_rank={lora_rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")
    command = [*engine.launcher, model, "--host", host, "--port", str(port), "--dtype", dtype, "--seed", str(seed)]
    command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
    command += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    command += ["--max-model-len", str(max_model_len), "--middleware", ENGINE_GUARD]
    if revision:
        command += ["--revision", revision]
    guard_path = [str(ENGINE_GUARD_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONPATH": os.pathsep.join(guard_path)}
    if no_empty_token(api_key):
        env[API_KEY_ENV] = api_key
    if engine.cpu:
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(2048, max_model_len))]
        env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
        if engine.preload:
            env["LD_PRELOAD"] = ":".join(engine.preload)
    return [*command, *extra], env


def shown_command(command: list[str], env: dict[str, str]) -> str:
    """The environment and command as a shell line to print or log: the API key by the variable it came from."""
    shown_env = " ".join(
        f"{k}=${SECRET_ENV[k]}" if k in SECRET_ENV else f"{k}={shlex.quote(v)}" for k, v in env.items()
    )
    return f"{shown_env} {shlex.join(command)}".lstrip()


MAX_REQUESTS_IN_FLIGHT = 64  # one per prompt, sent at once: the engine batches what arrives together


def prompt_seed(seed: int, prompt: int) -> int:
    """The seed of prompt `prompt`'s request in a call seeded `seed`; vLLM draws child g of the request with the
    request's seed + g, so each (prompt, child) has a stream of its own.

    >>> len({prompt_seed(7, p) + g for p in range(100) for g in range(16)})
    1600
    """
    return derive_seed(seed, "prompt", prompt)


class SamplerError(RuntimeError):
    """The vLLM sampler cannot be used or answered outside the rollouts contract; the message says what to do."""


def adapter_name(run_id: str, version: int, adapter_file: Path) -> str:
    """A name unique to these weights: a redone iteration's new weights never reuse an old name (and its cache)."""
    digest = hashlib.sha256(adapter_file.read_bytes()).hexdigest()[:12]
    return f"{run_id}-v{version}-{digest}"


class VllmSampler:
    def __init__(
        self,
        url: str,
        timeout_s: float = 600.0,
        retries: int = 4,
        backoff_s: float = 1.0,
        http: httpx.Client | None = None,  # another transport (tests: the stand-in served in-process)
        token: str | None = None,
    ):
        """`token`: the server's API key; None reads REDTEAM_GRPO_SAMPLER_TOKEN (environment or ./.env), "" is none."""
        self.url = url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self.http = http or httpx.Client(base_url=self.url, timeout=timeout_s)
        self.token = sampler_token() if token is None else no_empty_token(token)
        # on every request, whichever client sends it (one passed in as well)
        self.headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.loaded: set[str] = set()

    def _post(self, path: str, payload: dict[str, Any]) -> httpx.Response:
        """The first answer that is not retried (server/retry.py); a refused key is an error that says so."""
        if self.token:
            warn_token_in_clear(
                self.url, log, "the vLLM sampler", "serve-sampler ... -- --ssl-certfile CERT --ssl-keyfile KEY"
            )
        try:
            response = send_with_retries(
                lambda: self.http.post(path, json=payload, headers=self.headers), self.retries, self.backoff_s
            )
        except RetriesExhausted as exc:
            raise SamplerError(
                f"the vLLM sampler at {self.url} did not answer {path} ({exc.last}) after {self.retries} retries: "
                "is `redteam-grpo serve-sampler` (or `vllm serve`) running there? Resume the run when it is."
            ) from None
        except httpx.TransportError as exc:  # a URL no attempt can send to (e.g. no http:// scheme)
            raise SamplerError(
                f"cannot send a request to the vLLM sampler at {self.url} ({type(exc).__name__}: {exc}); "
                "check sampling.vllm_url"
            ) from None
        if response.status_code == 401:
            given = f"the key in {SAMPLER_TOKEN_ENV}" if self.token else f"no key ({SAMPLER_TOKEN_ENV} is not set)"
            raise SamplerError(
                f"the vLLM sampler at {self.url} refused {path} with HTTP 401: it requires an API key, and this client "
                f"sent {given}. Set {SAMPLER_TOKEN_ENV} to the key the server was started with (serve-sampler reads "
                "the same variable) and resume the run."
            )
        return response

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait for GET /health (the server refuses connections while it loads the model)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.http.get("/health", timeout=5, headers=self.headers).status_code == 200:
                    return
            except RETRIED_ERRORS:
                pass
            except httpx.TransportError as exc:
                raise SamplerError(f"cannot reach {self.url} ({exc}); check sampling.vllm_url") from None
            if time.monotonic() > deadline:
                raise SamplerError(f"the vLLM sampler at {self.url} was not ready after {timeout_s:.0f} s")
            time.sleep(1.0)

    def load_adapter(self, name: str, folder: Path) -> None:
        """Load the PEFT adapter in `folder` under `name` (a no-op when this client loaded it already)."""
        if name in self.loaded:
            return
        response = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        if response.status_code != 200 and "already been loaded" not in response.text:
            raise SamplerError(
                f"the vLLM sampler refused adapter {name} from {folder}: HTTP {response.status_code} "
                f"{response.text[:300]}. It needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora, "
                "--max-lora-rank of at least model.lora_rank, and read access to that folder."
            )
        self.loaded.add(name)

    def unload_adapter(self, name: str) -> None:
        response = self._post("/v1/unload_lora_adapter", {"lora_name": name})
        if response.status_code not in (200, 404):  # 404: not loaded (a restarted server)
            raise SamplerError(f"the vLLM sampler could not unload {name}: HTTP {response.status_code}")
        self.loaded.discard(name)

    def sample(
        self,
        adapter: str,
        prompt_ids: Sequence[Sequence[int]],
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        end_of_turn_ids: Sequence[int],
        suppressed_ids: Sequence[int],
    ) -> list[Completion]:
        """G completions of every prompt from `adapter`, in the in-process sampler's order (prompt, then sample).

        Each prompt is a request of its own, with its own seed (`prompt_seed`), sent at once (the engine batches
        them): vLLM gives every prompt of one request the request's seed, so the k-th completion of each would draw
        from the same random stream (bug class `engine-seed-shared-across-prompts`)."""
        payload = {
            "model": adapter,
            "n": group_size,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "min_tokens": 0,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": list(end_of_turn_ids),
            "logit_bias": {str(i): SUPPRESSING_BIAS for i in suppressed_ids},
            "skip_special_tokens": False,
        }

        def one_prompt(p: int) -> list[dict[str, Any]]:
            response = self._post(
                "/v1/completions", {**payload, "prompt": list(prompt_ids[p]), "seed": prompt_seed(seed, p)}
            )
            if response.status_code != 200:
                raise SamplerError(
                    f"the vLLM sampler refused the request: HTTP {response.status_code} {response.text[:400]}"
                )
            body = response.json()
            if body.get("model") != adapter:
                raise SamplerError(
                    f"the vLLM sampler answered with adapter {body.get('model')!r}, not {adapter!r}: these "
                    "completions are not from the policy being trained, and are not used"
                )
            choices = sorted(body["choices"], key=lambda c: c["index"])
            if [c["index"] for c in choices] != list(range(group_size)):
                raise SamplerError(f"expected {group_size} completions of prompt {p}, got {len(choices)}")
            return [{**c, "index": p * group_size + c["index"]} for c in choices]

        if not prompt_ids:
            return []
        with ThreadPoolExecutor(max_workers=min(len(prompt_ids), MAX_REQUESTS_IN_FLIGHT)) as pool:
            choices = [c for answered in pool.map(one_prompt, range(len(prompt_ids))) for c in answered]
        stops, suppressed = set(end_of_turn_ids), set(suppressed_ids)
        completions = []
        for choice in choices:
            p, g = divmod(choice["index"], group_size)
            ids, logprobs = choice.get("token_ids"), (choice.get("logprobs") or {}).get("token_logprobs")
            if ids is None or logprobs is None:
                raise SamplerError(
                    "the vLLM sampler returned no token ids or logprobs: it needs vLLM >= 0.10.2 "
                    "(return_token_ids) and must not strip logprobs"
                )
            if choice.get("prompt_token_ids") not in (None, list(prompt_ids[p])):
                raise SamplerError(f"the vLLM sampler saw other prompt ids than were sent for prompt {p}")
            if len(logprobs) != len(ids) or any(lp is None or lp <= ZERO_PROBABILITY for lp in logprobs):
                raise SamplerError(f"completion {p}/{g}: a token without a logprob, or drawn at probability 0")
            if suppressed.intersection(ids):
                raise SamplerError(
                    f"completion {p}/{g} holds suppressed ids {sorted(suppressed.intersection(ids))[:5]}: the server "
                    "did not apply the logit bias that forbids them"
                )
            if any(t in stops for t in ids[:-1]) or choice.get("finish_reason") not in ("stop", "length"):
                raise SamplerError(
                    f"completion {p}/{g} went on past an end-of-turn token or ended with "
                    f"{choice.get('finish_reason')!r}: the server does not stop where the trainer's turn ends"
                )
            # as the in-process sampler: `stop` exactly when the completion ends with an end-of-turn token
            reason = "stop" if ids and ids[-1] in stops else "length"
            completions.append(Completion(p, g, list(ids), [float(x) for x in logprobs], reason))
        return completions
