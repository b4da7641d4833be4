"""The reward server: FastAPI around a `ScoringBackend` (harm scorer, refusal detector, optional embedder).

    POST /score   {"texts": [...], "prompts": [...]}  -> one {score, categories, refusal, truncated} per text
                  a prompt is a string, or the conversation before its text: [{"role": "user", "content": ...}, ...]
    POST /embed   {"texts": [...]}                     -> one unit-norm embedding per text (novelty)
    GET  /health  the process answers                  GET /ready  the models are loaded (503 until then)

Models load in a background thread after start-up, so /health answers at once and /ready says when to send
work. Concurrent requests are micro-batched on the model (server/batching.py). Every response carries the
scorer's name and revision and an `X-Request-ID` (the client's, or a new one), which the log lines carry too.
Limits (texts per request, characters per text, body bytes) answer 413/422 with a message that names the
limit, and a full queue (texts waiting for the model) 503 with Retry-After. A bearer token, when configured, is
compared in constant time; without it /ready says only whether the server is ready, not which models it loaded
or why they failed. A server on loopback answers only requests addressed to a loopback name (server/limits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from redteam_grpo.core.scoring.backend import ScoringBackend
from redteam_grpo.core.scoring.scorers import Goal, ScorerError, conversation
from redteam_grpo.server.batching import MicroBatcher, QueueFull
from redteam_grpo.server.limits import BodyLimitMiddleware, LoopbackHostMiddleware
from redteam_grpo.server.settings import REWARD_TOKEN_ENV, ServerSettings

log = logging.getLogger("redteam_grpo.server")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: StrictStr


class GoalIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: StrictStr = Field(description="The goal: the request before any jailbreak.")
    context: StrictStr | None = Field(None, description="A HarmBench contextual behavior's context string.")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[StrictStr] = Field(min_length=1, description="Completions to score.")
    prompts: list[StrictStr | list[ChatMessage]] | None = Field(
        None,
        description="What each completion answers (same length as texts): its prompt, or the conversation before it "
        "as messages alternating user and assistant from a user message and ending with one (a multi-turn dialogue; "
        "a judge assesses the completion in its light). A safety judge needs them.",
    )
    goals: list[GoalIn | None] | None = Field(
        None,
        description="What each attack was after, where it is known apart from the prompt (same length as texts; null "
        "for none): judges that read the request before any jailbreak (HarmBench's behavior, StrongREJECT's "
        "forbidden prompt) are told the goal; the others ignore it.",
    )


class EmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[StrictStr] = Field(min_length=1, description="Texts to embed.")


class ModelInfoOut(BaseModel):
    name: str
    revision: str
    kind: str
    details: dict[str, Any] = {}


class TextResult(BaseModel):
    score: float | None = Field(description="Probability of harm in [0, 1]; null when the scorer gave none.")
    categories: list[str] = Field(description="Hazard category codes of a judge's verdict (e.g. S10).")
    refusal: bool = Field(description="The text opens as a refusal.")
    truncated: bool = Field(
        False,
        description="The scorer read only the beginning of the text: it was longer than the scorer's maximum "
        "length in tokens (details.max_length of the scorer).",
    )


class ScoreResponse(BaseModel):
    results: list[TextResult]
    scorer: ModelInfoOut
    request_id: str


class EmbedResponse(BaseModel):
    embeddings: list[list[float]]
    embedder: ModelInfoOut
    request_id: str


class Problem(BaseModel):
    detail: str


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "Missing or wrong bearer token."},
    409: {"model": Problem, "description": "This server has no embedder."},
    413: {"model": Problem, "description": "Too many texts or too large a body."},
    421: {"model": Problem, "description": "A server on loopback was addressed by another name (Host header)."},
    422: {"model": Problem, "description": "Malformed request (the message names the field and the limit)."},
    503: {
        "model": Problem,
        "description": "The models are still loading (retry), failed to load, or the queue is full (retry after "
        "Retry-After seconds).",
    },
}
QUEUE_FULL_RETRY_AFTER_S = 1  # a batch of the default size takes well under a second on the scorers served


_bearer = HTTPBearer(auto_error=False)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
WRONG_TOKEN = f"missing or wrong bearer token (Authorization: Bearer ${REWARD_TOKEN_ENV})"


def authorize(request: Request, credentials: Credentials) -> None:
    """Require the configured bearer token, compared in constant time (no timing oracle on the token)."""
    token = request.app.state.settings.token
    if token is None:
        return
    given = credentials.credentials.encode() if credentials else b""
    if not secrets.compare_digest(given, token.get_secret_value().encode()):
        raise HTTPException(401, WRONG_TOKEN)


@dataclass
class Service:
    """What the routes share, kept on `app.state.service`: the settings, the backend once loaded (or the error that
    stopped it loading) and the micro-batchers in front of it."""

    settings: ServerSettings
    load_backend: Callable[[], ScoringBackend]
    backend: ScoringBackend | None = None
    error: str | None = None
    score_batcher: MicroBatcher = field(init=False)
    embed_batcher: MicroBatcher = field(init=False)

    def __post_init__(self) -> None:
        wait = self.settings.max_wait_ms / 1000
        queued = self.settings.max_queued_texts
        self.score_batcher = MicroBatcher(
            lambda items: self.backend.score(
                [c for c, _, _ in items], [p for _, p, _ in items], [g for _, _, g in items]
            ),
            self.settings.max_batch,
            wait,
            queued,
        )
        self.embed_batcher = MicroBatcher(
            lambda texts: list(self.backend.embed(texts)), self.settings.max_batch, wait, queued
        )

    async def load(self) -> None:
        """Load the backend in a worker thread; a failure is kept for /ready, and the process stays up to say so."""
        started = time.perf_counter()
        try:
            self.backend = await asyncio.to_thread(self.load_backend)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("loading the scorer failed: %s", self.error)
            return
        log.info("ready in %.1f s: %s", time.perf_counter() - started, self.backend.describe().scorer)

    def ready_backend(self) -> ScoringBackend:
        if self.error is not None:
            raise HTTPException(503, f"the scorer failed to load: {self.error}")
        if self.backend is None:
            raise HTTPException(503, "the scorer is still loading; poll GET /ready")
        return self.backend

    def check_length(self, text: str, where: str) -> None:
        if len(text) > self.settings.max_chars:
            raise HTTPException(
                422, f"{where} has {len(text)} characters; the limit is {self.settings.max_chars} (--max-chars)"
            )

    def check_texts(self, texts: list[str], field: str) -> None:
        if len(texts) > self.settings.max_texts:
            raise HTTPException(
                413, f"{len(texts)} {field} in one request; the limit is {self.settings.max_texts} (--max-texts)"
            )
        for i, text in enumerate(texts):
            self.check_length(text, f"{field}[{i}]")

    def contexts(self, body: ScoreRequest) -> list[str | list[dict[str, str]]]:
        """Each text's context, checked: its prompt, or a conversation that ends where the text answers it."""
        prompts = body.prompts if body.prompts is not None else [""] * len(body.texts)
        if len(prompts) != len(body.texts):
            raise HTTPException(422, f"{len(prompts)} prompts for {len(body.texts)} texts: send one prompt per text")
        contexts: list[str | list[dict[str, str]]] = []
        for i, (text, prompt) in enumerate(zip(body.texts, prompts, strict=True)):
            if isinstance(prompt, str):
                self.check_length(prompt, f"prompts[{i}]")
                contexts.append(prompt)
                continue
            messages = [m.model_dump() for m in prompt]
            for k, message in enumerate(messages):
                self.check_length(message["content"], f"prompts[{i}][{k}].content")
            try:
                conversation(messages, text)
            except ScorerError as exc:
                raise HTTPException(422, f"prompts[{i}]: {exc}") from None
            contexts.append(messages)
        return contexts

    def goals(self, body: ScoreRequest) -> list[Goal | None]:
        """Each text's goal, checked: one per text, or none sent."""
        if body.goals is None:
            return [None] * len(body.texts)
        if len(body.goals) != len(body.texts):
            raise HTTPException(
                422, f"{len(body.goals)} goals for {len(body.texts)} texts: send one goal (or null) per text"
            )
        out: list[Goal | None] = []
        for i, goal in enumerate(body.goals):
            if goal is not None:
                self.check_length(goal.text, f"goals[{i}].text")
                if goal.context is not None:
                    self.check_length(goal.context, f"goals[{i}].context")
            out.append(None if goal is None else Goal(goal.text, goal.context))
        return out


def service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(service)]
router = APIRouter()


@router.get("/health", summary="The process is up.")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/ready",
    summary="The models are loaded; with the bearer token (or on a server without one), what they are and the "
    "request limits.",
    responses=ERROR_RESPONSES,
)
async def ready(svc: ServiceDep, request: Request, credentials: Credentials) -> dict[str, Any]:
    if svc.settings.token is not None and credentials is None:
        # a probe without the token (a health check, a load balancer): ready or not, no model paths or load errors
        if svc.backend is None:
            raise HTTPException(
                503, f"not ready; send the bearer token (Authorization: Bearer ${REWARD_TOKEN_ENV}) for why"
            )
        return {"ready": True}
    authorize(request, credentials)  # a wrong token is refused, not answered as none
    backend, settings = svc.ready_backend(), svc.settings
    return {
        "ready": True,
        "service": backend.describe().as_dict(),
        "limits": {
            "max_texts": settings.max_texts,
            "max_chars": settings.max_chars,
            "max_body_bytes": settings.max_body_bytes,
        },
        "batching": {
            "max_batch": settings.max_batch,
            "max_wait_ms": settings.max_wait_ms,
            "max_queued_texts": settings.max_queued_texts,
            "queued_texts": svc.score_batcher.queued,
            "batches_run": svc.score_batcher.batches_run,
            "requests_served": svc.score_batcher.requests_served,
        },
    }


async def submit(batcher: MicroBatcher, items: list[Any]) -> list[Any]:
    """The batcher's results, or 503 with Retry-After when its queue is full (the client retries it)."""
    try:
        return await batcher.submit(items)
    except QueueFull as exc:
        raise HTTPException(
            503,
            f"{exc}: retry after {QUEUE_FULL_RETRY_AFTER_S} s, or spread the load over replicas (reward.url as a "
            "list) or raise --max-queued-texts",
            headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)},
        ) from None


@router.post("/score", response_model=ScoreResponse, responses=ERROR_RESPONSES, dependencies=[Depends(authorize)])
async def score(body: ScoreRequest, request: Request, svc: ServiceDep) -> ScoreResponse:
    backend = svc.ready_backend()
    svc.check_texts(body.texts, "texts")
    contexts = svc.contexts(body)
    goals = svc.goals(body)
    scores = await submit(svc.score_batcher, list(zip(body.texts, contexts, goals, strict=True)))
    return ScoreResponse(
        results=[
            TextResult(score=s.harm, categories=list(s.categories), refusal=s.refusal, truncated=s.truncated)
            for s in scores
        ],
        scorer=ModelInfoOut(**backend.describe().scorer.__dict__),
        request_id=request.state.request_id,
    )


@router.post("/embed", response_model=EmbedResponse, responses=ERROR_RESPONSES, dependencies=[Depends(authorize)])
async def embed(body: EmbedRequest, request: Request, svc: ServiceDep) -> EmbedResponse:
    info = svc.ready_backend().describe().embedder
    if info is None:
        raise HTTPException(409, "this server has no embedder: start it with --embedder to serve novelty")
    svc.check_texts(body.texts, "texts")
    rows = await submit(svc.embed_batcher, body.texts)
    return EmbedResponse(
        embeddings=[[float(x) for x in row.tolist()] for row in rows],
        embedder=ModelInfoOut(**info.__dict__),
        request_id=request.state.request_id,
    )


async def request_id(request: Request, call_next):
    """Tag the request and its response with an id (the client's X-Request-ID, or a new one) and log both."""
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    request.state.request_id = rid[:128]
    started = time.perf_counter()
    response = await call_next(request)
    response.headers["X-Request-ID"] = request.state.request_id
    log.info(
        "request_id=%s %s %s -> %d in %.1f ms",
        request.state.request_id,
        request.method,
        request.url.path,
        response.status_code,
        (time.perf_counter() - started) * 1000,
    )
    return response


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    svc: Service = app.state.service
    await svc.score_batcher.start()
    await svc.embed_batcher.start()
    loader = asyncio.create_task(svc.load())
    yield
    loader.cancel()
    await svc.score_batcher.stop()
    await svc.embed_batcher.stop()


def create_app(settings: ServerSettings, load_backend: Callable[[], ScoringBackend]) -> FastAPI:
    """An app that loads its backend with `load_backend` in a worker thread once it starts. Settings that bind beyond
    loopback without a long enough token are refused (ValueError), as `serve-reward` refuses them."""
    settings.check_exposure()
    app = FastAPI(
        title="redteam-grpo reward server",
        summary="Scores completions for red-team GRPO: harm probability, judge categories, refusal flag.",
        version="1",
        lifespan=lifespan,
    )
    app.state.settings = settings  # read by `authorize`
    app.state.service = Service(settings, load_backend)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.on_loopback:  # outside the body check, inside the request log: a refused request is logged
        app.add_middleware(LoopbackHostMiddleware)
    app.middleware("http")(request_id)
    app.include_router(router)
    return app
