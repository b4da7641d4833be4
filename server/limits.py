"""Request checks that must run before FastAPI parses the body: size (413), UTF-8 and strict JSON (422); and, on a
server bound to loopback, that the request was addressed to a loopback name (421).

FastAPI would read any body into memory and answer invalid UTF-8 with a generic 400; this middleware stops
reading at the limit and names it, and names the byte at which the text stops being UTF-8.

FastAPI parses bodies with Python's `json`, which accepts more than JSON (RFC 8259) allows, and what it lets
through cannot be answered: `NaN`, `Infinity` and numbers beyond float range (1e999) become non-finite
floats, which the 422 that echoes them cannot encode (`allow_nan=False`); an escaped lone surrogate
(`"\\ud800"`) becomes a `str` that is not Unicode text, which the tokenizers refuse and a 422 that echoes
it cannot encode as UTF-8. Each of those ended in a 500 and a reset connection, so they are refused here,
with the place in the body that holds them.

A server on loopback is out of other machines' reach, but not out of a browser's on the same machine: a web page
whose own name its DNS server then resolves to 127.0.0.1 (DNS rebinding) may send requests to the port, with that
name in the Host header. So a loopback server answers only requests addressed to localhost or a loopback address,
with any port. Starlette's TrustedHostMiddleware compares names only, answers a bare "Invalid host header", and
would need every address of 127.0.0.0/8 listed; this check takes any loopback address and says the way out.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from redteam_grpo.core.hosts import is_loopback
from redteam_grpo.server.settings import REWARD_TOKEN_ENV


async def _problem(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class NotStrictJSON(ValueError):
    """The body parses as Python's JSON but holds a value that JSON (RFC 8259) does not have."""


def _refuse_constant(name: str) -> float:
    raise NotStrictJSON(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotStrictJSON(f"{text} is beyond the range of a float")
    return value


def _unicode_problem(document: Any) -> str | None:
    """Where `document` holds a string (key or value) that is not Unicode text (a lone surrogate), or None."""
    stack: list[tuple[str, Any]] = [("$", document)]
    while stack:  # not recursive: nesting depth is the client's choice
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if _lone_surrogate(key):
                    return f"a key of {path}"
                stack.append((f"{path}.{key}", item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str) and _lone_surrogate(value):
            return path
    return None


def _shown(path: str, limit: int = 200) -> str:
    return path if len(path) <= limit else path[:limit] + "..."


def _lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def strict_json_problem(body: bytes) -> str | None:
    """Why `body` cannot be taken as JSON that every later step can handle, or None.

    A body that is not JSON at all is left to FastAPI (it answers 422 with the position of the syntax error);
    this refuses what Python's parser accepts but JSON does not have: NaN and infinite numbers, integers of
    more digits than Python converts, lone surrogates, and nesting too deep to parse.
    """
    try:  # from bytes, as Starlette's `Request.json` does, so that both read the same document
        document = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except NotStrictJSON as exc:
        return f"{exc}: send finite numbers (the body must be strict JSON, RFC 8259)"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    except ValueError:  # an integer literal longer than Python's int conversion limit (4300 digits)
        return "a number has too many digits to read"
    except RecursionError:
        return "the body is nested too deeply to parse"
    where = _unicode_problem(document)
    if where is not None:
        return f"{_shown(where)} holds a lone UTF-16 surrogate (e.g. \\ud800), not Unicode text: send valid strings"
    return None


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = f"the limit is {self.max_body_bytes} bytes (--max-body-bytes); send fewer texts per request"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _problem(send, 413, f"request body of {int(declared)} bytes: {limit}")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _problem(send, 413, f"request body of more than {self.max_body_bytes} bytes: {limit}")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            await _problem(send, 422, f"request body is not valid UTF-8 (byte {exc.start}): send UTF-8 JSON")
            return
        if body.strip() and (problem := strict_json_problem(body)) is not None:
            await _problem(send, 422, f"request body is not strict JSON: {problem}")
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def host_name(header: str) -> str:
    """The name or address of a Host header, without its port.

    >>> host_name("localhost:50050"), host_name("[::1]:8080"), host_name("127.0.0.1"), host_name("::1")
    ('localhost', '::1', '127.0.0.1', '::1')
    """
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class LoopbackHostMiddleware:
    """Refuses (421) a request whose Host header is not localhost or a loopback address: see the module's docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not is_loopback(host_name(host)):
                await _problem(
                    send,
                    421,
                    f"this server listens on loopback and answers only requests addressed to localhost, 127.0.0.1 or "
                    f"[::1] (any port), not to Host {_shown(host, 100)!r}: use one of those in the URL, or serve "
                    f"other machines by binding beyond loopback with {REWARD_TOKEN_ENV} set",
                )
                return
        await self.app(scope, receive, send)
