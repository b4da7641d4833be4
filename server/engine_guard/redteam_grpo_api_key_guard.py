"""The API key (VLLM_API_KEY) required on every request to the vLLM engine but its health probe.

vLLM requires its key only on paths under /v1, /v2, /inference and /cohere; its SageMaker routes answer anyone:
/invocations samples completions from any loaded adapter, /adapters loads one (VLLM_ALLOW_RUNTIME_LORA_UPDATING), and
/tokenize, /ping and others answer too. An engine that loads any adapter folder it can read must answer nothing of its
API to a caller without the key, so `serve-sampler` starts it with this middleware
(`--middleware redteam_grpo_api_key_guard.RequireApiKey`, this folder on PYTHONPATH). Without VLLM_API_KEY it lets
everything through, as vLLM does.

It runs in the engine's environment (`install-sampler`'s, or the vLLM container), not this project's: the standard
library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

OPEN_PATHS = frozenset({"/health"})  # the probe that says the model is loaded: the compose health check, the client
REFUSAL = json.dumps(
    {"error": "Unauthorized: send the sampler's API key as `Authorization: Bearer $REDTEAM_GRPO_SAMPLER_TOKEN`"}
).encode()


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()  # compared as digests: no timing oracle on the key's length


class RequireApiKey:
    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "")
        self.key_digest = _digest(key) if key.strip() else None

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(_digest(given.strip()), self.key_digest)

    async def __call__(self, scope, receive, send) -> None:
        if self.key_digest is None or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        probe = scope["type"] == "http" and scope["method"] in ("GET", "HEAD") and path in OPEN_PATHS
        if probe or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # refused before the handshake completes
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(REFUSAL)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": REFUSAL})
