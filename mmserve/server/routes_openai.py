"""OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models.

A request goes: parse and check the body, build the prompt (token ids and media items), admit it (capacity,
disaggregation role), start its `Generation`, then answer (mmserve.server.openai_responses). A client that
goes away at any point after the body was read aborts its engine request (`AppState.run_with_disconnect`).
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from pydantic.json_schema import models_json_schema

from mmserve.sampling_params import StructuredOutputs
from mmserve.server.app_state import AppState, app_state, parse
from mmserve.server.chat_prompt import chat_prompt, media_items
from mmserve.server.openai_responses import Answer, collect, handoff_payload, sse_stream
from mmserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, structured_of
from mmserve.server.serving import Generation
from mmserve.server.tools import ToolRequest, parse_tools, tool_grammar_tools
from mmserve.transport.messages import HandedOffMsg, KvTarget, MediaItemMsg

logger = logging.getLogger("mmserve.server")
router = APIRouter()
State = Annotated[AppState, Depends(app_state)]

# The OpenAI handlers read the raw Request (to answer bad JSON with our own 400), so FastAPI cannot infer
# their body schemas: `openapi_extra` references these, and `build_app` adds them to /openapi.json.
_BODY_REFS, BODY_SCHEMAS = models_json_schema(
    [(ChatCompletionRequest, "validation"), (CompletionRequest, "validation")],
    ref_template="#/components/schemas/{model}",
)


def _json_body(model: type) -> dict[str, Any]:
    schema = _BODY_REFS[(model, "validation")]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def model_card(state: AppState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "mmserve",
        "max_model_len": state.max_model_len,
    }


@router.get("/v1/models")
async def models(state: State):
    return {"object": "list", "data": [model_card(state, name) for name in state.cfg.served_model_names]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, state: State):
    if model_id not in state.cfg.served_model_names:
        raise APIError(404, f"The model `{model_id}` does not exist.", "model_not_found")
    return model_card(state, model_id)


@router.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
async def chat(request: Request, state: State):
    body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
    state.check_model(body.model)
    state.require_cache_salt(body)
    tools = parse_tools(
        body.tools, body.tool_choice, body.parallel_tool_calls, state.cfg.enable_auto_tool_choice
    )
    if state.cfg.disaggregation_mode == "decode":  # the prefill server rendered, tokenized and encoded it
        return await generate(request, state, body, "chat", [], [], tools)
    prompt = chat_prompt(
        state, body.messages, tools=tools.tools if tools else None, mm_processor_kwargs=body.mm_processor_kwargs
    )
    items = await media_items(state, prompt, body.cache_salt)
    return await generate(request, state, body, "chat", prompt.prompt_ids, items, tools)


@router.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
async def completions(request: Request, state: State):
    body: CompletionRequest = await parse(request, CompletionRequest)
    state.check_model(body.model)
    state.require_cache_salt(body)
    if isinstance(body.prompt, str):
        prompt_ids = state.tokenize(body.prompt)
    elif all(isinstance(t, int) for t in body.prompt):
        prompt_ids = list(body.prompt)
        vocab = len(state.tokenizer)
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "invalid_prompt")
    else:
        message = "prompt must be a string or a list of token ids (batches are not supported)"
        raise APIError(400, message, "invalid_prompt")
    return await generate(request, state, body, "completion", prompt_ids, [])


def disagg_role(request: Request, state: AppState, body) -> dict:
    """Generation arguments of a prefill or decode server's request (mmserve.disagg). Those servers take
    requests only from the router, which sends `kv_transfer_params` (a control-plane field: it names where
    the KV goes) with the cluster token."""
    params, mode = body.kv_transfer_params, state.cfg.disaggregation_mode
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
            f"this is a {mode} server of a disaggregated deployment: send requests through `mmserve router`",
            "disaggregated_server",
        )
    state.check_control_plane(request)
    if mode == "decode":
        return {"adopt_timeout_s": state.cfg.kv_adopt_timeout_s, "request_id": params.room}
    if params.decode_bootstrap is None:
        raise APIError(
            400,
            "kv_transfer_params.decode_bootstrap is required by a prefill server",
            "invalid_parameter",
        )
    backends = state.client.ready.kv_backends
    if params.backend not in backends:
        raise APIError(
            400,
            f"kv_transfer_params.backend {params.backend!r} is not available here ({backends})",
            "invalid_parameter",
        )
    return {"handoff": KvTarget(params.room, params.decode_bootstrap, params.backend)}


async def generate(
    request: Request,
    state: AppState,
    body: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prompt_ids: list[int],
    items: list[MediaItemMsg],
    tools: ToolRequest | None = None,
):
    """Admit and run one request; the answer is JSON, an SSE stream, or (prefill server) the handoff."""
    gen, done = await start_generation(request, state, body, kind, prompt_ids, items, tools)
    if gen.handoff is not None:
        return handoff_payload(gen, done)
    answer = Answer(
        kind,
        int(time.time()),
        state.cfg.served_model_name,
        state.token_strings,
        logprobs=gen.params.logprobs is not None,
        parse_tools=tools is not None and tools.parses_output,
        single_call=tools is not None and not tools.parallel,
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    if kind == "completion" and body.echo:
        answer.echo, answer.echo_ids = state.tokenizer.decode(prompt_ids), list(prompt_ids)
    if body.stream:
        events = sse_stream(gen, answer, body.include_usage, state.metrics)
        return StreamingResponse(events, media_type="text/event-stream")
    return await state.run_with_disconnect(request, collect(gen, answer))


async def start_generation(
    request: Request,
    state: AppState,
    body: ChatCompletionRequest | CompletionRequest,
    kind: str,
    prompt_ids: list[int],
    items: list[MediaItemMsg],
    tools: ToolRequest | None = None,
) -> tuple[Generation, HandedOffMsg | None]:
    """Check, admit and start one request (its media encoded, queued in the engine). A prefill server's
    request is also handed off: then the HandedOffMsg comes back too."""
    role = disagg_role(request, state, body)
    max_model_len = state.max_model_len
    if len(prompt_ids) >= max_model_len:
        message = f"prompt has {len(prompt_ids)} tokens; the model's context is {max_model_len}"
        raise APIError(400, message, "context_length_exceeded")
    state.max_tokens_of(body)
    if ignored := body.ignored_fields():
        logger.warning("request fields %s accepted and ignored (they cannot change the output)", ignored)
    params = body.sampling_params(tool_constraint(tools, body))
    if params.n > 1 and role:
        raise APIError(
            400, "n: a disaggregated deployment serves one choice per request", "invalid_parameter"
        )
    state.check_capacity()
    request_id = role.pop("request_id", None) or state.new_request_id(kind)
    if state.client.is_in_flight(request_id) or request_id in state.admitting:
        raise APIError(409, f"kv_transfer_params.room {request_id!r} is already in use", "duplicate_room")
    gen = Generation(
        state.client,
        state.tokenizer,
        state.metrics,
        request_id,
        prompt_ids,
        items,
        params,
        state.dispatcher,
        cache_salt=body.cache_salt,
        **role,
    )
    state.admitting.add(gen.request_id)
    try:
        await state.run_with_disconnect(request, gen.start())
        if gen.handoff is not None:  # prefill server: answer once the decode engine has the request
            done = await state.run_with_disconnect(request, gen.handed_off())
    finally:
        state.admitting.discard(gen.request_id)
    return gen, done if gen.handoff is not None else None


def tool_constraint(tools: ToolRequest | None, body) -> StructuredOutputs | None:
    """The grammar that enforces tool_choice "required" or a named function (None: unconstrained)."""
    called = tool_grammar_tools(tools) if tools is not None else None
    if called is None:
        return None
    if structured_of(body) is not None:
        raise APIError(
            400,
            "tool_choice: a required or named tool choice cannot be combined with "
            "response_format or another output constraint",
            "invalid_parameter",
        )
    from mmserve.engine.grammar import tool_call_grammar

    exactly_one = tools.named is not None or not tools.parallel
    return StructuredOutputs(grammar=tool_call_grammar(called, exactly_one=exactly_one))
