"""What every route of the API server shares: config, engine client, tokenizer, family, metrics, dispatcher,
and the checks that several routes make (model name, capacity, control-plane gate, request parsing).

Built once by `build_app` and stored on `app.state`; routes get it with `Depends(app_state)`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from mmserve.config import ServerConfig
from mmserve.server.disconnect import watch_disconnect
from mmserve.server.engine_client import EngineClient
from mmserve.server.logprob_format import TokenStrings
from mmserve.server.metrics import ServerMetrics
from mmserve.server.protocol import APIError
from mmserve.server.reasoning import ReasoningParser, reasoning_parser
from mmserve.server.tool_parsers import ToolParser, get_parser, resolve_tool_call_parser
from mmserve.server.tools import ToolRequest, template_renders_tools, tool_grammar_tools
from mmserve.transport import cluster_auth
from mmserve.transport.cluster_auth import HTTP_HEADER

T = TypeVar("T")

CONTROL_PLANE_CLOSED = (
    "the control plane (encoder registration, listings, prefill-decode handoffs) is off: this server has no "
    "cluster secret. Set --cluster-secret (or $MMSERVE_CLUSTER_SECRET) on the server and its encoders, or start "
    "the server with --enable-anonymous-registration"
)


@dataclass
class AppState:
    cfg: ServerConfig
    client: EngineClient
    tokenizer: Any  # a Hugging Face tokenizer
    family: Any  # mmserve.models.family.ModelFamily
    metrics: ServerMetrics
    dispatcher: Any = None  # mmserve.dispatch.dispatcher.Dispatcher
    encoder_workers: Any = None  # mmserve.server.encoder_workers.EncoderWorkers (--encoder-workers)
    # NOTE: a request counts in `client.num_in_flight` only once its engine stream starts, a few event-loop
    # steps after `check_capacity`; `admitting` covers that gap, else a burst arriving at once all passes.
    admitting: set[str] = field(default_factory=set)
    ids: Iterator[int] = field(default_factory=itertools.count)
    secret: cluster_auth.ClusterSecret | None = field(init=False)

    token_strings: TokenStrings = field(init=False)  # logprobs' token texts, cached
    reasoning: ReasoningParser | None = field(init=False)  # --reasoning-parser, for chat answers
    tool_call_parser: str = field(init=False)  # --tool-call-parser, or the one this model's prompts call for

    def __post_init__(self) -> None:
        self.secret = cluster_auth.from_config(self.cfg.cluster_secret)
        self.token_strings = TokenStrings(self.tokenizer)
        name = self.cfg.reasoning_parser
        self.reasoning = reasoning_parser(name, self.tokenizer) if name is not None else None
        self.tool_call_parser = resolve_tool_call_parser(
            self.cfg.tool_call_parser, self.family, template_renders_tools(self.tokenizer)
        )

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    def tool_parser_class(self, tools: ToolRequest | None) -> type[ToolParser] | None:
        """The parser of a request's output (None: no tools, or tool_choice "none"). Output constrained by
        tool_choice "required" or a named function is Hermes-shaped whatever the model's own format
        (mmserve.engine.grammar.tool_call_grammar writes that grammar), so it is read as hermes."""
        if tools is None or not tools.parses_output:
            return None
        return get_parser("hermes" if tool_grammar_tools(tools) is not None else self.tool_call_parser)

    def tool_parser_for(self, tools: ToolRequest | None) -> Callable[[], ToolParser] | None:
        """A fresh parser per choice, typed by the request's tools (see `tool_parser_class`)."""
        parser = self.tool_parser_class(tools)
        return None if parser is None else partial(parser, tools.tools)

    def error_response(self, err: APIError) -> JSONResponse:
        self.metrics.record_error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    # -- checks ---------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        """404 unless `name` is None or one of the served names (the primary one or an alias)."""
        names = self.cfg.served_model_names
        if name is not None and name not in names:
            served = ", ".join(repr(n) for n in names)
            raise APIError(
                404, f"model {name!r} does not exist; this server serves {served}", "model_not_found"
            )

    def check_capacity(self) -> None:
        client = self.client
        if client.dead:
            raise APIError(503, "the engine process is not running", "engine_unavailable")
        # The API server's own in-flight count is exact and immediate (engine stats lag by a step).
        starting = sum(1 for rid in self.admitting if not client.is_in_flight(rid))
        if client.num_in_flight + starting >= client.cfg.max_num_seqs + self.cfg.max_waiting_requests:
            raise APIError(
                503, "server is at capacity; retry later", "queue_full", headers={"Retry-After": "1"}
            )

    def require_cache_salt(self, body) -> None:
        if self.cfg.cache_salt_required and body.cache_salt is None:
            message = (
                "cache_salt is required by this server (--cache-salt-required): a non-empty string "
                "naming the tenant whose caches this request may use"
            )
            raise APIError(400, message, "missing_cache_salt")

    def max_tokens_of(self, body) -> int | None:
        requested = body.requested_max_tokens
        if requested is not None and requested >= self.max_model_len:
            raise APIError(
                400,
                f"max_tokens={requested} is not below the model's context length ({self.max_model_len})",
                "invalid_parameter",
            )
        return requested

    def check_control_plane(self, request: Request) -> None:
        """Gate of the control plane, checked before the body is read. These routes choose where users' media
        is sent and disclose internal endpoints, so the API key (a client credential) never opens them: with
        a cluster secret, its token (401 without it); without one, nothing (403) unless the operator started
        the server with --enable-anonymous-registration."""
        if self.secret is not None:
            if not self.secret.check_token(request.headers.get(HTTP_HEADER)):
                raise APIError(
                    401, f"missing or invalid {HTTP_HEADER} (cluster secret)", "invalid_cluster_token"
                )
        elif not self.cfg.anonymous_control_plane:
            raise APIError(403, CONTROL_PLANE_CLOSED, "control_plane_disabled", "permission_error")

    # -- requests -------------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # JSON allows a lone "\ud800" escape, which is not text: the tokenizer would raise TypeError (a 500).
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            message = "the prompt contains an unpaired UTF-16 surrogate (not valid Unicode text)"
            raise APIError(400, message, "invalid_prompt") from e
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def new_request_id(self, kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex[:12]}-{next(self.ids)}"

    async def run_with_disconnect(self, request: Request, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, cancelling it (and so aborting the engine request) as soon as the client goes
        away: 499. The request's body must have been read (see mmserve.server.disconnect)."""
        task = asyncio.ensure_future(awaitable)
        gone = watch_disconnect(request)
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():  # the client left, or this handler itself was cancelled
                task.cancel()
        if not task.done() or task.cancelled():
            raise APIError(499, "client disconnected", "client_closed")
        return task.result()


async def json_object(request: Request) -> dict[str, Any]:
    """The JSON object in the body: 415 for a body declared as something else (curl's `-d` sends a form
    type: never parsed as JSON behind the client's back, as in vLLM), 400 for bad JSON or another JSON value.
    A body without a Content-Type is read as JSON."""
    declared = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if declared and declared != "application/json" and not declared.endswith("+json"):
        message = f"Content-Type {declared!r} is not supported: send the body as application/json"
        raise APIError(415, message, "unsupported_media_type")
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", "invalid_json") from e
    if not isinstance(raw, dict):
        raise APIError(400, "request body must be a JSON object", "invalid_request")
    return raw


def validate(raw: dict[str, Any], model_cls: type[T]) -> T:
    """`raw` as `model_cls`; field errors as RequestValidationError (a 400 naming the fields)."""
    try:
        return model_cls.model_validate(raw)
    except Exception as e:  # pydantic.ValidationError
        raise RequestValidationError(e.errors()) from e


async def parse(request: Request, model_cls: type[T]) -> T:
    """The JSON body validated as `model_cls` (see `json_object`, `validate`)."""
    return validate(await json_object(request), model_cls)


def app_state(request: Request) -> AppState:
    """FastAPI dependency: the server's state."""
    return request.app.state.mmserve
