"""Client of the reward server, with the same protocol as in-process scoring (`core.scoring.ScoringBackend`).

- Retries only what waiting can fix, with exponential backoff (`reward.retries`, `reward.backoff_s`): connection
  errors, timeouts, a connection closed before the answer, and 502/503/504 (a proxy without its server, a
  server still loading or restarting). A 4xx is the caller's mistake and fails at once with the server's
  message. So does a 500: the server answers every malformed request with a 4xx and every unready state with
  a 503, so a 500 is its scorer failing on these very texts, which the same request would meet again; retrying
  would spend the whole backoff and then report the server as down. The error names the request id, under
  which the server logged the failure.
- After the last retry it raises `RewardServiceError`, which fails the score stage; nothing of the stage is
  recorded, so `redteam-grpo run --resume RUN_DIR` re-runs it once the server is back.
- Before the first request it waits for GET /ready and checks that the server serves the scorer (and label,
  and embedder) the run config names: a run never mixes scores of two models silently. Every response's
  scorer name and revision is checked against that first answer too (a server restarted with another model).
- Splits large batches to stay under the server's advertised limits.
- Sends the bearer token (REDTEAM_GRPO_REWARD_TOKEN; an empty one is none) on every request, and warns once per
  server when that is over plain http to another machine, where anyone on the path can read it: serve that replica
  with `serve-reward --ssl-certfile ... --ssl-keyfile ...` and give its https:// URL.

The retry loop is the one of `server/retry.py`, shared with the vLLM sampler's client.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import torch

from redteam_grpo.core.config import RewardConfig
from redteam_grpo.core.scoring.backend import ServiceInfo
from redteam_grpo.core.scoring.scorers import Context, Goal, ModelInfo, TextScore
from redteam_grpo.server.retry import RETRIED_STATUS, RetriesExhausted, send_with_retries
from redteam_grpo.server.settings import no_empty_token, warn_token_in_clear

log = logging.getLogger("redteam_grpo.reward_client")


class RewardServiceError(RuntimeError):
    """The reward server cannot be used: unreachable after retries, refusing requests, or serving another model."""


class RewardServiceUnavailable(RewardServiceError):
    """The reward server did not answer (or kept answering 502/503/504, or kept loading) through every retry."""


def _model_info(d: dict[str, Any] | None) -> ModelInfo | None:
    return None if d is None else ModelInfo(d["name"], d["revision"], d["kind"], d.get("details") or {})


class RewardClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        get_logger: Callable[[], logging.Logger | logging.LoggerAdapter] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.token = no_empty_token(token)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers, transport=transport)
        self.get_logger = get_logger or (lambda: log)  # called per message: a Prefect run logger is per task run
        self._ready: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, cfg: RewardConfig, url: str, token: str | None, get_logger=None) -> RewardClient:
        return cls(url, token, cfg.timeout_s, cfg.retries, cfg.backoff_s, get_logger)

    def close(self) -> None:
        self.http.close()

    # -- transport ----------------------------------------------------------------------------------------

    def _request(self, method: str, path: str, payload: dict[str, Any] | None = None, retry_status=None):
        """The JSON body of a 2xx answer, after retries (server/retry.py). `retry_status(response)` False on a
        retried status: return None (the caller polls instead)."""
        request_id = uuid.uuid4().hex  # one id for every attempt: the server's log lines carry it
        if self.token:
            warn_token_in_clear(
                self.url, self.get_logger(), "reward server", "serve-reward --ssl-certfile/--ssl-keyfile"
            )

        def on_retry(retry: int, delay: float, last: str) -> None:
            self.get_logger().warning(
                "reward server %s%s: %s; retry %d/%d in %.1f s", self.url, path, last, retry, self.retries, delay
            )

        try:
            response = send_with_retries(
                lambda: self.http.request(method, path, json=payload, headers={"X-Request-ID": request_id}),
                self.retries,
                self.backoff_s,
                describe=lambda response: f"HTTP {response.status_code}: {self._detail(response)}",
                retry_status=retry_status,
                on_retry=on_retry,
            )
        except httpx.TransportError as exc:  # a URL or request no attempt can send (e.g. no http:// scheme)
            raise RewardServiceError(
                f"cannot send a request to reward server {self.url}{path} ({type(exc).__name__}: {exc}); "
                "check reward.url"
            ) from None
        except RetriesExhausted as exc:
            raise RewardServiceUnavailable(
                f"reward server {self.url}{path} failed {self.retries + 1} times; last: {exc.last}. Start it "
                "(`redteam-grpo serve-reward`) or unset reward.url to score in-process, then resume the run "
                "(`redteam-grpo run --resume RUN_DIR`): the score stage is re-run, nothing before it."
            ) from None
        if response.status_code in RETRIED_STATUS:  # declined by retry_status
            return None
        if response.status_code >= 500:
            raise RewardServiceError(
                f"reward server {self.url}{path} failed on the request (HTTP {response.status_code}, "
                f"request id {request_id}): {self._detail(response)}. Not retried: the same texts would fail "
                "again. The server's log holds the error under that request id."
            )
        if response.status_code >= 400:
            raise RewardServiceError(
                f"reward server {self.url}{path} refused the request (HTTP {response.status_code}): "
                f"{self._detail(response)}"
            )
        return response.json()

    @staticmethod
    def _detail(response: httpx.Response) -> str:
        try:
            return str(response.json().get("detail", response.text))[:500]
        except (json.JSONDecodeError, AttributeError):
            return response.text[:500]

    # -- protocol -----------------------------------------------------------------------------------------

    def ready(self) -> dict[str, Any]:
        """GET /ready: connection errors are retried like any request; "still loading" is polled up to timeout_s."""
        if self._ready is not None:
            return self._ready
        deadline = time.monotonic() + self.timeout_s
        while True:
            body = self._request("GET", "/ready", retry_status=lambda r: "still loading" not in self._detail(r))
            if body is not None:
                self._ready = body
                return body
            if time.monotonic() > deadline:
                raise RewardServiceUnavailable(
                    f"reward server {self.url} is still loading its models after {self.timeout_s:.0f} s "
                    "(reward.timeout_s); wait for GET /ready and resume the run"
                )
            time.sleep(0.5)

    def describe(self) -> ServiceInfo:
        service = self.ready()["service"]
        return ServiceInfo(_model_info(service["scorer"]), _model_info(service["embedder"]), service["refusal"])

    def verify(self, cfg: RewardConfig) -> None:
        """The server serves what `cfg` asks for, or an error that says what differs."""
        info = self.describe()
        served = info.scorer
        problems = []
        if served.name != cfg.scorer:
            problems.append(f"it serves scorer {served.name!r}, reward.scorer is {cfg.scorer!r}")
        if served.kind == "classifier" and served.details.get("label") != cfg.toxic_label:
            problems.append(
                f"it scores label {served.details.get('label')!r}, reward.toxic_label is {cfg.toxic_label!r}"
            )
        if cfg.novelty_weight:
            if info.embedder is None:
                problems.append("reward.novelty_weight > 0 needs an embedder: start the server with --embedder")
            elif info.embedder.name != cfg.embedder:
                problems.append(f"its embedder is {info.embedder.name!r}, reward.embedder is {cfg.embedder!r}")
        if problems:
            raise RewardServiceError(
                f"reward server {self.url} does not match the run config: {'; '.join(problems)}. Start the server "
                "with the run's reward settings (`redteam-grpo serve-reward --config RUN_CONFIG`) or change them."
            )

    def _chunks(self, n_items: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
        limits = self.ready()["limits"]
        max_texts, budget = limits["max_texts"], limits["max_body_bytes"] // 2  # JSON escaping can double a text
        out, start, used = [], 0, 0
        for i in range(n_items):
            if i > start and (i - start >= max_texts or used + sizes[i] > budget):
                out.append((start, i))
                start, used = i, 0
            used += sizes[i]
        if n_items:
            out.append((start, n_items))
        return out

    def _check_same_model(self, served: dict[str, Any], expected: ModelInfo | None, what: str) -> None:
        if expected is None or (served["name"], served["revision"]) != (expected.name, expected.revision):
            raise RewardServiceError(
                f"reward server {self.url} now answers with {what} {served['name']}@{served['revision']}, not the "
                f"{expected.name + '@' + expected.revision if expected else 'none'} it announced: it was restarted "
                "with another model. Restart it with the run's model and resume the run."
            )

    def score(
        self, completions: Sequence[str], prompts: Sequence[Context], goals: Sequence[Goal | None] | None = None
    ) -> list[TextScore]:
        expected = self.describe().scorer
        # goals go on the wire only when there are some: a server older than the field refuses unknown fields
        wire_goals = [_wire_goal(g) for g in goals] if goals is not None and any(g is not None for g in goals) else None
        sizes = [len(c.encode()) + _context_bytes(p) + 16 for c, p in zip(completions, prompts, strict=True)]
        if wire_goals is not None:
            sizes = [
                s + len(json.dumps(g, ensure_ascii=False).encode()) for s, g in zip(sizes, wire_goals, strict=True)
            ]
        out: list[TextScore] = []
        for start, end in self._chunks(len(completions), sizes):
            payload: dict[str, Any] = {
                "texts": list(completions[start:end]),
                "prompts": [_wire(p) for p in prompts[start:end]],
            }
            if wire_goals is not None:
                payload["goals"] = wire_goals[start:end]
            body = self._request("POST", "/score", payload)
            self._check_same_model(body["scorer"], expected, "scorer")
            if len(body["results"]) != end - start:
                raise RewardServiceError(
                    f"reward server returned {len(body['results'])} results for {end - start} texts"
                )
            out.extend(
                # a server older than the `truncated` field sends none: it scored or failed every text whole
                TextScore(r["score"], tuple(r["categories"]), bool(r["refusal"]), bool(r.get("truncated", False)))
                for r in body["results"]
            )
        return out

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        expected = self.describe().embedder
        rows: list[list[float]] = []
        for start, end in self._chunks(len(texts), [len(t.encode()) * 2 + 16 for t in texts]):
            body = self._request("POST", "/embed", {"texts": list(texts[start:end])})
            self._check_same_model(body["embedder"], expected, "embedder")
            rows.extend(body["embeddings"])
        return torch.tensor(rows, dtype=torch.float32)


class ReplicatedRewardClient:
    """Replicas of one reward server (reward.url as a list), with the protocol of one: each batch is split into one
    contiguous piece per live replica, sent at once, and put back together in order. A replica that is unavailable
    after its own retries (`RewardServiceUnavailable`) is left out for `rest_s`, and its piece is split over the
    replicas that have not failed it; when every replica has failed a piece, the call fails. Any other error (a
    refused request, a scorer failing on the texts, another model) fails the call as with one server. Before its
    first use every replica is checked to serve what the first one does and what the run config names."""

    def __init__(
        self,
        replicas: Sequence[RewardClient],
        get_logger: Callable[[], logging.Logger | logging.LoggerAdapter] | None = None,
        rest_s: float = 60.0,
    ) -> None:
        self.replicas = list(replicas)
        self.get_logger = get_logger or (lambda: log)
        self.rest_s = rest_s
        self._down_until: dict[str, float] = {}
        self._info: ServiceInfo | None = None
        self._cfg: RewardConfig | None = None
        self._admitted: set[str] = set()
        self._lock = threading.Lock()

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def _live(self) -> list[RewardClient]:
        now = time.monotonic()
        live = [r for r in self.replicas if self._down_until.get(r.url, 0.0) <= now]
        if not live:
            raise RewardServiceUnavailable(
                f"none of the {len(self.replicas)} reward servers ({', '.join(r.url for r in self.replicas)}) "
                "answers. Start them, then resume the run (`redteam-grpo run --resume RUN_DIR`)"
            )
        return live

    def _mark_down(self, replica: RewardClient, exc: BaseException) -> None:
        with self._lock:
            self._down_until[replica.url] = time.monotonic() + self.rest_s
        self.get_logger().warning(
            "reward server %s left out for %.0f s (%s); its texts go to the other replicas",
            replica.url,
            self.rest_s,
            exc,
        )

    def _admit(self, replica: RewardClient) -> None:
        """Check a replica before its first use: it serves what the first replica served, and the run config."""
        if replica.url in self._admitted:
            return
        info = replica.describe()  # RewardServiceUnavailable: down, left out
        with self._lock:
            if self._info is None:
                self._info = info
        if _served(info) != _served(self._info):
            raise RewardServiceError(
                f"reward server {replica.url} serves {_served(info)}, another replica {_served(self._info)}: start "
                "every replica with the run's reward settings (`redteam-grpo serve-reward --config RUN_CONFIG`)"
            )
        if self._cfg is not None:
            replica.verify(self._cfg)
        with self._lock:
            self._admitted.add(replica.url)

    def describe(self) -> ServiceInfo:
        """What the replicas serve; every live one is checked to serve the same (scorer, label, embedder, refusal)."""
        for replica in self._live():
            try:
                self._admit(replica)
            except RewardServiceUnavailable as exc:
                self._mark_down(replica, exc)
        if self._info is None:
            self._live()  # every replica is down: raises
        assert self._info is not None
        return self._info

    def verify(self, cfg: RewardConfig) -> None:
        """Every replica serves what `cfg` names (a replica down now is checked when it is first used)."""
        self._cfg = cfg
        self._admitted.clear()
        self.describe()

    def _spread(self, n: int, call: Callable[[RewardClient, int, int], list]) -> list:
        """`call(replica, start, end)` over contiguous pieces of the `n` items, one per live replica, in parallel. A
        piece whose replica is unavailable is split over the live replicas that have not failed it; the results in
        item order."""
        from concurrent.futures import ThreadPoolExecutor

        self.describe()
        results: dict[tuple[int, int], list] = {}
        pending: list[tuple[tuple[int, int], frozenset[str]]] = [((0, n), frozenset())] if n else []

        def attempt(replica: RewardClient, start: int, end: int) -> list:
            self._admit(replica)
            return call(replica, start, end)

        while pending:
            live = self._live()
            jobs = []
            for (start, end), tried in pending:
                candidates = [r for r in live if r.url not in tried]
                if not candidates:
                    raise RewardServiceUnavailable(
                        f"texts {start}..{end - 1} of the batch failed on every reward server that answers "
                        f"({', '.join(sorted(tried))}). Start them, then resume the run"
                    )
                for (a, b), replica in zip(_pieces(end - start, len(candidates)), candidates, strict=False):
                    jobs.append(((start + a, start + b), tried, replica))
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                futures = [pool.submit(attempt, replica, *piece) for piece, _, replica in jobs]
            pending = []
            for (piece, tried, replica), future in zip(jobs, futures, strict=True):
                try:
                    results[piece] = future.result()
                except RewardServiceUnavailable as exc:
                    self._mark_down(replica, exc)
                    pending.append((piece, tried | {replica.url}))
        return [item for piece in sorted(results) for item in results[piece]]

    def score(
        self, completions: Sequence[str], prompts: Sequence[Context], goals: Sequence[Goal | None] | None = None
    ) -> list[TextScore]:
        return self._spread(
            len(completions),
            lambda r, a, b: r.score(completions[a:b], prompts[a:b], None if goals is None else goals[a:b]),
        )

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        rows = self._spread(len(texts), lambda r, a, b: r.embed(texts[a:b]).tolist())
        return torch.tensor(rows, dtype=torch.float32)


def _served(info: ServiceInfo | None) -> str:
    """What a reward server serves, comparable between replicas: models by name, revision and details, refusal."""
    if info is None:
        return ""

    def model(m: ModelInfo | None) -> str:
        return "none" if m is None else f"{m.name}@{m.revision} {json.dumps(m.details, sort_keys=True)}"

    refusal = json.dumps(info.refusal, sort_keys=True, default=str)
    return f"scorer {model(info.scorer)}, embedder {model(info.embedder)}, refusal {refusal}"


def _wire(context: Context) -> str | list[dict[str, str]]:
    """A context as JSON sends it: a prompt as is, a conversation as a list of {role, content} objects."""
    return context if isinstance(context, str) else [{"role": m["role"], "content": m["content"]} for m in context]


def _wire_goal(goal: Goal | None) -> dict[str, str | None] | None:
    return None if goal is None else {"text": goal.text, "context": goal.context}


def _context_bytes(context: Context) -> int:
    return len(json.dumps(_wire(context), ensure_ascii=False).encode())


def _pieces(n: int, parts: int) -> list[tuple[int, int]]:
    """`n` items as at most `parts` contiguous (start, end) pieces of sizes within one.

    >>> _pieces(5, 2), _pieces(1, 3), _pieces(0, 2)
    ([(0, 3), (3, 5)], [(0, 1)], [])
    """
    parts = max(1, min(parts, n))
    size, longer = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts if n else 0):
        end = start + size + (k < longer)
        bounds.append((start, end))
        start = end
    return bounds
