"""The FastAPI app: OpenAI endpoints, health, metrics, errors, auth, body limits."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException

from mmserve.config import ServerConfig
from mmserve.multimodal import precomputed
from mmserve.multimodal.errors import MediaError
from mmserve.multimodal.messages import parse_messages
from mmserve.multimodal.precomputed import EmbedsRef
from mmserve.server.engine_client import EngineClient
from mmserve.server.metrics import ServerMetrics
from mmserve.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from mmserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, usage
from mmserve.server.serving import Generation
from mmserve.transport import cluster_auth
from mmserve.transport.cluster_auth import HTTP_HEADER
from mmserve.transport.messages import KvTarget as MKvTarget
from mmserve.transport.messages import MediaItemMsg

logger = logging.getLogger("mmserve.server")
DISCONNECT_POLL_S = 0.5

# The OpenAI handlers read the raw Request (to answer bad JSON with our own 400), so FastAPI cannot infer
# their body schemas: `openapi_extra` references these, and `build_app` adds them to /openapi.json.
_BODY_REFS, _BODY_SCHEMAS = models_json_schema(
    [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
    ref_template="#/components/schemas/{model}",
)


def _json_body(model: type) -> dict[str, Any]:
    schema = _BODY_REFS[(model, "validation")]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def build_app(
    cfg: ServerConfig, client: EngineClient, tokenizer, family, metrics: ServerMetrics, dispatcher=None
) -> FastAPI:
    app = FastAPI(title="mmserve", version="0.1.0")
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_request_body_bytes)
    ids = itertools.count()

    def error_response(err: APIError) -> JSONResponse:
        metrics.record_error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, err: HTTPException):
        # Unknown paths (404) and methods (405) get the same error shape as every other answer.
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        return error_response(APIError(err.status_code, f"{err.detail}", code, headers=err.headers))

    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        schema = fastapi_openapi()  # built once and cached by FastAPI; adding the body models is idempotent
        schema.setdefault("components", {}).setdefault("schemas", {}).update(_BODY_SCHEMAS["$defs"])
        return schema

    app.openapi = openapi

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError):
        problems = []
        for e in err.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            msg = "not supported by this server" if e.get("type") == "extra_forbidden" else e.get("msg")
            problems.append(f"{loc or 'body'}: {msg}")
        return error_response(APIError(400, "; ".join(problems) or "invalid request", "invalid_request"))

    if cfg.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=cfg.api_key, on_error=metrics.record_error)

    # -- helpers ----------------------------------------------------------------------------------
    max_model_len = client.ready.max_model_len

    def check_model(name: str | None) -> None:
        if name is not None and name != cfg.served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {cfg.served_model_name!r}",
                           "model_not_found")  # fmt: skip

    # NOTE: a request counts in `client.num_in_flight` only once its engine stream starts, a few event-loop
    # steps after `check_capacity`; `admitting` covers that gap, else a burst arriving at once all passes.
    admitting: set[str] = set()

    def check_capacity() -> None:
        if client.dead:
            raise APIError(503, "the engine process is not running", "engine_unavailable")
        # The API server's own in-flight count is exact and immediate (engine stats lag by a step).
        starting = sum(1 for rid in admitting if not client.is_in_flight(rid))
        if client.num_in_flight + starting >= client.cfg.max_num_seqs + cfg.max_waiting_requests:
            raise APIError(
                503, "server is at capacity; retry later", "queue_full", headers={"Retry-After": "1"}
            )

    def require_cache_salt(body) -> None:
        if cfg.cache_salt_required and body.cache_salt is None:
            message = (
                "cache_salt is required by this server (--cache-salt-required): a non-empty string "
                "naming the tenant whose caches this request may use"
            )
            raise APIError(400, message, "missing_cache_salt")

    def max_tokens_of(body) -> int | None:
        requested = body.requested_max_tokens
        if requested is not None and requested >= max_model_len:
            raise APIError(
                400,
                f"max_tokens={requested} is not below the model's context length ({max_model_len})",
                "invalid_parameter",
            )
        return requested

    def tokenize(text: str) -> list[int]:
        # JSON allows a lone "\ud800" escape, which is not text: the tokenizer would raise TypeError (a 500).
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, "the prompt contains an unpaired UTF-16 surrogate (not valid Unicode text)",
                           "invalid_prompt") from e  # fmt: skip
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    async def parse(request: Request, model_cls):
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", "invalid_json") from e
        if not isinstance(raw, dict):
            raise APIError(400, "request body must be a JSON object", "invalid_request")
        try:
            return model_cls.model_validate(raw)
        except Exception as e:  # pydantic.ValidationError
            raise RequestValidationError(e.errors()) from e

    async def run_with_disconnect(request: Request, coro):
        """Await `coro`, cancelling it (and so aborting the engine request) if the client goes away."""
        task = asyncio.ensure_future(coro)
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not done and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", "client_closed")
        return task.result()

    # -- OpenAI endpoints -------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "mmserve", "max_model_len": max_model_len}]}  # fmt: skip

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat(request: Request):
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        check_model(body.model)
        require_cache_salt(body)
        try:
            template, media = parse_messages(body.messages)
        except (ValueError, MediaError) as e:
            raise APIError(400, str(e), "invalid_messages") from e
        embeds = [ref.where for _, ref in media if isinstance(ref, EmbedsRef)]
        if embeds and not cfg.enable_mm_embeds:
            disabled = "precomputed embeddings are disabled on this server; start it with --enable-mm-embeds"
            raise APIError(400, f"{embeds[0]}: {disabled}", "embeds_disabled")
        limits = cfg.mm_limits
        for modality in {mod for mod, _ in media}:
            count = sum(1 for mod, _ in media if mod == modality)
            if count > limits.get(modality.value, 0):
                raise APIError(400, f"{count} {modality.value} item(s) in the prompt; at most "
                                    f"{limits.get(modality.value, 0)} allowed (--limit-mm-per-prompt)", "too_many_items")  # fmt: skip
        try:
            text = tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template that rejects the conversation (e.g. bad role order)
            raise APIError(400, f"chat template failed: {e}", "invalid_messages") from e
        prompt_ids = tokenize(text)
        for modality, _ in media:
            if modality not in family.modalities:
                raise APIError(
                    400,
                    f"this model takes no {modality.value} input (it takes "
                    f"{', '.join(sorted(m.value for m in family.modalities))})",
                    "unsupported_media",
                )
        settings = family.item_settings([mod for mod, _ in media])

        def item_msgs() -> list[MediaItemMsg]:  # precomputed embeddings are decoded and checked here
            return [
                precomputed.item_msg(family, mod, ref, s, cfg.max_mm_embeds_bytes, body.cache_salt)
                if isinstance(ref, EmbedsRef)
                else MediaItemMsg(mod.value, url=ref.url, data=ref.data, settings=s)
                for (mod, ref), s in zip(media, settings, strict=True)
            ]

        try:  # decoding and checking embeddings is CPU work: off the event loop
            items = await asyncio.to_thread(item_msgs) if embeds else item_msgs()
        except MediaError as e:
            raise APIError.of(e.failure) from e
        return await generate(request, body, "chat", prompt_ids, items)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request):
        body: CompletionRequest = await parse(request, CompletionRequest)
        check_model(body.model)
        require_cache_salt(body)
        if isinstance(body.prompt, str):
            prompt_ids = tokenize(body.prompt)
        elif all(isinstance(t, int) for t in body.prompt):
            prompt_ids = list(body.prompt)
            vocab = len(tokenizer)
            if any(t < 0 or t >= vocab for t in prompt_ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "invalid_prompt")
        else:
            raise APIError(400, "prompt must be a string or a list of token ids (batches are not supported)",
                           "invalid_prompt")  # fmt: skip
        return await generate(request, body, "completion", prompt_ids, [])

    def disagg_role(request: Request, body) -> dict:
        """Generation arguments of a prefill or decode server's request (mmserve.disagg). Those servers take
        requests only from the router, which sends `kv_transfer_params` (a control-plane field: it names where
        the KV goes) with the cluster token."""
        params, mode = body.kv_transfer_params, cfg.disaggregation_mode
        if mode == "null":
            if params is not None:
                raise APIError(
                    400,
                    "kv_transfer_params: this server is not a prefill or decode server",
                    "invalid_parameter",
                )
            return {}
        if params is None:
            raise APIError(
                400,
                f"this is a {mode} server of a disaggregated deployment: send requests through "
                "`mmserve router`",
                "disaggregated_server",
            )
        check_control_plane(request)
        if mode == "decode":
            return {"adopt_timeout_s": cfg.kv_adopt_timeout_s, "request_id": params.room}
        if params.decode_bootstrap is None:
            raise APIError(
                400,
                "kv_transfer_params.decode_bootstrap is required by a prefill server",
                "invalid_parameter",
            )
        if params.backend not in client.ready.kv_backends:
            raise APIError(
                400,
                f"kv_transfer_params.backend {params.backend!r} is not available here "
                f"({client.ready.kv_backends})",
                "invalid_parameter",
            )
        return {"handoff": MKvTarget(params.room, params.decode_bootstrap, params.backend)}

    async def generate(request: Request, body, kind: str, prompt_ids: list[int], items: list[MediaItemMsg]):
        role = disagg_role(request, body)
        if len(prompt_ids) >= max_model_len:
            raise APIError(400, f"prompt has {len(prompt_ids)} tokens; the model's context is {max_model_len}",
                           "context_length_exceeded")  # fmt: skip
        max_tokens_of(body)
        if ignored := body.ignored_fields():
            logger.warning("request fields %s accepted and ignored (they cannot change the output)", ignored)
        params = body.sampling_params()
        check_capacity()
        request_id = role.pop("request_id", None) or f"{kind}-{uuid.uuid4().hex[:12]}-{next(ids)}"
        if client.is_in_flight(request_id) or request_id in admitting:
            raise APIError(409, f"kv_transfer_params.room {request_id!r} is already in use", "duplicate_room")
        gen = Generation(
            client,
            tokenizer,
            metrics,
            request_id,
            prompt_ids,
            items,
            params,
            dispatcher,
            cache_salt=body.cache_salt,
            **role,
        )
        admitting.add(gen.request_id)
        try:
            await run_with_disconnect(request, gen.start())
            if gen.handoff is not None:  # prefill server: answer once the decode engine has the request
                done = await run_with_disconnect(request, gen.handed_off())
        finally:
            admitting.discard(gen.request_id)
        if gen.handoff is not None:
            return {
                "id": gen.request_id,
                "object": "kv_handoff",
                "kv_transfer": {
                    "room": gen.handoff.room,
                    "backend": gen.handoff.backend,
                    "kv_bytes": done.kv_bytes,
                    "transfer_s": round(done.transfer_s, 6),
                    "decode_bootstrap": gen.handoff.bootstrap,
                },
                "usage": usage(gen.prompt_tokens, 0, gen.cached_tokens),
                "mmserve": gen.extra(),
            }
        created, model = int(time.time()), cfg.served_model_name
        if body.stream:
            return StreamingResponse(stream(gen, kind, created, model, body.include_usage),
                                     media_type="text/event-stream")  # fmt: skip

        async def collect() -> str:
            return "".join([d async for d in gen.deltas()])

        text = await run_with_disconnect(request, collect())
        payload = {"id": gen.request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
                   "created": created, "model": model,
                   "usage": usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens), "mmserve": gen.extra()}  # fmt: skip
        if kind == "chat":
            payload["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": gen.finish_reason, "logprobs": None}]  # fmt: skip
        else:
            payload["choices"] = [
                {"index": 0, "text": text, "finish_reason": gen.finish_reason, "logprobs": None}
            ]
        return payload

    async def stream(
        gen: Generation, kind: str, created: int, model: str, include_usage: bool
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choice: dict[str, Any] | None, **extra) -> str:
            data = {"id": gen.request_id, "object": obj, "created": created, "model": model,
                    "choices": [choice] if choice is not None else [], **extra}  # fmt: skip
            return f"data: {json.dumps(data)}\n\n"

        def choice(text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
            if kind == "chat":
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        try:
            if kind == "chat":
                yield chunk(choice("", None, first=True))
            async for delta in gen.deltas():
                yield chunk(choice(delta, None))
            yield chunk(choice("", gen.finish_reason), mmserve=gen.extra())
            if include_usage:
                yield chunk(None, usage=usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
        except APIError as e:  # the engine died mid-stream: tell the client in-band
            metrics.record_error(e.status)
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    # -- encoder registry -------------------------------------------------------------------------
    async def encoder_url(request: Request) -> tuple[str, dict]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON: {e}", "invalid_json") from e
        url = body.get("url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise APIError(400, 'body must be {"url": "http(s)://host:port"}', "invalid_encoder_url")
        return url.rstrip("/"), body

    secret = cluster_auth.from_config(cfg.cluster_secret)
    closed = (
        "the control plane (encoder registration, listings, prefill-decode handoffs) is off: this server has no cluster secret. Set --cluster-secret "
        "(or $MMSERVE_CLUSTER_SECRET) on the server and its encoders, or start the server with "
        "--enable-anonymous-registration"
    )

    def check_control_plane(request: Request) -> None:
        """Gate of the control plane, checked before the body is read. These routes choose where users' media
        is sent and disclose internal endpoints, so the API key (a client credential) never opens them: with
        a cluster secret, its token (401 without it); without one, nothing (403) unless the operator started
        the server with --enable-anonymous-registration."""
        if secret is not None:
            if not secret.check_token(request.headers.get(HTTP_HEADER)):
                raise APIError(
                    401, f"missing or invalid {HTTP_HEADER} (cluster secret)", "invalid_cluster_token"
                )
        elif not cfg.anonymous_control_plane:
            raise APIError(403, closed, "control_plane_disabled", "permission_error")

    @app.post("/register_encoder")
    async def register_encoder(request: Request):
        check_control_plane(request)
        url, body = await encoder_url(request)
        registry = dispatcher.registry
        if body.get("heartbeat") and registry.is_unregistered(url):
            raise APIError(409, f"encoder {url} was unregistered; register it explicitly to bring it back",
                           "encoder_unregistered")  # fmt: skip
        if body.get("heartbeat") and registry.get(url) is not None:
            registry.record_success(url)
        else:
            registry.register(url)
        return {"url": url, "registered": True}

    @app.post("/unregister_encoder")
    async def unregister_encoder(request: Request):
        check_control_plane(request)
        url, _ = await encoder_url(request)
        if not dispatcher.registry.unregister(url):
            raise APIError(404, f"encoder {url} is not registered", "encoder_not_found")
        return {"url": url, "registered": False}

    @app.get("/encoders")
    async def encoders(request: Request):
        check_control_plane(request)
        return {"encoders": [e.as_json() for e in dispatcher.registry.all()], "routing": cfg.encoder_routing,
                "embedding_endpoint": dispatcher.routes.endpoints["tcp"],
                "embedding_endpoints": dict(dispatcher.routes.endpoints), "transport": dispatcher.routes.transport, "failovers": dispatcher.failovers,
                "local_fallbacks": dispatcher.local_fallbacks}  # fmt: skip

    @app.get("/disagg/info")
    async def disagg_info(request: Request):
        """What `mmserve router` needs to know about this server (a control-plane route)."""
        check_control_plane(request)
        ready = client.ready
        return {
            "mode": cfg.disaggregation_mode,
            "model": cfg.served_model_name,
            "bootstrap": ready.kv_bootstrap,
            "kv_backends": list(ready.kv_backends),
            "max_model_len": ready.max_model_len,
            "kv_cache_tokens": ready.kv_cache_tokens,
            "has_tower": ready.has_tower,  # a decode server never loads vision or audio weights
        }

    # -- operations -------------------------------------------------------------------------------
    @app.get("/health")
    async def health(check_integrity: bool = False):
        """200 while the engine answers. `?check_integrity=true` also checks the engine's KV pool, prefix
        cache and embedding cache invariants (500 if broken) and reports their occupancy."""
        stats = await client.ping(timeout_s=2.0, check_integrity=check_integrity)
        if stats is None:
            return JSONResponse({"status": "unhealthy", "reason": "engine did not answer"}, status_code=503)
        if not check_integrity:
            return {"status": "ok"}
        body = {
            "status": "ok" if stats.integrity_error == "" else "corrupt",
            "integrity_error": stats.integrity_error or None,
            "kv_slots_used": stats.kv_slots_used,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "in_flight": client.num_in_flight,
            "parts_received": stats.parts_received,
            "parts_dropped": stats.parts_dropped,
            "parts_forged": stats.parts_forged,
            "parts_replayed": stats.parts_replayed,
            "transfer_held_bytes": stats.transfer_held_bytes,
            "kv_handoffs": stats.kv_handoffs,
            "kv_handoff_failures": stats.kv_handoff_failures,
            "kv_bytes": stats.kv_bytes,
            "kv_pending": stats.kv_pending,
        }
        return JSONResponse(body, status_code=200 if stats.integrity_error == "" else 500)

    @app.get("/metrics")
    async def prometheus():
        fresh = await client.ping(timeout_s=1.0)
        metrics.update_engine(fresh or client.stats)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app
